"""Optimizer state that is not alike on every master resumes exactly.

Which state keys a checkpoint saves per element was read from the first master alone:
- a one-element first shard made Adam's moments look like scalars, and the resume
  wrote past them (`free(): invalid next size`);
- param groups that keep different state (SGD's momentum on the weights only, amsgrad
  on one group) lost the other groups' state without a word, or failed the save;
- a shard holding only padding (a 4-element bias in a group of its own at N_d = 3)
  read no segment, so its optimizer found a step without moments (`KeyError: 'exp_avg'`);
- scalar states that follow a group's hyperparameters (ASGD's `eta` its lr, NAdam's
  `mu_product` its betas) were saved once for every group, and each group resumed with
  the first group's.
Each now resumes to the losses of the same run uninterrupted.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zeroservice
from tests.engine.harness import mean_over_ranks
from zeroservice.launch import run_local


class _Scaled(nn.Module):
    """A one-element parameter first (a learned scale), a 4-element bias last."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.inp = nn.Linear(6, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inp(x) * self.scale))


def _groups(kind: str):
    def factory(params):
        params = list(params)
        weights = [p for p in params if p.dim() >= 2]
        others = [p for p in params if p.dim() < 2]
        if kind == "adamw":
            return torch.optim.AdamW(
                [{"params": weights}, {"params": others, "weight_decay": 0.0}], lr=1e-2
            )
        if kind == "asgd":  # eta follows each group's lr
            return torch.optim.ASGD(
                [{"params": weights}, {"params": others, "lr": 3e-3}], lr=1e-2, t0=1
            )
        if kind == "nadam":  # mu_product follows each group's betas and momentum decay
            slower = {"betas": (0.5, 0.99), "momentum_decay": 0.02}
            return torch.optim.NAdam([{"params": weights}, {"params": others, **slower}], lr=1e-2)
        if kind == "amsgrad":
            return torch.optim.Adam(
                [{"params": weights, "amsgrad": True}, {"params": others}], lr=1e-2
            )
        momentum = (0.9, 0.0) if kind == "sgd-weights" else (0.0, 0.9)
        return torch.optim.SGD(
            [
                {"params": weights, "momentum": momentum[0]},
                {"params": others, "momentum": momentum[1]},
            ],
            lr=0.05,
        )

    return factory


def _train(engine: zeroservice.Engine, steps: range) -> list[float]:
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x, y = torch.randn(6, 6, generator=g), torch.randint(0, 4, (6,), generator=g)
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(mean_over_ranks(loss.item()))
    return losses


def _engine(kind: str, stage: int) -> zeroservice.Engine:
    torch.manual_seed(0)
    return zeroservice.initialize(_Scaled(), {"stage": stage}, _groups(kind))


def _resumes(root: str, cases: list[tuple[str, int]]) -> dict:
    out = {}
    for kind, stage in cases:
        straight = _engine(kind, stage)
        expected = _train(straight, range(5))
        straight.close()
        path = os.path.join(root, f"{kind}-{stage}")
        first = _engine(kind, stage)
        _train(first, range(3))
        first.save_checkpoint(path)
        first.close()
        resumed = _engine(kind, stage)
        resumed.load_checkpoint(path)
        out[(kind, stage)] = {"expected": expected[3:], "resumed": _train(resumed, range(3, 5))}
        resumed.close()
    return out


CASES = [
    ("adamw", 1),
    ("adamw", 3),
    ("amsgrad", 2),
    ("sgd-weights", 2),
    ("sgd-others", 3),
    ("asgd", 0),
    ("asgd", 2),
    ("nadam", 3),
]


@pytest.mark.parametrize("world", [2, 3])
def test_state_of_every_group_and_shard_resumes_exactly(tmp_path, world):
    run = functools.partial(_resumes, str(tmp_path), CASES)
    out = run_local(run, world, timeout_s=300)[0]
    for case, r in out.items():
        assert r["resumed"] == r["expected"], case  # fp32, the same world: bit for bit


def _back_to_the_start(root: str, stage: int) -> dict:
    """A checkpoint saved before the first step holds no optimizer state; an engine that
    has trained since loads it and must drop its own moments, as a fresh one has none."""
    path = os.path.join(root, f"start-{stage}")
    first = _engine("adamw", stage)
    first.save_checkpoint(path)
    fresh = _train(first, range(3))
    trained = _engine("adamw", stage)
    _train(trained, range(4))
    trained.load_checkpoint(path)
    opt = trained.optimizer
    kept = sorted({k for m in opt.masters for k in opt.optimizer.state.get(m, {})})
    return {"fresh": fresh, "after_load": _train(trained, range(3)), "kept": kept}


@pytest.mark.parametrize("stage", [1, 3])
def test_a_load_leaves_no_optimizer_state_the_checkpoint_lacks(tmp_path, stage):
    out = run_local(functools.partial(_back_to_the_start, str(tmp_path), stage), 2)[0]
    assert out["kept"] == []
    assert out["after_load"] == out["fresh"]


def _restores_from_peers(kind: str, stage: int) -> dict:
    """The same through the peers' host copies (redundancy="host-copy"), which carry
    the manifest a disk save writes."""
    config = {"stage": stage, "redundancy": "host-copy"}

    def engine() -> zeroservice.Engine:
        torch.manual_seed(0)
        return zeroservice.initialize(_Scaled(), config, _groups(kind))

    straight = engine()
    expected = _train(straight, range(5))
    straight.close()
    first = engine()
    _train(first, range(3))
    copies = first.peer_snapshots()
    first.close()
    restored = engine()
    restored.restore_from_peers(copies)
    out = {"expected": expected[3:], "restored": _train(restored, range(3, 5))}
    restored.close()
    return out


@pytest.mark.parametrize("kind,stage", [("nadam", 1), ("asgd", 3)])
def test_scalars_of_every_group_are_restored_from_peers(kind, stage):
    r = run_local(functools.partial(_restores_from_peers, kind, stage), 2)[0]
    assert r["restored"] == r["expected"]
