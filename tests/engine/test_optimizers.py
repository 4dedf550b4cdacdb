"""torch's elementwise optimizers beyond AdamW and SGD (each element's update reads only
that element's gradient and state, so a flat shard steps as the whole tensor would)
train to DDP's losses at every stage (rtol 1e-5); those that are not elementwise are
refused by name (``test_param_groups.py``)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroservice
from tests.engine.harness import run_ddp, run_engine
from zeroservice.launch import run_local

STAGES = (0, 1, 2, 3)
OPTIMIZERS = {
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=0.01),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=2),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 160), nn.Tanh(), nn.Linear(160, 1))


def _batches(step: int, accum: int) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(10 * step + dist.get_rank())
    return [(torch.randn(4, 8, generator=g),)]


def _loss(model, batch) -> torch.Tensor:
    return model(batch[0]).pow(2).mean()


def _runs(name: str) -> dict:
    factory = OPTIMIZERS[name]
    out = {"ddp": run_ddp(_model(), factory, _batches, 5, loss_fn=_loss).losses}
    for stage in STAGES:
        # The smallest bucket: the 1,280-element matrix is larger, reduced in pieces.
        engine = zeroservice.initialize(
            _model(), {"stage": stage, "bucket_elements": 1024}, factory
        )
        out[stage] = run_engine(engine, _batches, 5, loss_fn=_loss, keep_state=False).losses
        engine.close()
    return out


def _all() -> dict[str, dict]:
    return {name: _runs(name) for name in OPTIMIZERS}


@functools.cache
def _results() -> dict[str, dict]:
    return run_local(_all, 2, timeout_s=300)[0]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_an_elementwise_optimizer_trains_to_ddps_losses_at_every_stage(name):
    r = _results()[name]
    reference = torch.tensor(r["ddp"])
    assert reference[-1] != reference[0]
    for stage in STAGES:
        torch.testing.assert_close(torch.tensor(r[stage]), reference, rtol=1e-5, atol=0)
