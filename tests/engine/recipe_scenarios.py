"""Rank scenarios for the runtime recipes (run through zeroservice.launch.run_local)."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroservice
from tests.engine import harness
from zeroservice.config import ZeroConfig


class _RunningCentre(nn.Module):
    """Subtracts a running mean that its training forward updates and reads: a buffer
    whose value enters the loss, so a rank holding another rank's buffer trains
    differently."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("centre", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.centre.mul_(0.5).add_(x.mean(0), alpha=0.5)
        return x - self.centre


class _Norms(nn.Module):
    """Two blocks with BatchNorm and a running centre: running statistics are buffers
    that ranks update from their own batches."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU())
            for _ in range(2)
        )
        self.centre = _RunningCentre(width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.centre(self.blocks[1](self.blocks[0](x)))).square().mean()


def _batch(step: int, rank: int, width: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 10 + rank)
    return torch.randn(8, width, generator=g) * (1 + rank)  # ranks see different statistics


def batchnorm_vs_ddp(cases: list[tuple[int, int]], steps: int = 4) -> dict:
    """Losses and buffers of the engine (broadcast_buffers on) and of DDP, per (stage,
    micro-batches per step), with an evaluation forward after every step (SGD with
    momentum: weights, hence statistics, stay within rounding of DDP's)."""
    return {(stage, accum): _batchnorm_at(stage, accum, steps) for stage, accum in cases}


def _evaluate(model, x: torch.Tensor, step: int) -> float:
    """A forward without a graph, in eval mode (running statistics are read): under
    ``torch.no_grad()`` on even steps and ``torch.inference_mode()`` on odd ones."""
    model.module.eval()
    with torch.no_grad() if step % 2 == 0 else torch.inference_mode():
        loss = model(x).item()
    model.module.train()
    return loss


def _batchnorm_at(stage: int, accum: int, steps: int) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(5)
    model = _Norms()
    ref = copy.deepcopy(model)
    ddp = DDP(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    engine = zeroservice.initialize(
        model,
        ZeroConfig(stage=stage, bucket_elements=1024, gradient_accumulation_steps=accum),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    )
    losses, ref_losses, evals, ref_evals = [], [], [], []
    for step in range(steps):
        total = ref_total = 0.0
        for m in range(accum):
            x = _batch(step * accum + m, rank)
            loss = engine(x)
            engine.backward(loss)  # the engine divides by the micro-batches itself
            total += loss.item() / accum
            with ddp.no_sync() if m < accum - 1 else contextlib.nullcontext():
                ref_loss = ddp(x)
                (ref_loss / accum).backward()
            ref_total += ref_loss.item() / accum
        engine.step()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        losses.append(harness.mean_over_ranks(total))
        ref_losses.append(harness.mean_over_ranks(ref_total))
        # Each rank's own statistics, before an evaluation broadcasts rank 0's.
        buffers = {k: v.clone() for k, v in model.named_buffers()}
        ref_buffers = {k: v.clone() for k, v in ref.named_buffers()}
        x = _batch(1000 + step, rank)
        evals.append(_evaluate(engine, x, step))
        ref_evals.append(_evaluate(ddp, x, step))
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "evals": evals,
        "ref_evals": ref_evals,
        "buffers": buffers,
        "ref_buffers": ref_buffers,
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


def compiled_vs_ddp(cases: list[tuple[str, int]], steps: int = 3) -> list[dict]:
    """("blocks", stage): each block compiled before initialize; ("model", stage): the
    whole model passed through ``torch.compile``. ``aot_eager``: inductor's C++ build is
    too slow for tests. Losses of the engine and of DDP over the same compiled modules."""
    return [_compiled_at(what, stage, steps) for what, stage in cases]


def _compiled_at(what: str, stage: int, steps: int) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(5)
    model: nn.Module = _Norms()
    ref: nn.Module = copy.deepcopy(model)
    if what == "blocks":
        for m in (model, ref):
            for block in m.blocks:
                block.compile(backend="aot_eager")
    else:
        model = torch.compile(model, backend="aot_eager")
        ref = torch.compile(ref, backend="aot_eager")
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
        losses.append(harness.mean_over_ranks(loss.item()))
        ref_loss = ddp(x)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_losses.append(harness.mean_over_ranks(ref_loss.item()))
    return {"losses": losses, "ref_losses": ref_losses}


class _Reversed(nn.Module):
    """Layers called in the reverse of their registration order: backward finishes the
    units in the reverse of their index order (the worst case for the launch order)."""

    def __init__(self, vocab: int = 64, width: int = 32, depth: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.emb = nn.Embedding(vocab, width)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in reversed(self.layers):
            x = x + torch.tanh(layer(x))
        logits = x @ self.emb.weight.t()
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def out_of_order_vs_ddp(overlaps: list[bool], steps: int = 4) -> list[dict]:
    """Stage 2 on ``_Reversed``: parity with DDP (Adam losses; SGD gradients and
    weights), and the staging buffers' overflows after each step."""
    return [_out_of_order_at(overlap, steps) for overlap in overlaps]


def _out_of_order_at(overlap: bool, steps: int) -> dict:
    batches = harness.token_batches(64, 16, seed=4)
    config = ZeroConfig(stage=2, bucket_elements=1024, overlap_comm=overlap)

    def runs(optimizer, capture: bool):
        torch.manual_seed(5)
        model = _Reversed()
        ref = harness.run_ddp(copy.deepcopy(model), optimizer, batches, steps, capture=capture)
        engine = zeroservice.initialize(model, config, optimizer)
        overflows = []
        run = harness.Run([], [], [], [], {}, skipped=[])
        for step in range(steps):
            part = harness.run_engine(
                engine,
                batches,
                1,
                reference=ref if capture else None,
                start=step,
                keep_state=step == steps - 1,
            )
            run.losses += part.losses
            run.grad_ratio += part.grad_ratio
            run.state = part.state
            overflows.append(engine.reducer.pool.overflows)
        return engine, run, ref, overflows

    _, adam, adam_ref, _ = runs(lambda ps: torch.optim.AdamW(ps, lr=1e-2), False)
    engine, sgd, sgd_ref, overflows = runs(
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), True
    )
    ledger = engine.memory_ledger()
    return {
        "losses": adam.losses,
        "ref_losses": adam_ref.losses,
        "grad_ratio": sgd.grad_ratio,
        "weight_ratio": harness.weight_ratio(sgd.state, sgd_ref.state),
        "overflows": overflows,
        "order": list(engine.reducer.order),
        "units": len(engine.units),
        "comm_buffers": ledger.comm_buffers,
        "comm_buffers_peak": ledger.comm_buffers_peak,
        "temporary_peak": engine.reducer.pool.temporary_peak,
        "order_calls": sum(
            e["calls"] for e in engine.comm_ledger().as_list() if e["tag"] == "order"
        ),
    }
