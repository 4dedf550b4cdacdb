"""Activation memory with ZeRO-R: checkpointing, P_a, P_a+cpu and the contiguous arena.

Each variant trains the same GPT (stage 2, fp32, AdamW) for a few steps in fresh
ranks (world 4: MP = 2 × DP = 2, or MP = 1 × DP = 4) and reports, per rank:

* the engine's ledger: checkpointed-activation bytes at their peak, on the device
  and on the host (exact, by construction of the store);
* the measured peak resident size above start-up (VmHWM), ranks on gloo/CPU (on
  CUDA, ``engine.allocator_stats()`` gives the caching allocator's fragmentation,
  reserved − allocated, and allocation retries: the figures M_D is meant to improve;
  this script runs the CPU ranks only);
* seconds per step (recomputation costs about one extra forward).

    python -m benchmarks.activations [--steps 3] [--layers 8] [--seq 256]

Prints the table and writes JSON to benchmarks/results/activations.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

import zeroservice
from zeroservice.data import SyntheticTokens, micro_batch
from zeroservice.launch import run_local
from zeroservice.memory import process_status_kib
from zeroservice.models import GPT, GPTConfig
from zeroservice.tensor_parallel import MPGroup

VARIANTS: dict[str, tuple[int, dict]] = {
    "mp1 no checkpointing": (1, {}),
    "mp1 checkpointing": (1, {"activation_checkpointing": True}),
    "mp2 no checkpointing": (2, {}),
    "mp2 checkpointing": (2, {"activation_checkpointing": True}),
    "mp2 P_a": (2, {"activation_checkpointing": True, "partition_activations": True}),
    "mp2 P_a+cpu": (
        2,
        {
            "activation_checkpointing": True,
            "partition_activations": True,
            "cpu_offload_activations": True,
        },
    ),
    "mp2 P_a, no arena": (
        2,
        {
            "activation_checkpointing": True,
            "partition_activations": True,
            "contiguous_activations": False,
        },
    ),
}


def trial(mp: int, extra: dict, layers: int, seq: int, batch: int, steps: int) -> dict:
    topo = zeroservice.build_topology(mp)
    start_kib = process_status_kib("VmRSS")
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=8192, seq_len=seq, n_layer=layers, n_head=8, dim=512)
    model = GPT(cfg, MPGroup(topo.mp_group) if mp > 1 else None)
    engine = zeroservice.initialize(
        model,
        {"stage": 2, **extra},
        lambda ps: torch.optim.AdamW(ps, lr=1e-4),
        topology=topo,
    )
    data = SyntheticTokens(cfg.vocab_size, seq, seed=3)
    times, peak_acts = [], 0
    for step in range(steps):
        x, y = micro_batch(data, step, 0, batch * mp, topo.dp_rank, topo.dp)
        t0 = time.perf_counter()
        loss = engine(x, y)
        peak_acts = max(peak_acts, engine.memory_ledger().activations_peak)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    ledger = engine.memory_ledger()
    out = {
        "checkpointed_bytes_peak": peak_acts,
        "checkpointed_on_host": ledger.activations_host > 0 or extra.get("cpu_offload_activations"),
        "arena_bytes": ledger.activation_arena,
        "peak_rss_above_start_mib": (process_status_kib("VmHWM") - start_kib) / 1024,
        "seconds_per_step": sorted(times[1:] or times)[len(times[1:] or times) // 2],
        "loss": loss.item(),
    }
    engine.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="micro-batch per rank at MP = 1")
    parser.add_argument("--out", default="benchmarks/results/activations.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    rows = {}
    for name, (mp, extra) in VARIANTS.items():
        per_rank = run_local(
            trial, 4, mp, extra, args.layers, args.seq, args.batch, args.steps, threads=1
        )
        rows[name] = {
            "mp": mp,
            "config": extra,
            "checkpointed_mib": max(r["checkpointed_bytes_peak"] for r in per_rank) / 2**20,
            "peak_rss_mib": max(r["peak_rss_above_start_mib"] for r in per_rank),
            "seconds_per_step": max(r["seconds_per_step"] for r in per_rank),
            "loss": per_rank[0]["loss"],
            "per_rank": per_rank,
        }
        print(
            f"{name:24s} checkpoints {rows[name]['checkpointed_mib']:8.2f} MiB   "
            f"peak RSS +{rows[name]['peak_rss_mib']:8.1f} MiB   "
            f"{rows[name]['seconds_per_step']:6.2f} s/step   loss {rows[name]['loss']:.4f}",
            flush=True,
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
