"""Rank scenarios for the runtime recipes (run through zeroservice.launch.run_local)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroservice
from zeroservice.config import ZeroConfig


class _Norms(nn.Module):
    """Two blocks with BatchNorm: running statistics are buffers that ranks update
    from their own batches."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU())
            for _ in range(2)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def _mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _batch(step: int, rank: int, width: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 10 + rank)
    return torch.randn(8, width, generator=g) * (1 + rank)  # ranks see different statistics


def batchnorm_vs_ddp(stages: list[int], steps: int = 5) -> list[dict]:
    """Losses and buffers of the engine (broadcast_buffers on) and of DDP, per stage
    (SGD with momentum: weights, hence statistics, stay within rounding of DDP's)."""
    return [_batchnorm_at(stage, steps) for stage in stages]


def _batchnorm_at(stage: int, steps: int) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(5)
    model = _Norms()
    ref = copy.deepcopy(model)
    ddp = DDP(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    engine = zeroservice.initialize(
        model,
        ZeroConfig(stage=stage, bucket_elements=1024),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    )
    losses, ref_losses = [], []
    for step in range(steps):
        x = _batch(step, rank)
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(_mean_over_ranks(loss.item()))
        ref_loss = ddp(x)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_losses.append(_mean_over_ranks(ref_loss.item()))
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "buffers": {k: v.clone() for k, v in model.named_buffers()},
        "ref_buffers": {k: v.clone() for k, v in ref.named_buffers()},
    }


def stage2_staging(overlaps: list[bool], steps: int = 2) -> list[dict]:
    """Stage 2 with and without overlap: staging buffers and their peak, per mode."""
    return [_stage2_staging_at(overlap, steps) for overlap in overlaps]


def _stage2_staging_at(overlap: bool, steps: int) -> dict:
    torch.manual_seed(5)
    model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(6)))  # 6 units of 1056
    engine = zeroservice.initialize(
        model,
        ZeroConfig(stage=2, bucket_elements=2048, overlap_comm=overlap),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01),
    )
    for step in range(steps):
        x = _batch(step, dist.get_rank(), 32)
        engine.backward(engine(x).square().mean())
        engine.step()
    ledger = engine.memory_ledger()
    return {
        "units": len(engine.units),
        "overflows": engine.reducer.pool.overflows,
        "comm_buffers": ledger.comm_buffers,
        "comm_buffers_peak": ledger.comm_buffers_peak,
    }


def compiled_blocks_vs_ddp(stages: list[int], steps: int = 3) -> list[dict]:
    """Each block compiled (``aot_eager``: inductor's C++ build is too slow for tests)
    before initialize; losses of the engine and of DDP over the same compiled blocks."""
    return [_compiled_at(stage, steps) for stage in stages]


def _compiled_at(stage: int, steps: int) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(5)
    model = _Norms()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        for block in m.blocks:
            block.compile(backend="aot_eager")
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    engine = zeroservice.initialize(
        model,
        ZeroConfig(stage=stage, bucket_elements=1024),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    )
    losses, ref_losses = [], []
    for step in range(steps):
        x = _batch(step, rank)
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(_mean_over_ranks(loss.item()))
        ref_loss = ddp(x)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_losses.append(_mean_over_ranks(ref_loss.item()))
    return {"losses": losses, "ref_losses": ref_losses}
