"""Training scenarios that run inside each spawned rank (see zeroservice.launch).

Each returns plain data (losses, parameter digests, ledgers) for the test process to
assert on. The reference is plain DDP + torch.optim.AdamW on a deep copy of the
same model, fed the same batches.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist

import zeroservice
from tests.engine import harness
from zeroservice.config import ScheduleConfig, ZeroConfig
from zeroservice.models import GPT, GPTConfig
from zeroservice.schedule import lr_factor
from zeroservice.state import Pass

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
    vocab_tiles: int = 1


SGD_LR = 0.05
"""The gradient-and-weight run: SGD + momentum keeps DDP's rounding noise as noise."""


def _model(spec: Spec) -> GPT:
    torch.manual_seed(1234)
    return harness.on_device(
        GPT(GPTConfig(**TINY, tie_weights=spec.tie, vocab_tiles=spec.vocab_tiles))
    )


def _adamw(spec: Spec):
    return lambda ps: torch.optim.AdamW(ps, lr=spec.lr, weight_decay=spec.weight_decay)


def _sgd(spec: Spec):
    return lambda ps: torch.optim.SGD(ps, lr=SGD_LR, momentum=0.9, weight_decay=spec.weight_decay)


def _batches(spec: Spec, step: int):
    return harness.token_batches(TINY["vocab_size"], TINY["seq_len"], 7, spec.batch)(
        step, spec.accum
    )


def _reference(spec: Spec, optimizer, capture: bool) -> harness.Run:
    """DDP + the optimizer (+ clip_grad_norm_, + LambdaLR) on fp32, autocast for bf16."""
    sched_cfg = ScheduleConfig(**spec.schedule)
    return harness.run_ddp(
        _model(spec),
        optimizer,
        lambda step, accum: _batches(spec, step),
        spec.steps,
        spec.accum,
        spec.clip,
        lambda s: lr_factor(sched_cfg, s),
        torch.bfloat16 if spec.precision == "bf16" else None,
        capture=capture,
    )


def reference_losses(spec: Spec) -> tuple[list[float], dict[str, torch.Tensor]]:
    run = _reference(spec, _adamw(spec), capture=False)
    return run.losses, run.state


def engine_for(spec: Spec, optimizer=None, group=None, model=None, init=None, **config_extra):
    """The spec's engine (on ``model``, default the spec's GPT; ``init`` as
    ``zeroservice.initialize`` takes it); ``config_extra``: further ZeroConfig fields."""
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
        **config_extra,
    )
    return zeroservice.initialize(
        model or _model(spec), config, optimizer=optimizer or _adamw(spec), group=group, init=init
    )


def _engine_run(spec: Spec, optimizer, reference: harness.Run | None = None) -> harness.Run:
    harness.restart_fault()
    engine = engine_for(spec, optimizer)
    run = harness.run_engine(
        engine, lambda step, accum: _batches(spec, step), spec.steps, spec.accum, reference
    )
    run.units = len(engine.units)
    engine.close()
    return run


def engine_losses(spec: Spec) -> dict:
    run = _engine_run(spec, _adamw(spec))
    return {"losses": run.losses, "norms": run.norms, "state": run.state, "units": run.units}


ENGINE_ONLY = (
    "stage",
    "overlap",
    "collectives",
    "reduce_dtype",
    "fuse",
    "prefetch",
    "persistence",
    "grouping",
    "bucket_elements",
)
"""Spec fields DDP's reference run does not read."""


def _reference_key(spec: Spec) -> str:
    """What DDP's run depends on: the spec less the engine's own settings."""
    return repr({f.name: getattr(spec, f.name) for f in fields(spec) if f.name not in ENGINE_ONLY})


def parity(specs: list[Spec]) -> list[dict]:
    """Per spec: the Adam run's losses, and the SGD run's per-step gradient ratios and
    final weight ratio against DDP. See [Note: what parity compares] in harness.py.
    Specs that differ only in the engine's settings (the stages of one case) share one
    pair of DDP runs."""
    harness.install_fault()
    references: dict[str, tuple[harness.Run, harness.Run]] = {}
    out = []
    for spec in specs:
        key = _reference_key(spec)
        if key not in references:
            references[key] = (
                _reference(spec, _adamw(spec), capture=False),
                _reference(spec, _sgd(spec), capture=True),
            )
        ref, sgd_ref = references[key]
        run = _engine_run(spec, _adamw(spec))
        sgd = _engine_run(spec, _sgd(spec), sgd_ref)
        out.append(
            {
                "losses": run.losses,
                "ref_losses": ref.losses,
                "norms": run.norms,
                "grad_ratio": sgd.grad_ratio,
                "weight_ratio": harness.weight_ratio(sgd.state, sgd_ref.state),
                "sgd_losses": sgd.losses,
                "state": sgd.state,
            }
        )
    return out


def mixed_precision_parity(spec: Spec, initial_scale: float = 2.0**10) -> dict:
    """bf16 or fp16 against DDP under autocast (and a GradScaler for fp16) with the
    same loss-scale policy: losses, skipped steps, and the fp32 masters' drift from
    DDP's fp32 weights after SGD + momentum."""
    fp16 = spec.precision == "fp16"
    growth = 4
    scaler = (
        torch.amp.GradScaler(
            harness.device().type, init_scale=initial_scale, growth_interval=growth
        )
        if fp16
        else None
    )
    initial = _model(spec).state_dict()
    ref = harness.run_ddp(
        _model(spec),
        _sgd(spec),
        lambda step, accum: _batches(spec, step),
        spec.steps,
        spec.accum,
        autocast=torch.float16 if fp16 else torch.bfloat16,
        scaler=scaler,
    )
    config = ZeroConfig(
        stage=spec.stage,
        precision=spec.precision,
        gradient_accumulation_steps=spec.accum,
        bucket_elements=spec.bucket_elements,
        reduce_dtype=spec.reduce_dtype,
        loss_scale={"initial_scale": initial_scale, "growth_interval": growth},
    )
    engine = zeroservice.initialize(_model(spec), config, optimizer=_sgd(spec))
    run = harness.run_engine(
        engine, lambda step, accum: _batches(spec, step), spec.steps, spec.accum
    )
    drift, moved = harness.master_drift(engine, initial, ref.state)
    engine.close()
    return _losses_and_skips(run, ref) | {"drift": drift, "moved": moved}


def _losses_and_skips(run: harness.Run, ref: harness.Run) -> dict:
    """An fp16 run beside its GradScaler reference: per-step losses and skipped steps."""
    return {
        "losses": run.losses,
        "ref_losses": ref.losses,
        "skipped": run.skipped,
        "ref_skipped": ref.skipped,
    }


def ledgers(specs: list[Spec]) -> list[dict]:
    """Memory ledger after a step, and the collectives of exactly one more step; the
    gradient bytes held before the first step, after each micro-batch's backward and
    after each step."""
    out = []
    for spec in specs:
        engine = engine_for(spec)
        held = [("start", engine.reducer.held_grad_bytes())]
        for step in range(2):
            if step == 1:
                engine.comm_ledger().reset()
                if engine.gatherer is not None:
                    engine.gatherer.reset_counters()
                t0 = time.perf_counter()
            for x, y in _batches(spec, step):
                engine.backward(engine(x, y))
                held.append(("backward", engine.reducer.held_grad_bytes()))
                engine.step()
                held.append(("step", engine.reducer.held_grad_bytes()))
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
                "held_grads": held,
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
    backward = set(g.plan.recorded(Pass.BACKWARD))
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
    """The last rank alone produces an inf gradient at ``bad_step``: every rank must skip
    it (at N_d = 1 that rank is the only one)."""
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
        if step == bad_step and dist.get_rank() == dist.get_world_size() - 1:
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


FP16_MAX = torch.finfo(torch.float16).max


def fp16_summed_range(stage: int, reduce_dtype: str, steps: int = 3) -> dict:
    """Each rank's scaled gradient fits in fp16 but the ranks' sum does not: DDP +
    GradScaler (which judges the mean) applies every step, and so must the engine.

    The loss is ``sum(w · x)``, so the weight's gradient is the batch's ``x`` summed:
    rank r's is ``(30 + 10 r) · scale``, each below 65504, their sum (70 · 1024 at
    N_d = 2) above it."""
    scale, rank, world = 2.0**10, dist.get_rank(), dist.get_world_size()
    value = 30.0 + 10.0 * rank
    x = torch.full((2, 8), value / 2, device=harness.device())
    assert value * scale < FP16_MAX < sum(30 + 10 * r for r in range(world)) * scale

    def model() -> torch.nn.Module:
        torch.manual_seed(5)
        return harness.on_device(torch.nn.Linear(8, 1, bias=False))

    def loss_fn(m, batch):
        return m(batch[0]).float().sum()

    def batches(step, accum):
        return [(x.half(),)] * accum

    sgd = lambda ps: torch.optim.SGD(ps, lr=1e-4)  # noqa: E731
    growth = 100
    ref = harness.run_ddp(
        model(),
        sgd,
        lambda step, accum: [(x,)] * accum,
        steps,
        autocast=torch.float16,
        loss_fn=loss_fn,
        scaler=torch.amp.GradScaler(
            harness.device().type, init_scale=scale, growth_interval=growth
        ),
    )
    config = ZeroConfig(
        stage=stage,
        precision="fp16",
        reduce_dtype=reduce_dtype,
        loss_scale={"initial_scale": scale, "growth_interval": growth},
    )
    engine = zeroservice.initialize(model(), config, optimizer=sgd)
    run = harness.run_engine(engine, batches, steps, loss_fn=loss_fn)
    engine.close()
    weights = {"weight": run.state["weight"].tolist(), "ref_weight": ref.state["weight"].tolist()}
    return _losses_and_skips(run, ref) | weights


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


def unused_parameters_at(
    stage: int, steps: int = 6, width: int = 16, leaves: tuple[str, ...] = ()
) -> dict:
    """Ranks disagree on which parameters get gradients; the engine must neither hang
    nor diverge, and must match DDP(find_unused_parameters=True). At ``width`` > 32 the
    weights exceed the 1024-element bucket and are reduced in pieces. ``leaves``: stage
    3's ``stage3_leaf_modules``, which stage 3 needs here."""
    rank = dist.get_rank()

    def batches(step: int, accum: int) -> list[tuple]:
        g = torch.Generator().manual_seed(step * 10 + rank)
        return [(torch.randn(4, width, generator=g), (step + rank) % 2 == 0)]

    def runs(optimizer, capture: bool) -> tuple[harness.Run, harness.Run]:
        torch.manual_seed(3)
        model = _Branchy(width)
        ref = harness.run_ddp(
            copy.deepcopy(model),
            optimizer,
            batches,
            steps,
            capture=capture,
            ddp_kwargs={"find_unused_parameters": True},
        )
        harness.restart_fault()
        config = ZeroConfig(stage=stage, bucket_elements=1024, stage3_leaf_modules=list(leaves))
        engine = zeroservice.initialize(model, config, optimizer=optimizer)
        return harness.run_engine(engine, batches, steps, reference=ref if capture else None), ref

    adam, adam_ref = runs(lambda ps: torch.optim.AdamW(ps, lr=1e-2), False)
    sgd, sgd_ref = runs(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), True)
    return harness.parity_record(adam, adam_ref, sgd, sgd_ref)
