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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any

from torch import nn

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


def guard_placeholders(root: nn.Module, units: list[FlatUnit]) -> None:
    """Hook every module that registers a partitioned parameter (by each of its names)."""
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
