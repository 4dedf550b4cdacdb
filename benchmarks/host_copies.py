"""What ``redundancy: host-copy`` costs a training step, with and without reused buffers.

Two bare processes on gloo, one torch thread each, no Ray: the recovery benchmark's
model (``--model``, as in ``benchmarks.recovery``) at stage 2, N_d = 2, fp32 AdamW, one
micro-batch per step. Modes, each a fresh pair of processes:

* ``none``: no host copies;
* ``fresh``: a copy after every step, each into fresh memory (the caller takes every
  copy with ``peer_snapshot()``, so none is written again: the behaviour before
  [Note: reused copy buffers]);
* ``reused``: a copy after every step, written into the spare's buffers.

The table gives rank 0's medians over ``--steps`` steps (the first one left out) of
forward + backward and of ``engine.step()`` (which takes the copy and exchanges it), and
the peak resident memory over the run (VmHWM).

    python -m benchmarks.host_copies --model large
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks.output import write_result
from benchmarks.recovery import MODELS

MODES = ("none", "fresh", "reused")


def _steps(model: str, mode: str, steps: int) -> dict[str, object]:
    import torch

    import zeroservice
    from zeroservice.models import GPT
    from zeroservice.models.gpt import GPTConfig

    fields, batch = MODELS[model]
    cfg = GPTConfig(**fields)
    torch.manual_seed(0)
    config = {"stage": 2, "redundancy": "none" if mode == "none" else "host-copy"}
    engine = zeroservice.initialize(
        GPT(cfg), config, lambda params: torch.optim.AdamW(params, lr=1e-4)
    )
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    forward_backward, step = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.backward(engine(x, x))
        t1 = time.perf_counter()
        engine.step()
        if mode == "fresh":
            engine.peer_snapshot()
        forward_backward.append(t1 - t0)
        step.append(time.perf_counter() - t1)
    ledger = engine.memory_ledger()
    engine.close()
    hwm = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("VmHWM:")
    )
    return {
        "forward_backward": forward_backward,
        "step": step,
        "peak_rss": hwm,
        "redundancy_host": ledger.redundancy_host,
        "redundancy_spare": ledger.redundancy_spare,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="large")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps: must be >= 2 (the first is left out), got {args.steps}")
    from zeroservice.launch import run_local

    runs = {m: run_local(_steps, 2, args.model, m, args.steps, timeout_s=1800) for m in MODES}
    print(f"\nhost copies, --model {args.model}, stage 2, N_d = 2, rank 0, medians of steps 2-")
    print(f"{'mode':8s}{'fwd+bwd s':>11s}{'step s':>9s}{'peak RSS MiB':>14s}{'copies MiB':>12s}")
    summary = {}
    for mode, ranks in runs.items():
        r = ranks[0]
        row = {
            "forward_backward_s": statistics.median(r["forward_backward"][1:]),
            "step_s": statistics.median(r["step"][1:]),
            "peak_rss": max(x["peak_rss"] for x in ranks),
            "copies": r["redundancy_host"] + r["redundancy_spare"],
        }
        summary[mode] = row
        print(
            f"{mode:8s}{row['forward_backward_s']:11.2f}{row['step_s']:9.2f}"
            f"{row['peak_rss'] / 2**20:14.0f}{row['copies'] / 2**20:12.0f}"
        )
    record = {"model": args.model, "steps": args.steps, "summary": summary, "runs": runs}
    write_result(args.out, f"host-copies-{args.model}", record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
