"""The largest GPT each ZeRO stage trains within a fixed memory budget per rank.

The paper's central claim: partitioning lets the trainable model grow with the number
of data-parallel ranks; stage 3 at N_d = 4 should train a model about 4x larger than
stage 0 (which cannot grow at all).

How the budget is enforced: by measurement, not by formula. Each candidate runs in
fresh ranks (fp32, AdamW, gloo); each rank records its resident size after start-up
(a tiny model trained first, so that lazily initialised libraries count as
start-up), then builds the model
(``deferred_init``: at stage 3 it is never whole), wraps it and trains two full steps
(forward, backward, optimizer step: Adam's states exist after the first). The peak
resident size (VmHWM) above the start-up size, on the worst rank, must fit the budget.
``MALLOC_MMAP_THRESHOLD_=131072`` keeps glibc from holding freed blocks, which would
charge every stage for memory it no longer uses.

The model grows in depth at a fixed width (dim 256, vocab 8192); sequences are short
(16 tokens, micro-batch 1) so that activations, which ZeRO-DP does not partition, stay
small beside the model states.

    python -m benchmarks.largest_model --budget-mib 256

Prints the table and writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zeroservice
from benchmarks.output import write_result
from zeroservice.data import SyntheticTokens, micro_batch
from zeroservice.launch import run_local
from zeroservice.memory import process_status_kib
from zeroservice.models import GPT, GPTConfig

WIDTH = dict(vocab_size=8192, seq_len=16, n_head=4, dim=256)
STAGES = (0, 1, 2, 3)
WORLDS = (1, 2, 4)


def config(n_layer: int) -> GPTConfig:
    return GPTConfig(n_layer=n_layer, **WIDTH)  # type: ignore[arg-type]


def trial(stage: int, n_layer: int) -> dict:
    """In each rank: peak bytes above start-up while building and training two steps."""
    _train(stage, GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, dim=32))
    gc.collect()  # lazily initialised libraries (meta kernels, BLAS, gloo) now count as start-up
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    base = process_status_kib("VmRSS")
    engine, loss = _train(stage, config(n_layer))
    return {
        "peak_bytes": (process_status_kib("VmHWM") - base) * 1024,
        "model_state_bytes": engine.memory_ledger().model_states,
        "loss": loss,
    }


ENGINE = {"bucket_elements": 2**20, "stage3_prefetch_elements": 2**21}
"""Buffers sized for a memory-bound run (1 Mi-element units and staging; stage 3 gathers
ahead at most 2 Mi elements, about the root's parameters and one block), the same for
every stage. The defaults (8 Mi-element units, a 32 Mi-element prefetch budget) suit
models far larger than these."""


def _train(stage: int, cfg: GPTConfig):
    """Build ``cfg`` into an engine (deferred) and train two full steps."""
    with zeroservice.deferred_init():
        model = GPT(cfg)
    engine = zeroservice.initialize(
        model,
        {"stage": stage, "stage3_persistence_elements": 0, **ENGINE},
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4),
        init=GPT.initializer(cfg),
    )
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=0)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(2):
        x, y = micro_batch(data, step, 0, 1, rank, world)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    engine.close()
    return engine, loss.item()


def fits(stage: int, world: int, n_layer: int, budget: int, log: list) -> bool:
    t0 = time.time()
    try:
        ranks = run_local(trial, world, stage, n_layer, timeout_s=600)
        peak = max(r["peak_bytes"] for r in ranks)
        ok = peak <= budget
    except RuntimeError as exc:  # e.g. killed: counts as not fitting, and is logged
        peak, ok = None, False
        print(f"  trial failed: {str(exc).splitlines()[-1]}", file=sys.stderr)
    log.append({"stage": stage, "world": world, "n_layer": n_layer, "peak_bytes": peak, "fits": ok})
    shown = "-" if peak is None else f"{peak / 2**20:.0f} MiB"
    print(
        f"  stage {stage} N_d {world} n_layer {n_layer:>4}: peak {shown:>9} "
        f"{'fits' if ok else 'too big'} ({time.time() - t0:.0f} s)",
        file=sys.stderr,
        flush=True,
    )
    return ok


def predicted_layers(stage: int, world: int, budget: int) -> int:
    """A first guess from the paper's formula (fp32 Adam), to start the search near."""
    per_param = {0: 16, 1: 8 + 8 / world, 2: 4 + 12 / world, 3: 16 / world}[stage]
    params = budget * 0.8 / per_param
    fixed = config(1).num_params() - (config(2).num_params() - config(1).num_params())
    per_layer = config(2).num_params() - config(1).num_params()
    return max(1, int((params - fixed) / per_layer))


def largest(stage: int, world: int, budget: int, log: list, max_layers: int) -> int:
    """Largest n_layer that fits: gallop from the guess, then bisect."""
    guess = min(max_layers, predicted_layers(stage, world, budget))
    if fits(stage, world, guess, budget, log):
        lo, hi = guess, None
        step = max(1, guess // 4)
        while hi is None:
            candidate = min(max_layers, lo + step)
            if candidate == lo:
                return lo
            if fits(stage, world, candidate, budget, log):
                lo, step = candidate, step * 2
            else:
                hi = candidate
    else:
        hi, lo = guess, 0
        step = max(1, guess // 4)
        while lo == 0:
            candidate = max(1, hi - step)
            if fits(stage, world, candidate, budget, log):
                lo = candidate
            elif candidate == 1:
                return 0
            else:
                hi, step = candidate, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(stage, world, mid, budget, log):
            lo = mid
        else:
            hi = mid
    return lo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-mib", type=int, default=256, help="per rank, above start-up")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--max-layers", type=int, default=256)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    # Inherited by the spawned ranks: glibc reads it when a process starts.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    budget = args.budget_mib * 2**20
    stages = [int(s) for s in args.stages.split(",")]
    worlds = [int(w) for w in args.worlds.split(",")]
    log: list = []
    table: dict[tuple[int, int], int] = {}
    for world in worlds:
        for stage in stages:
            table[(stage, world)] = largest(stage, world, budget, log, args.max_layers)
    print(f"\nlargest GPT trained (2 full steps, fp32 AdamW) within {args.budget_mib} MiB per rank")
    print(f"width: dim {WIDTH['dim']}, vocab {WIDTH['vocab_size']}, seq {WIDTH['seq_len']}")
    head = f"{'N_d':>4}" + "".join(f"{'stage ' + str(s):>24}" for s in stages)
    print(head)
    for world in worlds:
        row = f"{world:>4}"
        base = table.get((0, world))
        for stage in stages:
            n = table[(stage, world)]
            psi = config(n).num_params() if n else 0
            ratio = f" x{psi / config(base).num_params():.1f}" if base and n else ""
            row += f"{f'{n} layers, {psi / 1e6:.1f}M{ratio}':>24}"
        print(row)
    rows = [
        {"stage": s, "world": w, "n_layer": n, "params": config(n).num_params() if n else 0}
        for (s, w), n in table.items()
    ]
    record = {
        "budget_mib": args.budget_mib,
        "width": WIDTH,
        "engine": ENGINE,
        "largest": rows,
        "trials": log,
    }
    write_result(args.out, f"largest-model-{args.budget_mib}mib", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
