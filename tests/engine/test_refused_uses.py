"""After ``engine.close()`` the engine's training calls are refused by name (stage 0
trained on without its reductions, stages 1-3 failed deep inside a collective or a
matrix product), and a model a stage-3 engine partitioned is refused by the next
``initialize`` (its parameters are empty placeholders for good)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroservice
from zeroservice import ConfigError
from zeroservice.launch import run_local


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.1)


def _closed(stage: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    engine = zeroservice.initialize(model, {"stage": stage}, _sgd)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    loss = engine(x).pow(2).mean()  # a graph made before close
    engine.close()
    engine.close()  # a second close is nothing
    out = {}
    for name, call in (
        ("forward", lambda: engine(x)),
        ("backward", lambda: engine.backward(loss)),
        ("step", engine.step),
        ("save_checkpoint", lambda: engine.save_checkpoint("/nonexistent")),
    ):
        try:
            call()
            out[name] = "accepted"
        except RuntimeError as exc:
            out[name] = str(exc)
    try:
        zeroservice.initialize(model, {"stage": stage}, _sgd)
        out["again"] = "accepted"
    except ConfigError as exc:
        out["again"] = str(exc)
    return out


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_closed_engine_refuses_training_calls_by_name(stage):
    r = run_local(_closed, 2, stage, timeout_s=120)[0]
    for name in ("forward", "backward", "step", "save_checkpoint"):
        assert r[name].startswith(f"{name}: the engine was closed"), (name, r[name])
    if stage < 3:
        assert r["again"] == "accepted"  # the module kept its weights
    else:
        assert r["again"].startswith("model: a stage-3 engine partitioned this model"), r
