"""What the factory's optimizer may carry into the one the engine builds over its shards.

[Note: what the rebuild keeps]
The engine rebuilds the factory's optimizer as ``type(opt)(groups, **defaults)`` over
its fp32 masters (see [Note: param groups] in optim.py). Anything else the factory set
up would be lost without a word, and the job would train another model than the same
optimizer under DDP. So:

- step hooks (``register_step_pre_hook``/``post_hook``) are registered again on the
  rebuilt optimizer, in their order: they then see the flat fp32 shards, as the
  optimizer itself does, so element-wise hooks (clamping gradients, logging) act as on
  the whole model;
- state hooks (``state_dict``/``load_state_dict`` pre and post hooks) would rewrite
  the engine's own checkpoint format: refused;
- per-parameter state beyond what the constructor makes (momentum loaded or set in
  the factory; Adagrad's constructor fills its sums, and those are made again) is
  keyed by the model's parameters, which the engine replaces by flat shards: refused
  (resume from an engine checkpoint instead);
- an instance attribute the rebuild does not reproduce (a constructor argument kept
  outside ``defaults``, or one set after construction) is refused by name, when it is
  plain data the two can be compared by (numbers, text, tensors and containers of
  them); an attribute holding another object is not judged.

What the constructor makes is learnt by building the class once more, the same way,
over the factory's own parameters while they are whole (``fresh``, right after the
factory returns): attributes that follow from the parameters (a count of them) then
agree too.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch

STATE_HOOKS = (
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)

TORCH_INTERNALS = frozenset(
    {
        "defaults",
        "param_groups",
        "state",
        "_optimizer_step_pre_hooks",
        "_optimizer_step_post_hooks",
        *STATE_HOOKS,
        "_warned_capturable_if_run_uncaptured",
        "_zero_grad_profile_name",
    }
)
"""Attributes torch.optim.Optimizer keeps on every instance (compared elsewhere or
irrelevant to the update)."""

_MISSING = object()


def refuse_lost_setup(template: torch.optim.Optimizer, fresh: torch.optim.Optimizer) -> None:
    """Refuse, by name, what the factory set up and a rebuild would lose.

    ``fresh``: the template's class built again, as the engine rebuilds it, over the
    template's own groups, while its parameters are whole. See [Note: what the rebuild
    keeps]."""
    name = type(template).__name__
    changed = {
        id(p): state for p, state in template.state.items() if not _same(state, fresh.state.get(p))
    }
    if changed:
        kinds = sorted({k for state in changed.values() for k in state})
        raise ValueError(
            f"optimizer: the factory's {name} already holds state for "
            f"{len(changed)} parameters ({', '.join(kinds) or 'empty entries'}); "
            "the engine rebuilds the optimizer over its fp32 shards and cannot carry "
            "per-parameter state over: return a fresh optimizer, and resume from an "
            "engine checkpoint instead"
        )
    hooked = [h for h in STATE_HOOKS if getattr(template, h, None)]
    if hooked:
        raise ValueError(
            f"optimizer: the factory's {name} has {', '.join(hooked)} registered; they "
            "would rewrite the engine's own checkpoints of its fp32 shards, which the "
            "engine saves and loads itself: build the optimizer without them"
        )
    for attr in sorted(set(vars(template)) - TORCH_INTERNALS):
        mine = vars(template)[attr]
        theirs = vars(fresh).get(attr, _MISSING)
        if theirs is _MISSING:
            raise ValueError(
                f"optimizer: the factory's {name} has an attribute {attr!r} that its "
                "constructor does not set (set after it was built, or by a torch LR "
                "scheduler, which the engine's lr_schedule replaces); the engine rebuilds "
                "the optimizer as type(opt)(param_groups, **opt.defaults) and it would be "
                "lost"
            )
        if _judged(mine) and _judged(theirs) and not _same(mine, theirs):
            raise ValueError(
                f"optimizer: {name}'s attribute {attr!r} is {_show(mine)} on the factory's "
                f"optimizer but {_show(theirs)} when rebuilt as "
                "type(opt)(param_groups, **opt.defaults) over the engine's fp32 shards: "
                f"keep the constructor argument in opt.defaults (defaults[{attr!r}]), "
                "which the rebuild passes to the constructor"
            )


def keep_step_hooks(template: torch.optim.Optimizer, rebuilt: torch.optim.Optimizer) -> None:
    """The template's step pre and post hooks, in their order, on ``rebuilt``."""
    for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
        getattr(rebuilt, hooks).update(getattr(template, hooks))


def _judged(value: Any) -> bool:
    """Plain data whose equality means what it says."""
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        return True
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, tuple | list):
        return all(_judged(v) for v in value)
    if isinstance(value, dict):
        return all(_judged(k) and _judged(v) for k, v in value.items())
    return False


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_meta or b.is_meta:  # a model built on the meta device: shapes only
            return a.is_meta == b.is_meta
        return bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class RetiredTemplate:
    """The factory's optimizer once the engine has rebuilt it over its shards.

    [Note: the factory's optimizer after initialize]
    A loop moved over from DDP keeps the optimizer it built: ``opt = AdamW(...)``,
    ``initialize(..., optimizer=lambda ps: opt)``, then ``StepLR(opt, ...)`` and
    ``opt.step()`` out of habit. That object only lent its groups' hyperparameters: a
    scheduler on it changed rates nothing trains with (the losses went on at the first
    rate, while ``opt.param_groups`` showed the scheduled ones), and its ``step()``
    moved the weights by a second update at stages 0-1. So its ``step()`` now raises,
    and a hyperparameter changed on it since ``initialize`` is refused by the engine's
    next ``step()``, naming what to use instead (``lr_schedule``)."""

    def __init__(self, template: torch.optim.Optimizer):
        self.template = template
        self._hyper = _hyperparameters(template)
        # A bound method, as torch's LR schedulers expect of ``step`` to wrap it.
        template.step = types.MethodType(_retired_step, template)  # type: ignore[method-assign]

    def check(self) -> None:
        now = _hyperparameters(self.template)
        changed = sorted(
            {
                f"param group {i}'s {k}"
                for i, (was, is_) in enumerate(zip(self._hyper, now, strict=True))
                for k in was.keys() | is_.keys()
                if was.get(k) != is_.get(k)
            }
        )
        if changed:
            self._hyper = now  # refused once
            raise RuntimeError(
                f"optimizer: {', '.join(changed[:3])} changed on the optimizer given to "
                "initialize (a torch LR scheduler on it, or a change by hand). The engine "
                "trains a copy of it over its shards, built at initialize, so the change "
                "would train nothing: set the schedule with lr_schedule (or a DeepSpeed "
                "config's scheduler)"
            )

    def release(self) -> None:
        self.template.__dict__.pop("step", None)


def _hyperparameters(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each group's hyperparameters (``initial_lr``, which a scheduler adds when it is
    made, left out: the rate it then changes is the one named)."""
    return [
        {k: _plain(v) for k, v in group.items() if k not in ("params", "initial_lr")}
        for group in opt.param_groups
    ]


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    if isinstance(value, list | tuple):
        return tuple(_plain(v) for v in value)
    return value


def _retired_step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
    raise RuntimeError(
        "optimizer.step(): this is the optimizer given to initialize, which the engine "
        "rebuilt over its shards; it trains nothing. Call engine.step() (and set the "
        "learning-rate schedule with lr_schedule)"
    )
