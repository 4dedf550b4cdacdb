"""One configuration's peak, phase by phase, beside the peak model's moments.

    python -m benchmarks.peak_phases --model large --stage 3 [--default-malloc]

Trains the GPT (``benchmarks.systems.MODELS``) for two steps in two fresh gloo ranks with
the planner oracle's protocol (``benchmarks.planner_oracle.measure``: VmHWM above a
warmed-up start-up, reset at every forward, backward and step; MKL's buffer cache off)
and prints each phase's peak on every rank beside ``zeroservice.peak.predict_peak``'s
moments. Writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import os

from benchmarks.output import write_result
from benchmarks.planner_oracle import measure
from benchmarks.systems import MODELS
from zeroservice.launch import run_local
from zeroservice.peak import PeakConfig, predict_peak

MIB = 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="large", choices=sorted(MODELS))
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--default-malloc", action="store_true", help="glibc's default")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    if args.default_malloc:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    else:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # spawned ranks read it at start-up
    os.environ["MKL_DISABLE_FAST_MM"] = "1"
    cfg = MODELS[args.model]
    ranks = run_local(measure, 2, cfg, args.micro_batch, 1, {"stage": args.stage}, timeout_s=900)
    predicted = predict_peak(PeakConfig(cfg, stage=args.stage, dp=2, micro_batch=args.micro_batch))
    print(f"GPT '{args.model}', stage {args.stage}, world 2, micro-batch {args.micro_batch}")
    print(f"{'rank':<6}{'phase':<10}{'step':>5}{'peak MiB':>10}{'end MiB':>10}")
    for rank, r in enumerate(ranks):
        for phase, step, hwm, rss in r["phases"]:
            print(f"{rank:<6}{phase:<10}{step:>5}{hwm / MIB:>10.1f}{rss / MIB:>10.1f}")
    print("\npredicted moments (MiB): ", end="")
    print(", ".join(f"{k} {v / MIB:.1f}" for k, v in predicted.phases.items()))
    print(
        f"measured peak {max(r['peak_bytes'] for r in ranks) / MIB:.1f} MiB "
        f"({ranks[0]['peak_phase']}), predicted {predicted.peak / MIB:.1f} ({predicted.phase})"
    )
    malloc = "default" if args.default_malloc else "mmap"
    record = {"args": vars(args), "ranks": ranks, "predicted": predicted.as_dict()}
    write_result(args.out, f"peak-phases-{args.model}-s{args.stage}-{malloc}", record)


if __name__ == "__main__":
    main()
