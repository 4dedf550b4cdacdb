"""What ``param.grad`` holds between ``engine.backward`` and ``engine.step`` (docs:
configuration.md, "gradients before the step"): at stage 0 the sum over the ranks, at
stages 2-3 nothing; a change that does not depend on the gradient's scale (a pruning
mask) gives DDP's losses at stages 0 and 1 (rtol 1e-5)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroservice
from tests.engine.harness import mean_over_ranks
from zeroservice.launch import run_local


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _masks(model: nn.Module) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [(torch.rand(p.shape, generator=g) > 0.5).float() for p in model.parameters()]


def _data(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * step + dist.get_rank())
    return torch.randn(4, 8, generator=g)


def _masked_ddp(model: nn.Module, masks: list[torch.Tensor]) -> list[float]:
    ddp = DDP(copy.deepcopy(model))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    losses = []
    for step in range(4):
        opt.zero_grad()
        loss = ddp(_data(step)).pow(2).mean()
        loss.backward()
        for p, mask in zip(ddp.parameters(), masks, strict=True):
            p.grad.mul_(mask)
        opt.step()
        losses.append(mean_over_ranks(loss.item()))
    return losses


def _masked_engine(model: nn.Module, masks: list[torch.Tensor], stage: int) -> dict:
    model = copy.deepcopy(model)
    engine = zeroservice.initialize(
        model, {"stage": stage}, lambda ps: torch.optim.AdamW(ps, lr=1e-2)
    )
    losses, first_grads = [], None
    for step in range(4):
        loss = engine(_data(step)).pow(2).mean()
        engine.backward(loss)
        if first_grads is None:
            first_grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        for p, mask in zip(model.parameters(), masks, strict=True):
            if p.grad is not None:
                p.grad.mul_(mask)
        engine.step()
        losses.append(mean_over_ranks(loss.item()))
    engine.close()
    return {"losses": losses, "first_grads": first_grads}


def _all() -> dict:
    model = _model()
    masks = _masks(model)
    ddp = DDP(copy.deepcopy(model))
    ddp(_data(0)).pow(2).mean().backward()
    out = {"ddp": _masked_ddp(model, masks), "ddp_grads": [p.grad for p in ddp.parameters()]}
    for stage in (0, 1, 2):
        out[stage] = _masked_engine(model, masks, stage)
    return out


@functools.cache
def _results() -> dict:
    return run_local(_all, 2, timeout_s=120)[0]


def test_at_stage_0_a_grad_is_the_sum_over_the_ranks():
    r = _results()
    for got, mean in zip(r[0]["first_grads"], r["ddp_grads"], strict=True):
        torch.testing.assert_close(got, 2 * mean, rtol=1e-5, atol=1e-7)


def test_at_stage_2_no_grad_is_held():
    assert all(g is None for g in _results()[2]["first_grads"])


@pytest.mark.parametrize("stage", [0, 1])
def test_a_pruning_mask_on_the_grads_gives_ddps_losses(stage):
    r = _results()
    torch.testing.assert_close(
        torch.tensor(r[stage]["losses"]), torch.tensor(r["ddp"]), rtol=1e-5, atol=0
    )


def _after_a_stale_backward(stage: int) -> dict:
    """A backward run on the model before ``initialize`` (a smoke test) leaves a
    ``.grad`` on every parameter: it belongs to no step. DDP's loop drops it at its
    first zero_grad; SGD shows any of it that reaches a step."""
    model = _model()
    model(_data(99)).pow(2).mean().backward()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ddp = DDP(reference)
    expected = []
    for step in range(3):
        opt.zero_grad()
        loss = ddp(_data(step)).pow(2).mean()
        loss.backward()
        opt.step()
        expected.append(mean_over_ranks(loss.item()))
    engine = zeroservice.initialize(model, {"stage": stage}, lambda ps: torch.optim.SGD(ps, lr=0.1))
    losses = []
    for step in range(3):
        loss = engine(_data(step)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(mean_over_ranks(loss.item()))
    state = engine.state_dict()
    engine.close()
    weights = {k: v for k, v in reference.state_dict().items()}
    return {"losses": losses, "expected": expected, "state": state, "weights": weights}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_gradient_from_before_initialize_reaches_no_step(stage):
    r = run_local(_after_a_stale_backward, 2, stage, timeout_s=120)[0]
    torch.testing.assert_close(
        torch.tensor(r["losses"]), torch.tensor(r["expected"]), rtol=1e-5, atol=0
    )
    for name, value in r["weights"].items():
        torch.testing.assert_close(r["state"][name], value, rtol=1e-5, atol=1e-7)
