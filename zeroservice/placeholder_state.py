"""Stage 3: a model's own ``state_dict()`` and ``load_state_dict()`` refused by name.

[Note: a stage-3 model's own state dict]
At stage 3 every registered parameter is an empty placeholder and the weights live in
shards across the ranks. ``model.state_dict()`` would return the placeholders, so
``torch.save(model.state_dict(), path)`` after training would write a file without a
weight in it, silently; ``model.load_state_dict(sd)`` cannot reach the shards either.
Both are refused with what to call instead: ``engine.state_dict()`` on every rank (the
whole weights, gathered unit by unit), ``engine.save_checkpoint`` and its export, and
``engine.load_checkpoint`` or ``initialize(init=<state-dict file>)``. The engine's
own ``state_dict`` reads the module's buffers through ``module.state_dict()`` inside
``reading_own_state()`` and then puts the gathered weights in place of the
placeholders. The hooks stay after ``close()``: the parameters stay placeholders.
Inside a forward, where the modules serve gathered weights, nothing is refused.

[Note: a write to a placeholder]
Between forwards, an in-place write through a stage-3 parameter (weight clipping as in
WGAN, ``p.mul_(...)`` or a re-initialisation under ``no_grad``) lands on the empty
placeholder and changes nothing, so training would go on with the weights as they
were, silently. Each placeholder's version counter is read when the engine last wrote
the weights (built, stepped, loaded, restored) and held against the counters at every
forward, ``state_dict`` and save: a changed one is refused by name, once, on the rank
that wrote (the engine then goes on with the weights it holds). A write through
``p.data`` moves no counter and is not seen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any

from torch import nn

from .config import ConfigError
from .flat import FlatUnit
from .naming import some_names

_reading = 0
"""How many engine ``state_dict`` calls are in progress (they read placeholders on
purpose, to replace them)."""


@contextlib.contextmanager
def reading_own_state() -> Iterator[None]:
    global _reading
    _reading += 1
    try:
        yield
    finally:
        _reading -= 1


_RELEASED = "_zeroservice_placeholders"
"""Set on a model whose parameters a stage-3 engine made placeholders."""


def check_not_released(root: nn.Module) -> None:
    """A model a stage-3 engine partitioned holds empty placeholders for good (also
    after that engine's ``close``): another engine built on it would train them."""
    if root.__dict__.get(_RELEASED):
        raise ConfigError(
            "model: a stage-3 engine partitioned this model, and its parameters are empty "
            "placeholders (the weights lived in that engine's shards). Build the model "
            "again and load the weights (engine.state_dict() or an exported checkpoint "
            "taken before close), or initialize(..., init=<state-dict file>)"
        )


def guard_placeholders(root: nn.Module, units: list[FlatUnit]) -> None:
    """Hook every module that registers a partitioned parameter (by each of its names)."""
    root.__dict__[_RELEASED] = True
    owned: dict[int, tuple[nn.Module, list[str]]] = {}
    for unit in units:
        for slot in unit.slots:
            if slot.numel == 0:
                continue
            for full in slot.names:
                prefix, _, leaf = full.rpartition(".")
                module = root.get_submodule(prefix) if prefix else root
                owned.setdefault(id(module), (module, []))[1].append(leaf)
    for module, leaves in owned.values():
        module.register_state_dict_post_hook(partial(_refuse_placeholders_saved, leaves))
        module.register_load_state_dict_pre_hook(partial(_refuse_load, leaves))


def _refuse_placeholders_saved(
    leaves: list[str], module: nn.Module, state: dict, prefix: str, meta: Any
) -> None:
    if _reading:
        return
    empty = [
        prefix + leaf
        for leaf in leaves
        if (value := state.get(prefix + leaf)) is not None and value.numel() == 0
    ]
    if empty:
        raise RuntimeError(
            f"state_dict: at stage 3 {some_names(empty)} are empty placeholders in the model "
            "(the weights live in shards across the ranks), so the model's own "
            "state_dict() would hold no weight. Call engine.state_dict() on every rank "
            "for the whole weights (before engine.close()), or engine.save_checkpoint() "
            "and export the checkpoint to one state dict"
        )


def _refuse_load(leaves: list[str], module: nn.Module, state: dict, prefix: str, *_: Any) -> None:
    given = [prefix + leaf for leaf in leaves if prefix + leaf in state]
    if given:
        raise RuntimeError(
            f"load_state_dict: at stage 3 {some_names(given)} live in shards across the ranks, "
            "which the model's own load_state_dict() cannot reach. Load a checkpoint with "
            "engine.load_checkpoint(path), or start from a state-dict file with "
            "zeroservice.initialize(..., init=path)"
        )


class PlaceholderWrites:
    """The placeholders' version counters as the engine last left them (see [Note: a
    write to a placeholder])."""

    def __init__(self, units: list[FlatUnit]):
        slots = [slot for unit in units for slot in unit.slots if slot.numel]
        self._params = [slot.param for slot in slots]
        self._names = [slot.names[0] for slot in slots]
        self._versions = self._now()

    def _now(self) -> list[int]:
        return [p._version for p in self._params]

    def written_by_engine(self) -> None:
        self._versions = self._now()

    def check(self, where: str) -> None:
        now = self._now()
        changed = [n for n, a, b in zip(self._names, self._versions, now, strict=True) if a != b]
        self._versions = now  # refused once: the engine goes on with the weights it holds
        if changed:
            raise RuntimeError(
                f"{where}: {some_names(changed)} were written in place since the engine's "
                "last step (a write under no_grad, weight clipping, a re-initialisation). At "
                "stage 3 the model's parameters are empty placeholders outside a forward and "
                "the weights live in shards across the ranks, so the write changed nothing. "
                "Change weights before initialize, load them (engine.load_checkpoint, or "
                "initialize(..., init=<state-dict file>)), or train this model at stage 0-2"
            )
