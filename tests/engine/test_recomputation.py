"""A checkpointed block's recomputation reproduces its forward.

Buffers the forward writes change once per step (see [Note: buffers of a recomputed
block] in recompute_buffers.py): with activation checkpointing a block's forward runs
twice; BatchNorm counted every batch twice in its running statistics and spectral norm
took a second power iteration, so the recomputed weight was not the one the loss saw.
Both models train to DDP's losses (rtol 1e-5) at every stage; BatchNorm's statistics
and its evaluation equal DDP's (SGD, which does not turn rounding noise into steps).

Under ``torch.autocast`` the recomputation runs in the dtypes the forward did (backward
runs outside the caller's autocast; a block recomputed in float32 from its bf16 input
failed): the gradients are bit-for-bit those without checkpointing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parametrizations

import zeroservice
from tests.engine.harness import ResidualBlocks, mean_over_ranks
from zeroservice.launch import run_local

STEPS = 4
STAGES = (0, 1, 2, 3)


def _normed(kind: str) -> nn.Module:
    """Blocks (the checkpointed ModuleList) holding BatchNorm or a spectral norm."""

    def block() -> nn.Module:
        if kind == "batchnorm":
            return nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh())
        return nn.Sequential(parametrizations.spectral_norm(nn.Linear(16, 16)), nn.Tanh())

    return ResidualBlocks(block)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


def _optimizer(kind: str):
    if kind == "batchnorm":
        return lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)
    return lambda ps: torch.optim.AdamW(ps, lr=1e-2)


def _run(model, kind: str, engine: zeroservice.Engine | None) -> dict:
    opt = None if engine is not None else _optimizer(kind)(model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = F.cross_entropy(model(x), y)
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
            assert opt is not None
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(mean_over_ranks(loss.item()))
    model.eval()
    with torch.no_grad():
        evaluated = model(_batch(99)[0])
    module = engine.module if engine is not None else model.module
    stats = {n: b.clone() for n, b in module.named_buffers() if n.startswith("blocks.")}
    return {"losses": losses, "eval": evaluated, "buffers": stats}


def _both() -> dict:
    out = {}
    for kind in ("batchnorm", "spectral"):
        torch.manual_seed(0)
        out[(kind, "ddp")] = _run(DDP(_normed(kind)), kind, None)
        for stage in STAGES:
            torch.manual_seed(0)
            engine = zeroservice.initialize(
                _normed(kind),
                {"stage": stage, "activation_checkpointing": True},
                _optimizer(kind),
            )
            out[(kind, stage)] = _run(engine, kind, engine)
            engine.close()
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_local(_both, 2, timeout_s=300)[0]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", ["batchnorm", "spectral"])
def test_a_recomputed_block_writes_its_buffers_once_per_step(runs, kind, stage):
    ours, ref = runs[(kind, stage)], runs[(kind, "ddp")]
    torch.testing.assert_close(
        torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0
    )
    assert ours["buffers"].keys() == ref["buffers"].keys()
    if kind == "batchnorm":
        for name, value in ref["buffers"].items():
            if name.endswith("num_batches_tracked"):
                assert int(ours["buffers"][name]) == STEPS, name
            torch.testing.assert_close(ours["buffers"][name], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours["eval"], ref["eval"], rtol=1e-5, atol=1e-6)


def _autocast(stage: int, checkpointed: bool) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    engine = zeroservice.initialize(
        _normed("spectral"),
        {"stage": stage, "activation_checkpointing": checkpointed},
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    )
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weights = {n: w.clone() for n, w in engine.state_dict().items()}
    engine.close()
    return losses, weights


def _autocast_both() -> dict:
    return {(s, c): _autocast(s, c) for s in (0, 3) for c in (False, True)}


def test_under_autocast_the_recomputation_gives_the_same_gradients():
    out = run_local(_autocast_both, 2, timeout_s=300)[0]
    for stage in (0, 3):
        (plain, plain_w), (ours, ours_w) = out[(stage, False)], out[(stage, True)]
        assert ours == plain, stage
        for name, value in plain_w.items():
            assert torch.equal(ours_w[name], value), (stage, name)
