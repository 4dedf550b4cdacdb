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
    set_by_engine = [g["lr"] for g in inner.param_groups]
    torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5).step()
    try:
        train(engine, 1, first=2)
        refused = "no error"
    except RuntimeError as exc:
        refused = str(exc)
    for group, lr in zip(inner.param_groups, set_by_engine, strict=True):
        group["lr"] = lr  # put back: the refused step is taken again
    retried = engine.step().applied
    resumed = engine_for(spec)
    resumed.load_checkpoint(path)
    return {"refused": refused, "retried": retried, "resumed": train(resumed, 2, first=2)}


class ScaledSGD(torch.optim.SGD):
    """SGD on the gradient times ``scale``: a constructor argument the optimizer keeps,
    in ``defaults`` (rebuilt with it) or as an attribute only (lost by a rebuild)."""

    def __init__(self, params, lr: float = 1e-2, scale: float = 1.0, in_defaults: bool = True):
        super().__init__(params, lr=lr, momentum=0.9)
        self.scale = scale
        if in_defaults:
            self.defaults["scale"] = scale

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(self.scale)
        return super().step(closure)


def _clamp_grads(optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.clamp_(-1e-3, 1e-3)


def _halve_lr_after(optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        group["lr"] *= 0.5


def factory_setup(kind: str):
    """Optimizers whose factory sets up more than groups: each must train as under DDP."""

    def factory(ps):
        if kind == "scaled":
            return ScaledSGD(ps, scale=3.0)
        if kind == "adagrad":  # its constructor fills the state: made again, not refused
            return torch.optim.Adagrad(ps, lr=1e-2, initial_accumulator_value=0.1)
        opt = torch.optim.SGD(ps, lr=5e-2, momentum=0.9)
        opt.register_step_pre_hook(_clamp_grads)
        return opt

    return factory


def factory_parity(stages: list[int], kinds: list[str], steps: int = 4) -> list[dict]:
    """Per (stage, kind): losses of DDP and of the engine with the same factory."""
    out = []
    for kind in kinds:
        ref = harness.run_ddp(_model(), factory_setup(kind), _batches, steps)
        for stage in stages:
            config = ZeroConfig(stage=stage, bucket_elements=5_000)
            engine = zeroservice.initialize(_model(), config, optimizer=factory_setup(kind))
            losses = train(engine, steps)
            engine.close()
            out.append({"stage": stage, "kind": kind, "losses": losses, "ref": ref.losses})
    return out


def refused_setup(kind: str) -> str:
    """The message initialize gives for a factory whose set-up a rebuild would lose."""

    def factory(ps):
        ps = list(ps)
        if kind == "attribute":
            return ScaledSGD(ps, scale=3.0, in_defaults=False)
        opt = torch.optim.SGD(ps, lr=1e-2, momentum=0.9)
        if kind == "state":
            for p in ps:
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
        elif kind == "set-after":
            opt.clip = 0.5  # type: ignore[attr-defined]
        elif kind == "state-dict-hook":
            opt.register_state_dict_post_hook(lambda o, sd: sd)
        elif kind == "lr-scheduler":
            torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        return opt

    try:
        zeroservice.initialize(_model(), ZeroConfig(stage=1), optimizer=factory).close()
    except ValueError as exc:
        return str(exc)
    return "accepted"
