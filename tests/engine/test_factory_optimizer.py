"""The optimizer a loop moved over from DDP keeps: the one handed to ``initialize``
lends its hyperparameters and trains nothing after (see [Note: the factory's optimizer
after initialize] in optimizer_template.py), so a scheduler on it, its ``step()``, and
a ``zero_grad`` between ``engine.backward`` and ``engine.step`` (see [Note: zero_grad
inside a step] in engine.py) are refused by name instead of training otherwise than
under DDP without a word."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroservice
from zeroservice.launch import run_local


def _data(step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))


def _attempt(call) -> str:
    try:
        call()
    except RuntimeError as exc:
        return str(exc)
    return "accepted"


def _habits(stage: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = zeroservice.initialize(model, {"stage": stage}, lambda ps: opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    out: dict = {}
    model.zero_grad()  # before a forward: what it always did
    opt.zero_grad()
    engine.backward(engine(_data(0)).pow(2).mean())
    out["module_zero_grad"] = _attempt(model.zero_grad)
    out["optimizer_zero_grad"] = _attempt(opt.zero_grad)
    out["first_step"] = engine.step().applied
    out["optimizer_step"] = _attempt(opt.step)
    sched.step()  # the rate of an optimizer that trains nothing
    engine.backward(engine(_data(1)).pow(2).mean())
    out["after_schedule"] = _attempt(engine.step)
    out["then"] = engine.step().applied  # refused once: the step is taken again
    engine.close()
    model.zero_grad()  # the engine's guard went with it
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_factorys_optimizer_trains_nothing_and_says_so(stage):
    r = run_local(_habits, 2, stage, timeout_s=120)[0]
    for call in ("module_zero_grad", "optimizer_zero_grad"):
        assert r[call].startswith("zero_grad: called between engine.backward and"), r
    assert r["first_step"] and r["then"]
    assert r["optimizer_step"].startswith("optimizer.step(): this is the optimizer given to")
    assert r["after_schedule"].startswith(
        "optimizer: param group 0's lr changed on the optimizer given to initialize"
    ), r["after_schedule"]
