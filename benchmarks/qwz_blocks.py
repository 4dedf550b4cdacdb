"""qwZ's rounding per parameter: blocks counted from the shard's start against blocks
within each parameter ([Note: blocks within a parameter] in zeroservice/quantize.py).

    python -m benchmarks.qwz_blocks --model small --world 4

Builds the GPT, moves its LayerNorm gains and the biases off their initial values as
training does (gains 1 + N(0, 0.01), biases N(0, 0.001)), forms stage 3's units as the
engine does and quantizes every rank's shard of each both ways. Prints the parameters
with the largest relative error (|error| / |parameter|) and writes JSON.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.output import write_result
from benchmarks.systems import MODELS
from zeroservice.flat import build_units
from zeroservice.models import GPT
from zeroservice.quantize import (
    dequantize,
    dequantize_pieces_into,
    pieces,
    pieces_bytes,
    quantize,
    quantize_pieces_into,
)
from zeroservice.units import plan_layout
from zeroservice.zeropp import shard_cuts


def _round_trip(unit, block: int, cut: bool) -> torch.Tensor:
    """The unit's whole buffer as qwZ delivers it, every rank's shard quantized."""
    size, out = unit.shard_numel, torch.empty(unit.padded_numel)
    full = unit.flat
    cuts = shard_cuts(unit) if cut else [[] for _ in range(unit.shard_world)]
    for r in range(unit.shard_world):
        shard, spans = full[r * size : (r + 1) * size], pieces(size, cuts[r])
        if cut:
            row = torch.empty(pieces_bytes(spans, 8, block), dtype=torch.uint8)
            quantize_pieces_into(shard, spans, 8, block, row)
            dequantize_pieces_into(row, spans, 8, block, out[r * size : (r + 1) * size])
        else:
            out[r * size : (r + 1) * size] = dequantize(quantize(shard, 8, block), size, 8, block)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", choices=sorted(MODELS))
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    torch.manual_seed(0)
    model = GPT(MODELS[args.model])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".ln" in f".{name}" and name.endswith("weight"):
                param += 0.01 * torch.randn_like(param)
            elif name.endswith("bias"):
                param += 0.001 * torch.randn_like(param)
    layout = plan_layout(model, world=args.world, stage=3)
    rows = []
    for unit in build_units(layout.chunks, torch.float32, args.world, 0):
        whole = unit.flat.clone()
        got = {cut: _round_trip(unit, args.block, cut) for cut in (False, True)}
        for slot in unit.slots:
            ref = whole[slot.offset : slot.offset + slot.numel]
            err = {
                cut: float((v[slot.offset : slot.offset + slot.numel] - ref).norm() / ref.norm())
                for cut, v in got.items()
            }
            rows.append(
                {
                    "parameter": slot.names[0],
                    "numel": slot.numel,
                    "shard_blocks": err[False],
                    "parameter_blocks": err[True],
                }
            )
    rows.sort(key=lambda r: -r["shard_blocks"])
    print(f"GPT '{args.model}', world {args.world}, block {args.block}: relative error")
    print(f"{'parameter':<28}{'numel':>9}{'shard blocks':>14}{'param blocks':>14}")
    for r in rows[: args.top]:
        print(
            f"{r['parameter']:<28}{r['numel']:>9}{r['shard_blocks']:>13.2%}"
            f"{r['parameter_blocks']:>14.2%}"
        )
    for key in ("shard_blocks", "parameter_blocks"):
        print(f"worst with {key.replace('_', ' ')}: {max(r[key] for r in rows):.2%}")
    write_result(
        args.out, f"qwz-blocks-{args.model}-w{args.world}", {"args": vars(args), "rows": rows}
    )


if __name__ == "__main__":
    main()
