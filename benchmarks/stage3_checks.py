"""What stage 3's always-on consensus checks cost beside the step they guard
([Note: rank-divergent control flow] in zeroservice/gather_check.py).

    python -m benchmarks.stage3_checks --model small --world 2

Trains the GPT at stage 3 (AdamW, the benchmarks' micro-batch, the debug per-gather
check off, as jobs run) and times, on every rank: the step (forward, backward,
optimizer step, the checks inside it), the forward's read consensus
(``ForwardReads.check``, once per forward) and the step's gather digest
(``GatherDigest.check``, once per optimizer step), each called on its own many times.
Prints the worst rank's figures and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import zeroservice
from benchmarks.output import write_result
from benchmarks.systems import MICRO_BATCH, MODELS
from zeroservice.launch import run_local
from zeroservice.models import GPT


def _per_call(fn, calls: int) -> float:
    for _ in range(calls // 10):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def trial(model: str, steps: int, calls: int) -> dict:
    cfg = MODELS[model]
    torch.manual_seed(0)
    engine = zeroservice.initialize(
        GPT(cfg),
        {"stage": 3, "stage3_check_gathers": False},
        lambda ps: torch.optim.AdamW(ps, lr=1e-4),
    )
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    x = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_len), generator=g)
    seconds = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        engine.backward(engine(x, y))
        engine.step()
        if i >= 2:
            seconds.append(time.perf_counter() - t0)
    reads, gatherer = engine._forward_reads, engine.gatherer
    assert reads is not None and gatherer is not None and gatherer.digest is not None
    read_units = set(gatherer.forward_reads)
    digest = gatherer.digest
    return {
        "step_s": statistics.median(seconds),
        "reads_s": _per_call(lambda: reads.check(read_units), calls),
        "digest_s": _per_call(digest.check, calls),
        "units": len(engine.units),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small", choices=sorted(MODELS))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="timed steps (after 2 warm-up)")
    ap.add_argument("--calls", type=int, default=500, help="timed calls of each check")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    ranks = run_local(trial, args.world, args.model, args.steps, args.calls, timeout_s=900)
    worst = {k: max(r[k] for r in ranks) for k in ("step_s", "reads_s", "digest_s")}
    print(f"stage 3, {args.model} GPT, world {args.world}, {ranks[0]['units']} units")
    print(f"{'':24} {'ms per call':>11} {'calls/step':>10} {'share of step':>13}")
    print(f"{'step':24} {worst['step_s'] * 1e3:11.1f} {1:10} {'':>13}")
    for name, key in (("forward read consensus", "reads_s"), ("step gather digest", "digest_s")):
        share = worst[key] / worst["step_s"]
        print(f"{name:24} {worst[key] * 1e3:11.2f} {1:10} {share:13.2%}")
    record = {**vars(args), **worst, "ranks": ranks}
    write_result(args.out, f"stage3-checks-{args.model}-w{args.world}", record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
