"""What starting a ``run_local`` call's ranks costs, spawned and forked from the warm
server ([Note: ranks forked from a warm server] in zeroservice/launch.py).

Each call runs one of two functions on ``--world`` ranks: one that returns at once (its
time is the ranks' start, their process group and their exit) and one that builds an
optimizer first, as every training rank does (torch's first optimizer imports
torch._dynamo). Calls alternate between the start methods; the fork server's own start
(its imports, once per process) is paid by an untimed first call.

    python -m benchmarks.launch_start --calls 5
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.output import write_result
from zeroservice.launch import START_METHODS, run_local


def _returns_at_once() -> int:
    return 0


def _builds_an_optimizer() -> int:
    import torch

    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    return 0


FUNCTIONS = {"returns at once": _returns_at_once, "builds an optimizer": _builds_an_optimizer}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if args.calls < 1 or args.world < 1:
        ap.error("--calls and --world: at least 1")
    run_local(_returns_at_once, args.world, start="forkserver")  # the server started
    seconds = {f"{name}, {m}": [] for name in FUNCTIONS for m in START_METHODS}
    for _ in range(args.calls):
        for name, fn in FUNCTIONS.items():
            for method in START_METHODS:
                t0 = time.perf_counter()
                run_local(fn, args.world, start=method)
                seconds[f"{name}, {method}"].append(time.perf_counter() - t0)
    print(f"\nseconds per run_local call, world {args.world}")
    print(f"{'function, start':<32} {'median':>7}  each")
    for key, each in seconds.items():
        print(f"{key:<32} {statistics.median(each):>7.3f}  {', '.join(f'{s:.2f}' for s in each)}")
    write_result(args.out, "launch-start", {"world": args.world, "seconds": seconds})


if __name__ == "__main__":
    main()
