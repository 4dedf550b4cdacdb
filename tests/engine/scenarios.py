"""Training scenarios that run inside each spawned rank (see zeroservice.launch).

Each returns plain data (losses, parameter digests, ledgers) for the test process to
assert on. The reference is plain DDP + torch.optim.AdamW on a deep copy of the
same model, fed the same batches.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroservice
from zeroservice.config import ScheduleConfig, ZeroConfig
from zeroservice.data import SyntheticTokens, micro_batch
from zeroservice.models import GPT, GPTConfig
from zeroservice.schedule import lr_factor

TINY = dict(vocab_size=512, seq_len=32, n_layer=2, n_head=4, dim=64)


@dataclass
class Spec:
    stage: int
    precision: str = "fp32"
    accum: int = 1
    clip: float = 0.0
    tie: bool = True
    steps: int = 10
    lr: float = 3e-3
    weight_decay: float = 0.1
    bucket_elements: int = 20_000
    schedule: dict = field(default_factory=dict)
    batch: int = 2
    overlap: bool = True
    collectives: str = "auto"
    reduce_dtype: str = "param"
    fuse: bool = True
    prefetch: int = 2**25
    persistence: int = 0
    grouping: str = "blocks"


def _model(spec: Spec) -> GPT:
    torch.manual_seed(1234)
    return GPT(GPTConfig(**TINY, tie_weights=spec.tie))


def _adamw(spec: Spec):
    return lambda ps: torch.optim.AdamW(ps, lr=spec.lr, weight_decay=spec.weight_decay)


def _batches(spec: Spec, step: int):
    data = SyntheticTokens(TINY["vocab_size"], TINY["seq_len"], seed=7)
    rank, world = dist.get_rank(), dist.get_world_size()
    return [
        micro_batch(data, step, m, spec.batch, rank, world, spec.accum) for m in range(spec.accum)
    ]


def reference_losses(spec: Spec) -> tuple[list[float], dict[str, torch.Tensor]]:
    """DDP + AdamW (+ clip_grad_norm_, + LambdaLR) on fp32, autocast for bf16."""
    model = _model(spec)
    ddp = DDP(model)
    opt = _adamw(spec)(model.parameters())
    sched_cfg = ScheduleConfig(**spec.schedule)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(sched_cfg, s))
    losses = []
    for step in range(spec.steps):
        total = 0.0
        for m, (x, y) in enumerate(_batches(spec, step)):
            ctx = ddp.no_sync() if m < spec.accum - 1 else contextlib.nullcontext()
            with ctx:
                with torch.autocast("cpu", torch.bfloat16, enabled=spec.precision == "bf16"):
                    loss = ddp(x, y)
                (loss / spec.accum).backward()
            total += loss.item() / spec.accum
        if spec.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(_mean_over_ranks(total))
    return losses, {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def engine_for(spec: Spec):
    config = ZeroConfig(
        stage=spec.stage,
        precision=spec.precision,
        gradient_accumulation_steps=spec.accum,
        gradient_clipping=spec.clip,
        bucket_elements=spec.bucket_elements,
        lr_schedule=ScheduleConfig(**spec.schedule),
        overlap_comm=spec.overlap,
        collectives=spec.collectives,
        reduce_dtype=spec.reduce_dtype,
        fuse_optimizer=spec.fuse,
        stage3_prefetch_elements=spec.prefetch,
        stage3_persistence_elements=spec.persistence,
        stage3_grouping=spec.grouping,
    )
    return zeroservice.initialize(_model(spec), config, optimizer=_adamw(spec))


def engine_losses(spec: Spec) -> dict:
    engine = engine_for(spec)
    losses, norms = [], []
    for step in range(spec.steps):
        total = 0.0
        for x, y in _batches(spec, step):
            loss = engine(x, y)
            engine.backward(loss)
            report = engine.step()
            total += loss.item() / spec.accum
        norms.append(report.grad_norm)
        losses.append(_mean_over_ranks(total))
    return {
        "losses": losses,
        "norms": norms,
        "state": {k: v.detach().float().clone() for k, v in engine.state_dict().items()},
        "units": len(engine.units),
    }


def parity(specs: list[Spec]) -> list[dict]:
    out = []
    for spec in specs:
        ref_losses, ref_state = reference_losses(spec)
        result = engine_losses(spec)
        result["ref_losses"], result["ref_state"] = ref_losses, ref_state
        out.append(result)
    return out


def ledgers(specs: list[Spec]) -> list[dict]:
    """Memory ledger after a step, and the collectives of exactly one more step."""
    out = []
    for spec in specs:
        engine = engine_for(spec)
        for step in range(2):
            if step == 1:
                engine.comm_ledger().reset()
                if engine.gatherer is not None:
                    engine.gatherer.reset_counters()
                t0 = time.perf_counter()
            for x, y in _batches(spec, step):
                engine.backward(engine(x, y))
                engine.step()
        comm = engine.comm_ledger()
        out.append(
            {
                "memory": engine.memory_ledger().as_dict(),
                "volume": comm.volume_elements(),
                "entries": comm.as_list(),
                "units": [(u.numel, u.padded_numel) for u in engine.units],
                "group_elements": _group_elements(engine),
                "gathers": _gather_counts(engine),
                "wall_seconds": time.perf_counter() - t0,
            }
        )
    return out


def _group_elements(engine) -> list[int]:
    """Stage 3: padded elements gathered together by each group's forward."""
    if engine.gatherer is None:
        return []
    return [sum(engine.units[i].padded_numel for i in idx) for idx in engine.gatherer.groups]


def _gather_counts(engine) -> dict:
    g = engine.gatherer
    if g is None:
        return {}
    backward = set(g._orders["backward"].plan)
    return {
        "on_demand": g.on_demand_gathers,
        "prefetched": g.prefetched_gathers,
        "backward_elements": sum(engine.units[i].padded_numel for i in backward),
        "not_regathered": sorted(
            name
            for u in engine.units
            if u.index not in backward
            for s in u.slots
            for name in s.names
        ),
    }


def fp16_overflow(steps: int = 6, bad_step: int = 3) -> dict:
    """Rank 1 alone produces an inf gradient at ``bad_step``: every rank must skip it."""
    spec = Spec(stage=2, precision="fp16", steps=steps)
    config = ZeroConfig(
        stage=2,
        precision="fp16",
        bucket_elements=spec.bucket_elements,
        loss_scale={"initial_scale": 2.0**10, "hysteresis": 1, "growth_interval": 1000},
    )
    engine = zeroservice.initialize(_model(spec), config, optimizer=_adamw(spec))
    scales, applied, digests = [], [], []
    for step in range(steps):
        ((x, y),) = _batches(spec, step)
        loss = engine(x, y)
        if step == bad_step and dist.get_rank() == 1:
            loss = loss * math.inf
        engine.backward(loss)
        report = engine.step()
        scales.append(report.loss_scale)
        applied.append(report.applied)
        digests.append(sum(u.flat.double().sum().item() for u in engine.units))
    return {
        "scales": scales,
        "applied": applied,
        "digests": digests,
        "final_scale": engine.loss_scale,
        "skipped": engine.scaler.skipped_steps,
        "applied_steps": engine.applied_steps,
    }


class _Branchy(torch.nn.Module):
    """A parameter that only some ranks use on some steps (data-dependent control flow)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.trunk = torch.nn.Linear(width, width)
        self.rare = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, use_rare: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if use_rare:
            h = torch.tanh(self.rare(h))
        return self.head(h).pow(2).mean()


def unused_parameters(stages: list[int]) -> list[dict]:
    return [unused_parameters_at(stage) for stage in stages]


def unused_parameters_at(stage: int, steps: int = 6, width: int = 16) -> dict:
    """Ranks disagree on which parameters get gradients; the engine must neither hang
    nor diverge, and must match DDP(find_unused_parameters=True). At ``width`` > 32 the
    weights exceed the 1024-element bucket and are reduced in pieces."""
    rank = dist.get_rank()
    torch.manual_seed(3)
    model = _Branchy(width)
    ref = copy.deepcopy(model)
    ddp = DDP(ref, find_unused_parameters=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    engine = zeroservice.initialize(
        model,
        ZeroConfig(stage=stage, bucket_elements=1024),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    )
    losses, ref_losses = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randn(4, width, generator=g)
        use_rare = (step + rank) % 2 == 0
        loss = engine(x, use_rare)
        engine.backward(loss)
        engine.step()
        losses.append(_mean_over_ranks(loss.item()))
        ref_loss = ddp(x, use_rare)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_losses.append(_mean_over_ranks(ref_loss.item()))
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "ref_state": {k: v.detach().clone() for k, v in ref.state_dict().items()},
    }
