"""Side-by-side: our ZeRO stages 0-3 against DDP, torch ZeRO-1, FSDP2 and DeepSpeed.

Every system trains the same GPT on the same batches, world 2 (or --world) on CPU/gloo,
fp32 AdamW,
no clipping, one torch thread per rank. Systems run interleaved (A B C A B C ...),
each run in fresh processes, and ratios are taken within a repeat, so that drift of a
shared machine hits both sides of a ratio alike.

    python -m benchmarks.compare --model small --repeats 3 --steps 8 --paired-steps 20
    python -m benchmarks.compare --model large --repeats 2 --steps 4 --paired-steps 6
    python -m benchmarks.compare --model large --systems zero3,fsdp2,deepspeed3,ddp \
        --repeats 2 --steps 3 --warmup 1 --paired-steps 4 [--default-malloc] [--world 4]

``--paired-steps`` adds the most drift-proof ratio: ours and one peer built in the same
ranks and stepped in rotation on the same batches.

Prints a table and writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

from benchmarks.output import write_result
from benchmarks.systems import MODELS, SYSTEMS, run_pair, run_system
from zeroservice.launch import run_local


def paper_fp32_bytes(stage: int, n_d: int) -> float:
    """Model-state bytes per parameter in fp32 with Adam, by stage."""
    return {0: 16, 1: 8 + 8 / n_d, 2: 4 + 12 / n_d, 3: 16 / n_d}[stage]


def _available(names: list[str]) -> list[str]:
    have_ds = importlib.util.find_spec("deepspeed") is not None
    return [n for n in names if have_ds or not n.startswith("deepspeed")]


def _one_run(name: str, args) -> dict | None:
    try:
        ranks = run_local(
            run_system, args.world, name, args.model, args.steps, args.warmup, timeout_s=3000
        )
    except RuntimeError as exc:  # a peer that does not run here is reported, not fatal
        reason = str(exc).strip().splitlines()[-1]
        print(f"{name}: failed, skipped: {reason}", file=sys.stderr, flush=True)
        return None
    r0 = ranks[0]
    r0["median_s"] = statistics.median(r0["times"])
    r0["peak_rss_mib_per_rank"] = [r["peak_rss_mib"] for r in ranks]
    r0["peak_rss_mib"] = max(r["peak_rss_mib"] for r in ranks)
    return r0


def _summary(runs: dict[str, list[dict]], world: int) -> dict[str, dict]:
    out = {}
    for name, rs in runs.items():
        if not rs:
            continue
        medians = [r["median_s"] for r in rs]
        first = rs[0]
        psi = first["psi"]
        out[name] = {
            "stage": SYSTEMS[name][0],
            "median_step_s": statistics.median(medians),
            "run_medians_s": medians,
            "tokens_per_s": first["tokens_per_step"] / statistics.median(medians),
            "model_state_bytes": first["model_state_bytes"],
            "bytes_per_param": first["model_state_bytes"] / psi,
            "paper_bytes_per_param": paper_fp32_bytes(SYSTEMS[name][0], world),
            "comm_psi_per_step": (
                None
                if first["comm_elements_per_step"] is None
                else first["comm_elements_per_step"] / psi
            ),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in rs),
            "peak_rss_mib_per_rank": [
                max(col) for col in zip(*(r["peak_rss_mib_per_rank"] for r in rs), strict=True)
            ],
            "final_loss": first["losses"][-1],
            "losses": first["losses"],
            "psi": psi,
        }
    return out


def _ratios(runs: dict[str, list[dict]]) -> list[dict]:
    """Ours / each peer at the same stage, per repeat (interleaved pairs)."""
    out = []
    for ours in (name for name in SYSTEMS if name.startswith("zero")):
        if not runs.get(ours):
            continue
        stage = SYSTEMS[ours][0]
        for peer, (peer_stage, _) in SYSTEMS.items():
            if peer.startswith("zero") or not runs.get(peer) or peer_stage != stage:
                continue
            per_repeat = [
                a["median_s"] / b["median_s"] for a, b in zip(runs[ours], runs[peer], strict=True)
            ]
            out.append(
                {
                    "ours": ours,
                    "peer": peer,
                    "stage": stage,
                    "ratio_median": statistics.median(per_repeat),
                    "ratio_min": min(per_repeat),
                    "ratio_max": max(per_repeat),
                }
            )
    return out


PEERS = [
    ("zero0", "ddp"),
    ("zero1", "torch_zero1"),
    ("zero1", "deepspeed1"),
    ("zero2", "deepspeed2"),
    ("zero3", "fsdp2"),
    ("zero3", "deepspeed3"),
]
PAIRS = PEERS + [(f"{ours}-shm", peer) for ours, peer in PEERS]
"""Ours (with the default collectives, then through shared memory) against each peer."""


def _paired(names: list[str], args) -> list[dict]:
    """Ours and each same-stage peer in the same ranks, stepped in rotation."""
    out = []
    for ours, peer in PAIRS:
        if ours not in names or peer not in names:
            continue
        t0 = time.time()
        try:
            r = run_local(
                run_pair,
                args.world,
                [ours, peer],
                args.model,
                args.paired_steps,
                args.warmup,
                timeout_s=3000,
            )[0]
        except RuntimeError as exc:
            reason = str(exc).strip().splitlines()[-1]
            print(f"paired {ours}/{peer}: failed, skipped: {reason}", file=sys.stderr)
            continue
        ratios = sorted(a / b for a, b in zip(r["times"][ours], r["times"][peer], strict=True))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        out.append(
            {
                "ours": ours,
                "peer": peer,
                "steps": len(ratios),
                "ratio_median": statistics.median(ratios),
                "ratio_q1": q[0],
                "ratio_q3": q[2],
                "ours_median_s": statistics.median(r["times"][ours]),
                "peer_median_s": statistics.median(r["times"][peer]),
                "max_loss_diff": max(
                    abs(a - b) for a, b in zip(r["losses"][ours], r["losses"][peer], strict=True)
                ),
            }
        )
        print(
            f"paired {ours}/{peer}: {out[-1]['ratio_median']:.3f} ({time.time() - t0:.0f} s wall)",
            file=sys.stderr,
            flush=True,
        )
    return out


def _print_paired(paired: list[dict]) -> None:
    print("\npaired step-time ratio, ours / peer, same ranks stepped in rotation")
    cols = [("pair", -26), ("steps", 6), ("median", 8), ("q1-q3", 15), ("ours s", 8)]
    cols += [("peer s", 8), ("|dloss|", 10)]
    print("  " + "".join(f"{c:<{-w}}" if w < 0 else f"{c:>{w}}" for c, w in cols))
    for p in paired:
        print(
            f"  {p['ours'] + ' / ' + p['peer']:<26}{p['steps']:>6}{p['ratio_median']:>8.3f}"
            f"{p['ratio_q1']:>8.3f}-{p['ratio_q3']:.3f}{p['ours_median_s']:>8.3f}"
            f"{p['peer_median_s']:>8.3f}{p['max_loss_diff']:>10.1e}"
        )


def _print(summary: dict[str, dict], ratios: list[dict], args) -> None:
    psi = next(iter(summary.values()))["psi"]
    print(
        f"\nGPT '{args.model}' ({psi / 1e6:.1f}M parameters), world {args.world}, gloo, "
        f"fp32 AdamW, MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'default')}"
    )
    print(f"{args.repeats} interleaved repeats x {args.steps} timed steps (+{args.warmup} warm-up)")
    print("B/param: model-state bytes per parameter on rank 0, after the last backward")
    print("RSS MiB: peak resident size, the largest over ranks and repeats\n")
    head = (
        f"{'system':<12}{'stage':>6}{'step s':>9}{'spread':>15}{'tok/s':>9}"
        f"{'B/param':>9}{'paper':>7}{'comm Ψ':>8}{'RSS MiB':>9}{'loss':>9}"
    )
    print(head)
    print("-" * len(head))
    for name, s in summary.items():
        spread = f"{min(s['run_medians_s']):.3f}-{max(s['run_medians_s']):.3f}"
        comm = "-" if s["comm_psi_per_step"] is None else f"{s['comm_psi_per_step']:.2f}"
        print(
            f"{name:<12}{s['stage']:>6}{s['median_step_s']:>9.3f}{spread:>15}"
            f"{s['tokens_per_s']:>9.0f}{s['bytes_per_param']:>9.2f}"
            f"{s['paper_bytes_per_param']:>7.1f}{comm:>8}{s['peak_rss_mib']:>9.0f}"
            f"{s['final_loss']:>9.4f}"
        )
    print("\nstep-time ratio, ours / peer at the same stage (median, min-max over repeats)")
    for r in ratios:
        print(
            f"  {r['ours']:<9} / {r['peer']:<12} {r['ratio_median']:.3f}  "
            f"({r['ratio_min']:.3f}-{r['ratio_max']:.3f})"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--world", type=int, default=2, help="ranks (processes)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated")
    parser.add_argument(
        "--default-malloc",
        action="store_true",
        help="keep glibc's default malloc settings (else MALLOC_MMAP_THRESHOLD_=131072)",
    )
    parser.add_argument(
        "--paired-steps",
        type=int,
        default=0,
        help="also time ours against each same-stage peer in the same ranks, in rotation",
    )
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    names = _available([n.strip() for n in args.systems.split(",") if n.strip()])
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems: {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    if not args.default_malloc:
        # Inherited by the spawned ranks; glibc reads it at process start.
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for repeat in range(args.repeats):
        for name in names:
            t0 = time.time()
            result = _one_run(name, args)
            if result is None:
                continue
            runs[name].append(result)
            print(
                f"repeat {repeat + 1}/{args.repeats} {name:<12} "
                f"median {result['median_s']:.3f} s  ({time.time() - t0:.0f} s wall)",
                file=sys.stderr,
                flush=True,
            )
    paired = _paired(names, args) if args.paired_steps else []
    summary, ratios = _summary(runs, args.world), _ratios(runs)
    _print(summary, ratios, args)
    if paired:
        _print_paired(paired)
    meta = {
        "model": args.model,
        "world": args.world,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE"),
    }
    record = {"meta": meta, "summary": summary, "ratios": ratios, "paired": paired}
    write_result(args.out, f"compare-{args.model}-w{args.world}", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
