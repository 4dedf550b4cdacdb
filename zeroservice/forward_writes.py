"""Parameters a forward changes in place, found before the backward reduces anything.

[Note: a forward that writes its weights]
Some modules change their own weights in their forward: ``nn.Embedding(max_norm=...)``
renormalises, in place, the rows its batch looks up. Under DDP each rank keeps its own
replica, so each keeps the rows its own batch changed. The engine cannot keep that:

- at stages 1 and 2 over several ranks each weight persists once, in the shard of the
  rank that owns it, and the other ranks' copies are overwritten from it after the
  step; every rank's forward changed different rows, so most of the changes are
  dropped and training silently leaves DDP's path;
- with a master apart from the parameters (bf16/fp16 precision, or an offloaded
  optimizer) the master is the weight, and a change to the parameter is overwritten by
  the next step's update.

So where either holds, the engine reads every trainable parameter's version counter
when a training forward begins and again when its backward is asked for, and refuses
a changed one by name before anything is reduced. Where the master is apart, a change
between steps is lost the same way (``model.load_state_dict()`` after ``initialize``
under bf16: the next step would write the old weights back, updated): the counters
read after each step are held against the next forward's, and a change is refused
there. At stages 1-2 in fp32 the masters are the parameters' own shards, so a change
made alike on every rank between steps (a load) is kept, and is not refused. (A
parameter's counter moves with in-place writes through the parameter; the engine's
own writes go through the flat buffers the parameters view, which have their own.)
Stage 0 in fp32 keeps a whole replica per rank whose parameters are the optimizer's,
as DDP does, and is not watched; stage 3 finds such writes itself (``ParamGatherer``:
a gathered buffer changed before its release) and refuses the model's own
``load_state_dict`` (placeholder_state.py).
"""

from __future__ import annotations

from torch import nn

from .naming import some_names


class ForwardWrites:
    """Version counters of the watched parameters, read at a forward and its backward."""

    def __init__(
        self, module: nn.Module, names: dict[int, str], reason: str, between_steps: str | None
    ):
        """``names``: the watched parameters' first names by ``id``; ``reason``: why a
        change in a forward is refused in this configuration (the message's middle);
        ``between_steps``: why a change between steps is, or None where it is kept."""
        self.reason = reason
        self.between_steps = between_steps
        self._at_step: list[int] | None = None
        self._params = [p for p in module.parameters() if id(p) in names]
        self._names = [names[id(p)] for p in self._params]
        self._owners = _owners(module)
        self._versions: list[int] | None = None

    def _now(self) -> list[int]:
        return [p._version for p in self._params]

    def step_ended(self) -> None:
        """The engine wrote the weights (built, stepped, loaded): they are its own."""
        if self.between_steps is not None:
            self._at_step = self._now()

    def forward_begins(self) -> None:
        """A training forward starts; the first one since the last backward counts (a
        step may run several forwards before its backward). Raise if a watched
        parameter changed since the last step, where that change would be lost."""
        before, self._at_step = self._at_step, None
        if before is None and self._versions is not None:
            return  # a later forward of the same step: nothing to read
        now = self._now()
        if before is not None:
            changed = _changed(before, now)
            if changed:
                names = some_names([self._names[i] for i in changed], 5)
                raise RuntimeError(
                    f"forward: {names} changed outside the engine since its last step "
                    "(model.load_state_dict() after initialize, or a write under no_grad, "
                    f"for one). {self.between_steps}. Load weights before initialize (or "
                    "with init=<state-dict file>, or engine.load_checkpoint), or change "
                    "them through the optimizer"
                )
        if self._versions is None:
            self._versions = now

    def check_before_backward(self) -> None:
        """Raise if a watched parameter changed since the forward began."""
        before, self._versions = self._versions, None
        if before is None:
            return
        changed = _changed(before, self._now())
        if changed:
            raise RuntimeError(self._message(changed))

    def _message(self, changed: list[int]) -> str:
        names = [self._names[i] for i in changed]
        shown = some_names(names, 5)
        hints = sorted({h for i in changed if (h := self._owners.get(id(self._params[i])))})
        hint = f" ({'; '.join(hints)})" if hints else ""
        return (
            f"backward: the forward changed {shown} in place{hint}. {self.reason}. Train "
            "this model at stage 0 with precision 'fp32' (each rank then keeps its own "
            "copy, as DDP does), or change weights only through the optimizer. Nothing of "
            "this micro-batch was reduced"
        )


def _changed(before: list[int], now: list[int]) -> list[int]:
    """Indices of the parameters whose version counter moved."""
    return [i for i, (a, b) in enumerate(zip(before, now, strict=True)) if a != b]


def between_steps_reason(stage: int, precision: str, offload: bool) -> str | None:
    """Why a parameter changed between steps would be lost; None where it is kept."""
    if stage < 3 and (precision != "fp32" or offload):
        return _masters_reason(precision, offload)
    return None


def _masters_reason(precision: str, offload: bool) -> str:
    where = "offloaded optimizer's" if offload else f"'{precision}' precision's fp32"
    return (
        f"The {where} masters are the weights: a change to the parameters is overwritten "
        "by the next step's update"
    )


def watch_reason(stage: int, shard_world: int, precision: str, offload: bool) -> str | None:
    """Why a parameter changed by a forward cannot be kept here; None where it can
    (see [Note: a forward that writes its weights])."""
    if stage < 3 and shard_world > 1:
        return (
            f"At stage {stage} over {shard_world} ranks each weight persists in one rank's "
            "shard and the others' copies are overwritten from it, while each rank's "
            "forward changed it by its own batch: those changes cannot all be kept"
        )
    return between_steps_reason(stage, precision, offload)


def _owners(module: nn.Module) -> dict[int, str]:
    """By parameter ``id``, for modules known to write their weights in forward: a hint."""
    hints: dict[int, str] = {}
    for m in module.modules():
        if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.max_norm is not None:
            hints[id(m.weight)] = (
                f"{type(m).__name__} with max_norm renormalises the rows it looks up in place"
            )
    return hints
