"""Whole weights between steps: ``engine.gathered_parameters(...)``.

[Note: gathered parameters]
Between steps a stage-3 parameter is an empty placeholder, so whatever reads weights
outside a forward reads nothing: an exponential moving average of the weights
(``ema.lerp_(p, 0.01)`` failed on the shapes), a norm of each layer's weights logged,
a weight copied into another model. DeepSpeed's answer is a context,
``zero.GatheredParameters``; this is ours. Inside ``with
engine.gathered_parameters(params):`` every parameter of the units holding ``params``
(or of the whole model) holds its whole weight: the placeholder's ``.data`` is a view
of a freshly gathered copy of its unit, so the same ``nn.Parameter`` objects, with
their names, shapes and ``requires_grad``, read the weights. On exit the copies are
dropped and the placeholders are empty again. Every rank of the data-parallel group
must enter with the same parameters (the gathers are collectives); at stages 0-2 the
parameters are whole already and nothing is gathered.

Writes are kept only with ``modifier_rank``: on exit that rank's weights are
broadcast to every rank, each writes its shard of them, and, where the optimizer keeps
fp32 masters apart from the parameters (bf16/fp16, an offloaded optimizer), the
master of every element whose value changed takes the new value while the others keep
their fp32 precision. Writes of the other ranks are overwritten. Without
``modifier_rank`` the context reads: at stage 3 a write found on exit (a parameter's or
its copy's version counter moved; a write through ``p.data`` is not seen) would be
lost with the copy, so it is refused by name and the weights stay as they were; at
stages 0-2 the parameters are the engine's own buffers, and a write follows the rules
for weights changed between steps (docs/configuration.md).

A write is accepted only between steps (not between ``backward`` and ``step``, whose
gradients belong to the weights before it). A forward inside the context is refused at
stage 3: its gathers would release the copies it reads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from . import comm
from .flat import FlatUnit
from .naming import some_names
from .state import TrainingState

if TYPE_CHECKING:
    from .engine import Engine

_TAG = "gathered"


def units_holding(engine: Engine, params: object) -> list[FlatUnit]:
    """The units that hold ``params``: None (the whole model), a module of the model
    (its parameters, its sub-modules' included), one parameter, or an iterable of them."""
    if params is None:
        return list(engine.units)
    if isinstance(params, nn.Module):
        wanted: list[object] = list(params.parameters())
        if not any(m is params for m in engine.module.modules()):
            raise ValueError(
                f"gathered_parameters: the module given ({type(params).__name__}) is not "
                "part of this engine's model"
            )
    elif isinstance(params, torch.Tensor):
        wanted = [params]
    elif isinstance(params, Iterable) and not isinstance(params, (str, bytes)):
        wanted = list(params)
    else:
        raise TypeError(
            "gathered_parameters: params must be None, a module of the model, a parameter "
            f"or an iterable of parameters, not {type(params).__name__}"
        )
    where = {id(slot.param): unit for unit in engine.units for slot in unit.slots}
    units: dict[int, FlatUnit] = {}
    for k, p in enumerate(wanted):
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"gathered_parameters: params[{k}] is a {type(p).__name__}, not a parameter"
            )
        unit = where.get(id(p))
        if unit is None:
            raise ValueError(
                f"gathered_parameters: params[{k}] (shape {tuple(p.shape)}) is not a "
                "parameter of this engine's model (at stage 3 pass the model's own "
                "parameters, e.g. engine.module.head.weight, not a copy)"
            )
        units[unit.index] = unit
    return [units[i] for i in sorted(units)]


class GatheredParameters:
    """The context ``Engine.gathered_parameters`` returns. See [Note: gathered parameters]."""

    def __init__(self, engine: Engine, params: object, modifier_rank: int | None):
        engine._require_state("gathered_parameters")
        world = engine.dp_world
        if modifier_rank is not None and (
            isinstance(modifier_rank, bool)
            or not isinstance(modifier_rank, int)
            or not 0 <= modifier_rank < world
        ):
            raise ValueError(
                f"gathered_parameters: modifier_rank must be None or a data-parallel rank "
                f"in [0, {world}), not {modifier_rank!r}"
            )
        self.engine = engine
        self.units = units_holding(engine, params)
        self.modifier_rank = modifier_rank
        self._copies: dict[int, torch.Tensor] = {}
        self._placeholders: dict[int, torch.Tensor] = {}
        self._versions: list[tuple[int, list[int]]] = []
        self._open = False

    def __enter__(self) -> GatheredParameters:
        engine = self.engine
        if engine._gathered is not None:
            raise RuntimeError(
                "gathered_parameters: already inside gathered_parameters(); leave it first "
                "(one context at a time, every rank alike)"
            )
        if self.modifier_rank is not None and engine.state.value is not TrainingState.IDLE:
            raise RuntimeError(
                "gathered_parameters(modifier_rank=...): the engine is between backward and "
                "step, whose gradients belong to the weights as they are; call engine.step() "
                "first, then change the weights"
            )
        gatherer = engine.gatherer
        if gatherer is not None:
            if gatherer.in_forward():
                raise RuntimeError(
                    "gathered_parameters: called inside a forward, where the weights are "
                    "gathered already"
                )
            if engine._placeholder_writes is not None:
                engine._placeholder_writes.check("gathered_parameters")
            for unit in self.units:
                copy = gatherer.gather_copy(unit.index)
                self._copies[unit.index] = copy
                for slot, view in zip(unit.slots, unit.views_of(copy), strict=True):
                    self._placeholders[id(slot.param)] = slot.param.data
                    slot.param.data = view
            self._versions = self._now()
            gatherer.copies_out = True
        engine._gathered = self
        self._open = True
        return self

    def _now(self) -> list[tuple[int, list[int]]]:
        """Per unit: its copy's version counter and each of its parameters'."""
        return [
            (self._copies[u.index]._version, [slot.param._version for slot in u.slots])
            for u in self.units
        ]

    def _written(self) -> list[str]:
        """The parameters written since the context began: a whole unit where its copy
        was written through a view the parameters do not share a counter with."""
        changed: list[str] = []
        for unit, (copy_was, params_were), (copy_is, params_are) in zip(
            self.units, self._versions, self._now(), strict=True
        ):
            for slot, was, now in zip(unit.slots, params_were, params_are, strict=True):
                if copy_was != copy_is or was != now:
                    changed.append(slot.names[0])
        return changed

    def __exit__(self, exc_type, exc, tb) -> None:
        engine = self.engine
        self._open = False
        engine._gathered = None
        if engine.gatherer is not None:
            engine.gatherer.copies_out = False
        written: list[str] = []
        try:
            if exc_type is None:
                if self.modifier_rank is not None:
                    self._keep_writes()
                elif engine.gatherer is not None:
                    written = self._written()
        finally:
            for unit in self.units:
                for slot in unit.slots:
                    placeholder = self._placeholders.pop(id(slot.param), None)
                    if placeholder is not None:
                        slot.param.data = placeholder
            self._copies.clear()
            if engine._placeholder_writes is not None:
                engine._placeholder_writes.written_by_engine()
        if written:
            raise RuntimeError(
                f"gathered_parameters: {some_names(written)} were written inside "
                "gathered_parameters() without modifier_rank, so the write was made to "
                "copies that are now dropped; the weights are as they were. Pass "
                "modifier_rank=<the rank whose weights to keep> to keep such a change"
            )

    def _keep_writes(self) -> None:
        """The modifier's weights to every rank, into its shard and its masters."""
        engine = self.engine
        src = self.modifier_rank
        assert src is not None
        whole = {u.index: self._copies.get(u.index, u.flat) for u in self.units}
        comm.wait_all([engine.comm.broadcast(whole[u.index], _TAG, src) for u in self.units])
        masters = engine.optimizer.masters
        separate = engine.optimizer.mixed or engine.optimizer.offload
        for unit in self.units:
            new = engine.comm.chunk(whole[unit.index]) if unit.partitioned else None
            piece = unit.param_shard
            if not unit.frozen and separate:
                master = masters[unit.index]
                value = (new if new is not None else piece).to(master.device)
                changed = value != master.detach().to(value.dtype)
                master.data[changed] = value[changed].to(master.dtype)
            if new is not None:
                piece.copy_(new)
        if engine.gatherer is not None:
            comm.wait_all(engine.gatherer.refresh_persistent())
        engine._weights_written()
        if engine.host_copies is not None:  # a lost rank restores the weights as written
            engine.host_copies.refresh(engine._sharded_state())
