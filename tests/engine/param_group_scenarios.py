"""Rank functions for the parameter-group tests: two-group optimizers vs DDP."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import zeroservice
from tests.engine import harness
from zeroservice.config import ScheduleConfig, ZeroConfig
from zeroservice.data import SyntheticTokens, micro_batch
from zeroservice.models import GPT, GPTConfig
from zeroservice.schedule import lr_factor

TINY = dict(vocab_size=256, seq_len=16, n_layer=2, n_head=2, dim=32)
SCHEDULE = {"kind": "cosine", "warmup_steps": 2, "total_steps": 8}


@dataclass
class GroupSpec:
    stage: int
    optimizer: str = "adamw"
    steps: int = 8
    offload: bool = False
    bucket_elements: int = 5_000
    schedule: dict = field(default_factory=lambda: dict(SCHEDULE))


def two_groups(kind: str):
    """The usual split: matrices decay, vectors do not; each group with its own lr."""

    def factory(ps):
        ps = list(ps)
        decay = [p for p in ps if p.dim() >= 2]
        rest = [p for p in ps if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": 0.1, "lr": 3e-3},
            {"params": rest, "weight_decay": 0.0, "lr": 1e-2},
        ]
        if kind == "sgd":
            return torch.optim.SGD(groups, lr=1e-2, momentum=0.9)
        return torch.optim.AdamW(groups, lr=1e-3)

    return factory


def _model() -> GPT:
    torch.manual_seed(1234)
    return GPT(GPTConfig(**TINY))


def _batch(step: int):
    data = SyntheticTokens(TINY["vocab_size"], TINY["seq_len"], seed=7)
    return micro_batch(data, step, 0, 2, dist.get_rank(), dist.get_world_size(), 1)


def _batches(step: int, accum: int) -> list:
    return [_batch(step)]


def reference(spec: GroupSpec) -> tuple[list[float], dict[str, torch.Tensor]]:
    """DDP with the same two groups and each group's lr scaled by the schedule."""
    cfg = ScheduleConfig(**spec.schedule)
    run = harness.run_ddp(
        _model(),
        two_groups(spec.optimizer),
        _batches,
        spec.steps,
        lr_lambda=lambda s: lr_factor(cfg, s),
    )
    return run.losses, run.state


def engine_for(spec: GroupSpec, module: torch.nn.Module | None = None):
    config = ZeroConfig(
        stage=spec.stage,
        bucket_elements=spec.bucket_elements,
        lr_schedule=ScheduleConfig(**spec.schedule),
        offload_optimizer=spec.offload,
    )
    return zeroservice.initialize(module or _model(), config, optimizer=two_groups(spec.optimizer))


def train(engine, steps: int, first: int = 0) -> list[float]:
    return harness.run_engine(engine, _batches, steps, start=first, keep_state=False).losses


def parity(specs: list[GroupSpec]) -> list[dict]:
    out = []
    for spec in specs:
        ref_losses, ref_state = reference(spec)
        engine = engine_for(spec)
        losses = train(engine, spec.steps)
        groups = engine.optimizer.optimizer.param_groups
        out.append(
            {
                "losses": losses,
                "ref_losses": ref_losses,
                "state": {k: v.detach().clone() for k, v in engine.state_dict().items()},
                "ref_state": ref_state,
                "groups": [(g["weight_decay"], len(g["params"])) for g in groups],
                "mixed_units": sum(
                    len({s.param.dim() >= 2 for s in u.slots}) > 1 for u in engine.units
                ),
            }
        )
    return out


def _group_summary(engine) -> list[dict]:
    """Each group's hyperparameters and its per-parameter states, whole (by name)."""
    opt = engine.optimizer.optimizer
    out = []
    for group in opt.param_groups:
        states: dict[str, torch.Tensor] = {}
        for unit, master in zip(engine.units, engine.optimizer.masters, strict=True):
            if not any(master is p for p in group["params"]):
                continue
            buf = opt.state[master]["momentum_buffer"]
            whole = torch.zeros(unit.padded_numel)
            whole[unit.shard_start : unit.shard_start + unit.shard_numel] = buf
            if engine.dp_world > 1 and engine.policy.shard_world > 1:
                dist.all_reduce(whole, group=engine.group)
            for slot, view in zip(unit.slots, unit.views_of(whole), strict=True):
                states[slot.names[0]] = view.clone()
        out.append({"lr": group["lr"], "weight_decay": group["weight_decay"], "states": states})
    return out


def save_groups(spec: GroupSpec, path: str) -> list[dict]:
    engine = engine_for(spec)
    train(engine, 4)  # past warm-up: the saved lr is scaled by the schedule
    engine.save_checkpoint(path)
    return _group_summary(engine)


def load_groups(spec: GroupSpec, path: str) -> list[dict]:
    engine = engine_for(spec)
    engine.load_checkpoint(path)
    return _group_summary(engine)


def mp_two_groups(stages: list[int], mps: list[int]) -> list[list[float]]:
    """Per-step losses of the two-group AdamW at each (stage, MP degree)."""
    from tests.engine import harness
    from tests.engine.mp_scenarios import TINY_MP, MPSpec, batches
    from zeroservice.tensor_parallel import MPGroup

    out = []
    for stage, mp in zip(stages, mps, strict=True):
        spec = MPSpec(stage, mp, steps=6)
        topo = zeroservice.build_topology(mp)
        torch.manual_seed(1234)
        model = GPT(GPTConfig(**TINY_MP), MPGroup(topo.mp_group) if mp > 1 else None)
        config = ZeroConfig(stage=stage, bucket_elements=20_000)
        engine = zeroservice.initialize(model, config, two_groups("adamw"), topology=topo)
        losses = []
        for step in range(spec.steps):
            ((x, y),) = batches(spec, topo, step)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(harness.mean_over_ranks(loss.item(), topo.dp_group))
        engine.close()
        out.append(losses)
    return out


def rate_changed_outside(spec: GroupSpec, path: str) -> dict:
    """A torch scheduler on the inner optimizer is refused at the next step; a load
    (which restores the saved rates) is not such a change."""
    engine = engine_for(spec)
    train(engine, 2)
    engine.save_checkpoint(path)
    inner = engine.optimizer.optimizer
    torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5).step()
    try:
        train(engine, 1, first=2)
        refused = "no error"
    except RuntimeError as exc:
        refused = str(exc)
    resumed = engine_for(spec)
    resumed.load_checkpoint(path)
    return {"refused": refused, "resumed": train(resumed, 2, first=2)}
