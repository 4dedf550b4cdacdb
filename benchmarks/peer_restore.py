"""What a newcomer's restore from peers costs, by how the slices travel.

Two bare processes on gloo, one torch thread each, no Ray: rank 0 trains the recovery
benchmark's model (``--model``, as in ``benchmarks.recovery``) alone at stage 2 for one
step and takes its host copy; then both ranks build an engine at world 2 as a
re-forming rank does (``zeroservice.RESTORED``) and restore from rank 0's copy, the
newcomer (rank 1) receiving half of every master and optimizer state. Modes:

* ``packed``: every slice in one packed message per pair of ranks, received into a
  staging buffer and copied into place (``DIRECT_BYTES`` set past any slice);
* ``direct``: slices of at least ``DIRECT_BYTES`` sent from the holder's copy and
  received straight into the engine's tensors ([Note: slices straight into place]);
* ``lent``: as ``direct``, the holder lending its engine's own tensors instead of
  taking a copy of them ([Note: a grow lends its state]), as a re-forming rank does.

``--ballast-gib``: each rank first fills that much memory, as the rest of a busy node
would (the recovery benchmark's large join ran with 16 GiB of 24 in use). Each run is a
fresh pair of processes; modes alternate over ``--repeats``. The table
gives each rank's seconds in ``restore_from_peers`` and the memory it added at its peak
(VmHWM, reset just before, less the resident memory then), and for the whole hand-over
(the holder's snapshot, its old engine dropped, the new engine built, the restore) the
holder's seconds in ``snapshot_now`` and each rank's peak above its resident memory
when the hand-over began (the ballast not counted).

    python -m benchmarks.peer_restore --model large --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path

from benchmarks.output import write_result
from benchmarks.recovery import MODELS

MODES = ("packed", "direct", "lent")


def _status(field: str) -> int:
    """Bytes of a /proc/self/status field (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status: no {field}")


def _restore(model: str, mode: str, ballast_gib: float) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    import zeroservice
    from zeroservice.checkpoint import peers
    from zeroservice.models import GPT
    from zeroservice.models.gpt import GPTConfig

    if mode == "packed":
        peers.DIRECT_BYTES = 1 << 62
    fields, batch = MODELS[model]
    cfg = GPTConfig(**fields)
    rank = dist.get_rank()

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-4)

    solo = dist.new_group([0])
    held, snapshot_s = None, 0.0
    if rank == 0:
        engine = zeroservice.initialize(GPT(cfg), {"stage": 2}, adamw, group=solo)
        x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
        engine.backward(engine(x, x))
        engine.step()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on: the hand-over's
    start = _status("VmRSS")
    if rank == 0:
        t0 = time.perf_counter()
        held = engine.snapshot_now(lend=mode == "lent")
        snapshot_s = time.perf_counter() - t0
        engine.close()
        del engine
        gc.collect()
    with zeroservice.deferred_init():
        model_ = GPT(cfg)
    restored = zeroservice.initialize(model_, {"stage": 2}, adamw, init=zeroservice.RESTORED)
    built_peak = _status("VmHWM")
    ballast_bytes = int(ballast_gib * 2**30)
    ballast = torch.ones(ballast_bytes, dtype=torch.uint8)  # noqa: F841 (held)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on: the restore's
    before = _status("VmRSS")
    dist.barrier()
    t0 = time.perf_counter()
    result = restored.restore_from_peers(held)
    seconds = time.perf_counter() - t0
    received = restored.comm_ledger().entries.get(("recv", "load"))
    restore_peak = _status("VmHWM")
    restored.close()
    return {
        "seconds": seconds,
        "snapshot_s": snapshot_s,
        "handover_rss": max(built_peak, restore_peak - ballast_bytes) - start,
        "step": result.step,
        "added_rss": _status("VmHWM") - before,
        "messages": received.calls if received is not None else 0,
        "received_bytes": received.payload_bytes if received is not None else 0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="large")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--ballast-gib",
        type=float,
        default=0.0,
        help="memory each rank fills before the restore, as the rest of a busy node would",
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats: must be >= 1, got {args.repeats}")
    if args.ballast_gib < 0:
        parser.error(f"--ballast-gib: must be >= 0, got {args.ballast_gib}")
    from zeroservice.launch import run_local

    runs: dict[str, list[list[dict[str, float]]]] = {m: [] for m in args.modes}
    for _ in range(args.repeats):
        for mode in args.modes:
            pair = run_local(_restore, 2, args.model, mode, args.ballast_gib, timeout_s=1800)
            runs[mode].append(pair)
    print(
        f"\nrestore from peers, --model {args.model}, world 2 (rank 1 the newcomer), "
        f"ballast {args.ballast_gib:g} GiB per rank"
    )
    print(
        f"{'mode':8s}{'holder s':>10s}{'newcomer s':>12s}{'msgs':>6s}"
        f"{'holder +MiB':>13s}{'newcomer +MiB':>15s}{'snapshot s':>12s}"
        f"{'snapshot+restore s':>20s}{'hand-over holder +MiB':>23s}{'newcomer +MiB':>15s}"
    )
    summary = {}
    for mode, pairs in runs.items():
        row = {
            "holder_s": statistics.median(p[0]["seconds"] for p in pairs),
            "newcomer_s": statistics.median(p[1]["seconds"] for p in pairs),
            "holder_rss": max(p[0]["added_rss"] for p in pairs),
            "newcomer_rss": max(p[1]["added_rss"] for p in pairs),
            "messages": pairs[0][1]["messages"],
            "snapshot_s": statistics.median(p[0]["snapshot_s"] for p in pairs),
            "handover_s": statistics.median(p[0]["snapshot_s"] + p[0]["seconds"] for p in pairs),
            "handover_holder_rss": max(p[0]["handover_rss"] for p in pairs),
            "handover_newcomer_rss": max(p[1]["handover_rss"] for p in pairs),
        }
        summary[mode] = row
        print(
            f"{mode:8s}{row['holder_s']:10.2f}{row['newcomer_s']:12.2f}{row['messages']:6d}"
            f"{row['holder_rss'] / 2**20:13.0f}{row['newcomer_rss'] / 2**20:15.0f}"
            f"{row['snapshot_s']:12.2f}{row['handover_s']:20.2f}"
            f"{row['handover_holder_rss'] / 2**20:23.0f}"
            f"{row['handover_newcomer_rss'] / 2**20:15.0f}"
        )
    record = {
        "model": args.model,
        "ballast_gib": args.ballast_gib,
        "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE"),
        "summary": summary,
        "runs": runs,
    }
    write_result(args.out, f"peer-restore-{args.model}", record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
