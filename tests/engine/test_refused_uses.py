"""Uses of the engine that would train otherwise than DDP, or fail deep inside, are
refused by name: training calls after ``engine.close()`` (stage 0 trained on without
its reductions, stages 1-3 failed inside a collective or a matrix product); a model a
stage-3 engine partitioned, given to ``initialize`` again (its parameters are empty
placeholders for good); a buffer that views a parameter (it would keep the weights of
``initialize``); a loss of more than one element (at stage 3, an empty one: a
parameter read outside the forward)."""

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


class _Transposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.register_buffer("a_t", self.a.weight.detach().t())  # a view of the weight

    def forward(self, x):
        return x @ self.a_t


def _refusals(stage: int) -> dict:
    out = {}
    try:
        zeroservice.initialize(_Transposed(), {"stage": stage}, _sgd)
        out["view"] = "accepted"
    except ConfigError as exc:
        out["view"] = str(exc)
    model = nn.Sequential(nn.Linear(4, 1))
    model.register_parameter("scale", nn.Parameter(torch.ones(())))
    engine = zeroservice.initialize(model, {"stage": stage}, _sgd)
    x = torch.randn(3, 4)
    loss = engine(x).pow(2).mean() * model.scale.exp()  # a temperature outside the forward
    try:
        engine.backward(loss if stage == 3 else loss.expand(2))
        out["loss"] = "accepted"
    except RuntimeError as exc:
        out["loss"] = str(exc)
    engine.close()
    return out


@pytest.mark.parametrize("stage", [0, 3])
def test_a_buffer_viewing_a_parameter_and_a_loss_of_many_elements_are_refused(stage):
    r = run_local(_refusals, 2, stage, timeout_s=120)[0]
    assert r["view"].startswith("model: buffers a_t (a view of a.weight) share a parameter's")
    if stage == 3:  # the placeholder made the loss empty
        assert r["loss"].startswith("backward: the loss has 0 elements"), r
        assert "a parameter read outside the model's forward" in r["loss"]
    else:
        assert r["loss"].startswith("backward: the loss has 2 elements"), r
