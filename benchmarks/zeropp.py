"""ZeRO++ at stage 3: bytes by link, step time and loss for each switch.

World 4 as 2 nodes x 2 ranks (``ranks_per_node=2``) on gloo, bf16 with fp32 masters,
AdamW, the synthetic Markov-chain tokens. Bytes are what one step's parameter and
gradient collectives received on rank 0 (see [Note: bytes by link] in zeroservice/comm.py),
in units of Psi fp16 (bf16) bytes, i.e. 2 Psi bytes.

    python -m benchmarks.zeropp --model small --steps 3 --warmup 1
    python -m benchmarks.zeropp --convergence --model small --seeds 3 --conv-steps 300

``--convergence`` trains the unquantized run and the run with all three switches (or
``--conv-row``'s, with ``--block``'s quantization block if given) from the same seeds
and prints each seed's final loss and their relative difference.
Prints a table and writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import zeroservice
from benchmarks.systems import MICRO_BATCH, MODELS
from zeroservice.data import SyntheticTokens, micro_batch
from zeroservice.launch import run_local
from zeroservice.models import GPT, GPTConfig

WORLD = 4
RANKS_PER_NODE = 2
MODELS = {
    **MODELS,
    # 0.9M parameters: the convergence runs' model, small enough for hundreds of steps.
    "tiny": GPTConfig(vocab_size=1024, seq_len=64, n_layer=2, n_head=4, dim=128, tie_weights=False),
}
ROWS = {
    "baseline": {},
    "qwZ": {"quantized_weights": True},
    "qgZ(int8)": {"quantized_gradients": "int8"},
    "qgZ(int4)": {"quantized_gradients": "int4"},
    "hpZ": {"hierarchical_partition": True},
    "all three": {
        "quantized_weights": True,
        "quantized_gradients": "int4",
        "hierarchical_partition": True,
    },
}
LR = 1e-3


def _engine(model_name: str, switches: dict, seed: int):
    torch.manual_seed(seed)
    model = GPT(MODELS[model_name])
    config = {
        "stage": 3,
        "precision": "bf16",
        "ranks_per_node": RANKS_PER_NODE,
        "stage3_persistence_elements": 0,
        **switches,
    }
    return zeroservice.initialize(
        model, config, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.0)
    )


def _step(engine, data, step: int) -> float:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    x, y = micro_batch(data, step, 0, MICRO_BATCH, rank, world, 1)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    t = torch.tensor([loss.item()], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return t.item() / world


def _link_bytes(engine) -> tuple[int, int]:
    ledger = engine.comm_ledger()
    tags = [s.tag for s in ledger.entries.values() if s.tag.startswith(("params", "grads"))]
    return ledger.link_bytes(tuple(tags))


def run_row(model_name: str, switches: dict, steps: int, warmup: int) -> dict:
    """In each rank: warm-up steps, then ``steps`` timed steps; bytes of the last one."""
    engine = _engine(model_name, switches, seed=0)
    cfg = MODELS[model_name]
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=0)
    for step in range(warmup):
        _step(engine, data, step)
    times, loss = [], 0.0
    for step in range(warmup, warmup + steps):
        engine.comm_ledger().reset()
        t0 = time.perf_counter()
        loss = _step(engine, data, step)
        times.append(time.perf_counter() - t0)
    intra, cross = _link_bytes(engine)
    memory = engine.memory_ledger()
    return {
        "psi": engine.psi,
        "intra_node_bytes": intra,
        "cross_node_bytes": cross,
        "step_s": statistics.median(times),
        "times": times,
        "final_loss": loss,
        "secondary_peak_bytes": memory.secondary_peak,
        "quantization_scratch_peak_bytes": memory.quantization_scratch_peak,
    }


def run_convergence(
    model_name: str, seed: int, steps: int, row: str = "all three", block: int | None = None
) -> dict[str, list[float]]:
    """In each rank: the baseline and the run with ``row``'s switches (and quantization
    ``block``, if given), from the same seed."""
    cfg = MODELS[model_name]
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=seed)
    out = {}
    for name in ("baseline", row):
        switches = dict(ROWS[name])
        if block is not None and name != "baseline":
            switches["quantization_block"] = block
        engine = _engine(model_name, switches, seed)
        out[name] = [_step(engine, data, step) for step in range(steps)]
        engine.close()
    return out


def _table(args) -> dict:
    rows = {}
    for name, switches in ROWS.items():
        r = run_local(run_row, WORLD, args.model, switches, args.steps, args.warmup)[0]
        fp16_psi = 2 * r["psi"]
        r["cross_node_psi"] = r["cross_node_bytes"] / fp16_psi
        r["intra_node_psi"] = r["intra_node_bytes"] / fp16_psi
        rows[name] = r
        print(
            f"{name:<10} cross-node {r['cross_node_psi']:6.3f} Psi  intra-node "
            f"{r['intra_node_psi']:6.3f} Psi  step {r['step_s']:6.3f} s  "
            f"loss {r['final_loss']:.4f}",
            flush=True,
        )
    return rows


def _convergence(args, save) -> dict:
    out: dict[int, dict] = {}
    row = args.conv_row
    for seed in args.seed_list or range(args.seeds):
        losses = run_local(
            run_convergence, WORLD, args.model, seed, args.conv_steps, row, args.block
        )[0]
        b, q = losses["baseline"][-1], losses[row][-1]
        out[seed] = {**losses, "relative": (q - b) / b}
        print(
            f"seed {seed}: baseline {b:.4f}  {row} {q:.4f}  difference {100 * (q - b) / b:+.2f}%",
            flush=True,
        )
        save(out)  # each seed as it finishes
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", choices=sorted(MODELS))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--convergence", action="store_true")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--conv-steps", type=int, default=300)
    p.add_argument("--conv-row", default="all three", choices=sorted(ROWS))
    p.add_argument("--seed-list", type=int, nargs="+", help="these seeds instead of --seeds")
    p.add_argument(
        "--block", type=int, help="the quantized run's quantization_block (default: the engine's)"
    )
    args = p.parse_args()
    results: dict = {"world": WORLD, "ranks_per_node": RANKS_PER_NODE, "args": vars(args)}
    if args.convergence:
        name = f"zeropp-convergence-{args.model}-{args.conv_steps}"
        if args.conv_row != "all three":
            name += "-" + "".join(c for c in args.conv_row if c.isalnum())
        if args.block is not None:
            name += f"-block{args.block}"
    else:
        name = f"zeropp-{args.model}"
    path = Path(__file__).parent / "results" / f"{name}.json"

    def save(key: str, value) -> None:
        results[key] = value
        path.write_text(json.dumps(results, indent=1))

    if args.convergence:
        _convergence(args, lambda seeds: save("convergence", seeds))
    else:
        save("rows", _table(args))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
