"""The optimizer over this rank's fp32 shards, global-norm clipping, and the param gather.

[Note: shard step]
The user's optimizer is built over one fp32 master tensor per unit: this rank's
shard (the whole unit at stage 0). In fp32 the master *is* the shard of the
parameter buffer (a view, no copy); in bf16/fp16 it is a separate fp32 copy.
Reduced gradients arrive as sums over the N_d ranks (in fp16: of gradients already
divided by N_d, see [Note: fp16 gradients are averaged, not summed] in reduce.py),
multiplied by the loss scale; one factor ``clip / (summed_ranks * scale)`` turns them
into the mean gradient, unscaled and clipped, in a single pass. The global norm is
summed over shards with one scalar all-reduce; a non-finite norm on any rank is then
non-finite on all ranks, so every rank skips the same overflowed step.

[Note: param groups]
The factory is called once with the model's own trainable parameters (real or
meta tensors, before any are released), so that it may build the usual groups
(e.g. no weight decay for 1-D parameters) by looking at shapes. Each parameter's
group is read off that optimizer; units never mix two groups (flat.py), and the
real optimizer is rebuilt as ``type(opt)(groups, **opt.defaults)`` (the defaults
its constructor accepts) with one group
per user group, same hyperparameters, over the masters of that group's units.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from . import comm
from .flat import FlatUnit
from .optimizer_template import keep_step_hooks, refuse_lost_setup
from .stages import StagePolicy

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class StepResult:
    grad_norm: float
    """Global norm of the mean gradient before clipping (inf/nan on overflow)."""
    skipped: bool
    """True when the step was skipped because a gradient overflowed."""


def fused_variant(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Switch a fresh Adam/AdamW to torch's fused kernel, if the caller left the choice open.

    Flat shards make the fused kernel pay off: a handful of large tensors, each
    updated in one pass over memory.
    """
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or optimizer.state:
        return optimizer
    groups = optimizer.param_groups
    if any(g.get("fused") is not None or g.get("foreach") is not None for g in groups):
        return optimizer
    if any(g.get("differentiable") or g.get("capturable") for g in groups):
        return optimizer
    for group in [*groups, optimizer.defaults]:
        group["fused"] = True
    return optimizer


NOT_ELEMENTWISE = ("Adafactor", "LBFGS", "SparseAdam")
"""torch.optim classes whose update of an element depends on others of its tensor (a
factored second moment, a line search, sparse rows): rebuilt over flat shards they
would train another model, so they are refused."""


def check_optimizer(optimizer: object) -> torch.optim.Optimizer:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "optimizer: the factory must return a torch.optim.Optimizer, "
            f"got {type(optimizer).__name__}"
        )
    cls = type(optimizer)
    if cls.__module__.startswith("torch.optim") and cls.__name__ in NOT_ELEMENTWISE:
        raise ValueError(
            f"optimizer: {cls.__name__} updates each element from others of its tensor; "
            "the engine steps flat shards of the parameters and takes elementwise "
            "optimizers only (SGD, Adam, AdamW, Adagrad, RMSprop, ...)"
        )
    return optimizer


def group_of_params(
    factory: OptimizerFactory, params: list[tuple[str, nn.Parameter]]
) -> tuple[torch.optim.Optimizer, dict[int, int]]:
    """Call the factory with the model's trainable parameters and learn each one's group.

    See [Note: param groups]. Returns the factory's optimizer (a template: only its
    groups' hyperparameters are used) and, per parameter id, its group index.
    """
    template = check_optimizer(factory([p for _, p in params]))
    names = {id(p): n for n, p in params}
    group: dict[int, int] = {}
    for i, g in enumerate(template.param_groups):
        for p in g["params"]:
            if id(p) in group:
                raise ValueError(
                    f"optimizer: parameter {names.get(id(p), '?')} is listed in param groups "
                    f"{group[id(p)]} and {i}"
                )
            if id(p) not in names:
                raise ValueError(
                    "optimizer: the factory's param groups hold a tensor that is not one of "
                    "the model's trainable parameters it was given"
                )
            group[id(p)] = i
    missing = [n for n, p in params if id(p) not in group]
    if missing:
        raise ValueError(f"optimizer: the factory's param groups leave out {missing[:3]}")
    own = [dict(g) | {"params": list(g["params"])} for g in template.param_groups]
    refuse_lost_setup(template, build_like(template, own))
    return template, group


def rebuild_over_masters(
    template: torch.optim.Optimizer, units: list[FlatUnit], masters: list[nn.Parameter]
) -> torch.optim.Optimizer:
    """The template's class and groups, each group over the masters of its units, with
    its step hooks (see [Note: what the rebuild keeps] in optimizer_template.py)."""
    groups = [
        {k: v for k, v in g.items() if k != "params"}
        | {"params": [m for u, m in zip(units, masters, strict=True) if u.opt_group == i]}
        for i, g in enumerate(template.param_groups)
    ]
    rebuilt = build_like(template, groups)
    keep_step_hooks(template, rebuilt)
    return rebuilt


def build_like(template: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """``type(template)(groups, **defaults)``, with the defaults its constructor accepts."""
    accepted = inspect.signature(type(template).__init__).parameters
    defaults = {k: v for k, v in template.defaults.items() if k in accepted}
    try:
        return type(template)(groups, **defaults)
    except TypeError as exc:
        raise ValueError(
            f"optimizer: cannot rebuild {type(template).__name__} over the engine's fp32 "
            f"shards as type(opt)(param_groups, **opt.defaults): {exc}"
        ) from exc


class ShardedOptimizer:
    """Runs the user's optimizer on this rank's shards. See [Note: shard step]."""

    def __init__(
        self,
        units: list[FlatUnit],
        policy: StagePolicy,
        mixed_precision: bool,
        factory: OptimizerFactory,
        communicator: comm.Communicator,
        summed_ranks: int,
        fuse: bool = True,
        mp_comm: comm.Communicator | None = None,
        replicated: list[list[tuple[int, int]]] | None = None,
        offload: bool = False,
        template: torch.optim.Optimizer | None = None,
    ):
        """``template``: the factory's optimizer over the model's own parameters
        (see [Note: param groups]); without it the factory is called with the masters."""
        self.units, self.policy, self.comm = units, policy, communicator
        self.mixed = mixed_precision
        self.summed_ranks = summed_ranks
        """How many ranks' gradients a reduced gradient adds up: N_d, or 1 where the
        reducer divided each by N_d first."""
        self.mp_comm = mp_comm
        self.replicated = replicated or [[] for _ in units]
        """Per unit, ranges of its gradient shard holding MP-replicated parameters."""
        self.offload = offload
        self._host_grads: list[torch.Tensor] = []
        self.masters = [nn.Parameter(self._initial_master(u)) for u in units]
        if template is None:
            template = factory(self.masters)
            check_optimizer(template)
            self.optimizer = template
        else:
            self.optimizer = rebuild_over_masters(template, units, self.masters)
        given = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        if given != {id(m) for m in self.masters}:
            raise ValueError(
                "optimizer: the factory must build the optimizer over exactly the parameters "
                "it is given"
            )
        if fuse:
            self.optimizer = fused_variant(self.optimizer)
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self._written_lrs: list[float] | None = None
        """The rates set_lr_factor last wrote (see its docstring)."""

    def _initial_master(self, unit: FlatUnit) -> torch.Tensor:
        piece = unit.param_shard
        if self.offload:
            # ZeRO-Offload: the master and (through it) the optimizer state on the host,
            # with a host gradient buffer the reduced shard is copied into.
            pin = piece.is_cuda
            master = torch.empty(piece.shape, dtype=torch.float32, pin_memory=pin)
            master.copy_(piece.detach())
            self._host_grads.append(torch.empty_like(master, pin_memory=pin))
            return master
        return piece.detach().float().clone() if self.mixed else piece.detach()

    def master_bytes(self) -> int:
        if not (self.mixed or self.offload):
            return 0
        return sum(m.numel() * m.element_size() for m in self.masters)

    def host_grad_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self._host_grads)

    def set_lr_factor(self, factor: float) -> None:
        """Each group's rate: its base (the factory's) times the schedule's ``factor``.

        The engine owns the rate (``lr_schedule``): a rate changed in between (a torch
        scheduler or a loop attached to the inner optimizer) would be overwritten here
        without a word, so it is refused by name instead."""
        groups = self.optimizer.param_groups
        if self._written_lrs is not None:
            for i, (group, written) in enumerate(zip(groups, self._written_lrs, strict=True)):
                if float(group["lr"]) != written:
                    raise RuntimeError(
                        f"optimizer: param group {i}'s lr was changed outside the engine "
                        f"(to {float(group['lr'])!r}; the engine set {written!r}). The "
                        "engine sets the rate each step from the factory's lr and "
                        "lr_schedule: configure the schedule there, not with a torch "
                        "scheduler on the inner optimizer"
                    )
        for group, base in zip(groups, self.base_lrs, strict=True):
            group["lr"] = base * factor
        self.adopt_lrs()

    def adopt_lrs(self) -> None:
        """The groups' rates as they are now count as the engine's (set, or loaded)."""
        self._written_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]

    def global_grad_norm(self, grads: list[torch.Tensor], loss_scale: float) -> float:
        """Norm of the mean, unscaled gradient over all shards (one scalar all-reduce)."""
        sq = torch.zeros((), dtype=torch.float32, device=grads[0].device)
        for g, ranges in zip(grads, self.replicated, strict=True):
            sq += torch.linalg.vector_norm(g, dtype=torch.float32).square()
            if self.mp_comm is not None and ranges:
                # MP-replicated parameters are counted once in all, not once per MP rank.
                rep = sum(
                    torch.linalg.vector_norm(g[a:b], dtype=torch.float32).square()
                    for a, b in ranges
                )
                sq -= rep * (1 - 1 / self.mp_comm.world)
        if self.policy.shard_world > 1:
            self.comm.all_reduce(sq, "norm").wait()
        if self.mp_comm is not None:
            self.mp_comm.all_reduce(sq, "norm").wait()
        return math.sqrt(sq.item()) / (self.summed_ranks * loss_scale)

    def step(self, grads: list[torch.Tensor], loss_scale: float, max_norm: float) -> StepResult:
        norm = self.global_grad_norm(grads, loss_scale)
        if not math.isfinite(norm):
            return StepResult(norm, skipped=True)
        clip = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0
        factor = clip / (self.summed_ranks * loss_scale)
        for i, (master, g) in enumerate(zip(self.masters, grads, strict=True)):
            if self.offload:
                host = self._host_grads[i]
                host.copy_(g)
                master.grad = host.mul_(factor) if factor != 1.0 else host
            elif self.mixed:
                master.grad = g.float().mul_(factor)
            else:
                master.grad = g.mul_(factor) if factor != 1.0 else g
        self.optimizer.step()
        for master in self.masters:
            master.grad = None
        return StepResult(norm, skipped=False)

    def publish_params(self, tag: str = "params") -> list[comm.Pending]:
        """Write the updated masters into the parameter buffers and start the all-gathers."""
        pending = []
        for unit, master in zip(self.units, self.masters, strict=True):
            piece = unit.param_shard
            if self.mixed or self.offload:
                piece.copy_(master.detach(), non_blocking=self.offload)
            if self.policy.gathers_params and not unit.partitioned:
                pending.append(self.comm.all_gather(unit.flat, tag))
        return pending
