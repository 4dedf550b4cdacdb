"""Ranks' scripts for tests/checkpoint/test_buffers.py: models with buffers (BatchNorm's
statistics, one table two modules share), trained, saved and loaded."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import zeroservice
from zeroservice.checkpoint import CheckpointError


class Normed(nn.Module):
    def __init__(self, track: bool = True):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4, track_running_stats=track)

    def forward(self, x):
        return self.bn(self.lin(x)).square().mean()


def _engine(model: nn.Module, **config) -> zeroservice.Engine:
    return zeroservice.initialize(
        model, {"stage": 2, **config}, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    )


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * step + dist.get_rank())
    return torch.randn(8, 4, generator=g) * (1 + dist.get_rank())  # statistics differ by rank


def _train(engine: zeroservice.Engine, steps: range) -> None:
    for step in steps:
        engine.backward(engine(_batch(step)))
        engine.step()


def _buffers(engine: zeroservice.Engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.module.named_buffers()}


def rank_buffers_resume(root: str) -> dict[str, list]:
    """Four steps straight, against two, saved, loaded by a fresh engine and two more;
    each rank's buffers after each, and each rank's after the load."""
    torch.manual_seed(0)
    straight = _engine(Normed(), broadcast_buffers=False)
    _train(straight, range(4))
    want = _buffers(straight)
    straight.close()
    torch.manual_seed(0)
    first = _engine(Normed(), broadcast_buffers=False)
    _train(first, range(2))
    saved = _buffers(first)
    first.save_checkpoint(root)
    first.close()
    torch.manual_seed(1)
    again = _engine(Normed(), broadcast_buffers=False)
    again.load_checkpoint(root)
    loaded = _buffers(again)
    _train(again, range(2, 4))
    got = _buffers(again)
    again.close()
    return {
        "loaded": [torch.equal(loaded[k], saved[k]) for k in saved],
        "resumed": [torch.equal(got[k], want[k]) for k in want],
    }


def save_normed(root: str) -> None:
    torch.manual_seed(0)
    engine = _engine(Normed())
    _train(engine, range(1))
    engine.save_checkpoint(root)
    engine.close()


def load_into(root: str, track: bool = True) -> str:
    """A load's error (a ``CheckpointMismatch`` is one), or "" where it loaded; the
    model tracks its statistics as the saved one did, or (``track=False``) none."""
    engine = _engine(Normed(track=track))
    try:
        engine.load_checkpoint(root)
        return ""
    except CheckpointError as exc:
        return str(exc)
    finally:
        engine.close()


class SharedTable(nn.Module):
    """One buffer registered by two modules, as ``state_dict()`` lists it twice."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        table = torch.arange(4.0)
        self.a.register_buffer("table", table)
        self.b.register_buffer("table", table)

    def forward(self, x):
        return (self.b(self.a(x) + self.a.table) + self.b.table).square().mean()


def save_and_load_shared(root: str) -> list[str]:
    torch.manual_seed(0)
    engine = _engine(SharedTable())
    _train(engine, range(1))
    engine.save_checkpoint(root)
    keys = sorted(engine.state_dict())
    engine.close()
    again = _engine(SharedTable())
    again.load_checkpoint(root)  # both names known: nothing refused
    again.close()
    return keys
