"""No stage holds more bytes than the stage below it, at any model size, with the default
configuration: model states plus every buffer the engine allocated (the peak of its
staging buffers, the gathered parameters at their peak, the ring's scratch). See
[Note: stage order] in units.py."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import zeroservice
from tests.engine.harness import token_batches
from zeroservice.config import ZeroConfig
from zeroservice.launch import run_local
from zeroservice.models import GPT, GPTConfig
from zeroservice.units import stage_slack

# From ~30 thousand to ~6 million parameters: all below the default C_B (2^23), where
# uncapped units would make stage 2 stage whole-model gradient copies.
GPTS = {
    "gpt-2x32": dict(vocab_size=256, seq_len=16, n_head=2, dim=32, n_layer=2),
    "gpt-4x128": dict(vocab_size=1024, seq_len=32, n_head=4, dim=128, n_layer=4),
    "gpt-6x256": dict(vocab_size=4096, seq_len=32, n_head=4, dim=256, n_layer=6),
}
PRECISIONS = ("fp32", "bf16")


class Wide(nn.Module):
    """Not a transformer: two weights each larger than a quarter of the model (so their
    units exceed the capped C_B and are reduced in pieces) around two small blocks."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(512, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(2))
        self.out = nn.Linear(64, 512)

    def forward(self, x, y):
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return nn.functional.cross_entropy(self.out(h).flatten(0, 1), y.flatten())


def _peak_bytes(m: dict) -> int:
    return (
        m["params"]
        + m["grads"]
        + m["master"]
        + m["optimizer_states"]
        + m["optimizer_other"]
        + m["frozen"]
        + m["comm_buffers_peak"]
        + m["gathered_peak"]
    )


def _totals_in_rank(models: dict[str, dict | None]) -> dict:
    out = {}
    for name, shape in models.items():
        for precision in PRECISIONS:
            for stage in range(4):
                torch.manual_seed(0)
                model = GPT(GPTConfig(**shape)) if shape else Wide()
                vocab, seq = (shape["vocab_size"], shape["seq_len"]) if shape else (512, 8)
                engine = zeroservice.initialize(
                    model,
                    ZeroConfig(stage=stage, precision=precision),
                    optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                )
                batches = token_batches(vocab, seq, seed=1)
                for step in range(2):
                    for x, y in batches(step, 1):
                        engine.backward(engine(x, y))
                    engine.step()
                m = engine.memory_ledger().as_dict()
                out[(name, precision, stage)] = {
                    "bytes": _peak_bytes(m),
                    "overflows": engine.reducer.pool.overflows,
                    "largest_unit": max(u.padded_numel for u in engine.units),
                    "slack": stage_slack(engine.psi, engine.dp_world),
                }
                engine.close()
    return out


@functools.cache
def _totals() -> dict:
    models: dict[str, dict | None] = {**GPTS, "wide": None}
    per_rank = run_local(_totals_in_rank, 2, models)
    return {
        k: {**per_rank[0][k], "bytes": max(r[k]["bytes"] for r in per_rank)} for k in per_rank[0]
    }


@pytest.mark.parametrize("model", [*GPTS, "wide"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_no_stage_holds_more_than_the_stage_below(model, precision):
    runs = [_totals()[(model, precision, stage)] for stage in range(4)]
    held = [r["bytes"] for r in runs]
    assert held[1] <= held[0], held
    assert held[2] <= held[1], held
    assert runs[2]["overflows"] == 0  # stage 2 never fell back on temporary buffers
    if runs[3]["largest_unit"] <= runs[3]["slack"]:
        assert held[3] <= held[2], held
    else:
        # One parameter larger than what partitioning saves is gathered whole: the
        # documented exception (see [Note: stage order]). Only the wide model has one.
        assert model == "wide", runs[3]
