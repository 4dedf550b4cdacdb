"""Buffers that a checkpointed block's forward writes (BatchNorm's running statistics,
spectral norm's power-iteration vectors) change once per step, as without
checkpointing.

[Note: buffers of a recomputed block]
A checkpointed block runs its forward twice: once without a graph, and again in
backward to recompute it. A forward that writes its buffers would write them twice.
BatchNorm would count every batch twice in its running statistics
(``num_batches_tracked`` two per step), so the model would evaluate differently from
the same model trained without checkpointing; spectral norm would take a second power
iteration, and the recomputed weight would not be the one the loss was computed with,
so the gradients would not be the loss's. So the values of the buffers the first
forward writes are kept from before it ran, the recomputation and its backward run
from them, and the values the first forward left are put back afterwards.

Which buffers a block writes is learned at its first forward in training mode, which
keeps every buffer and compares: a version counter does not tell, since a native
kernel (BatchNorm's) writes the running statistics without moving it. Later forwards
keep only those, plus any whose counter moved (a write that happens on some steps
only is kept from the step after it is first seen).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class _Before:
    versions: dict[str, tuple[int, int]]
    """Per buffer name: (id, version) before the forward ran."""
    values: dict[str, torch.Tensor]
    """Copies of the buffers the forward may write."""


class BufferWrites:
    """Per checkpointed block, the buffers its forward writes, learned as it runs."""

    def __init__(self) -> None:
        self._written: dict[int, set[str]] = {}

    def before(self, module: nn.Module) -> _Before:
        """Read just before the block's first forward runs."""
        named = dict(module.named_buffers())
        known = self._written.get(id(module))
        kept = named if known is None else {n: named[n] for n in known if n in named}
        return _Before(
            {n: (id(b), b._version) for n, b in named.items()},
            {n: b.detach().clone() for n, b in kept.items()},
        )

    def after(self, module: nn.Module, before: _Before) -> dict[str, torch.Tensor]:
        """The values from before the forward of the buffers it wrote."""
        named = dict(module.named_buffers())
        moved = {n for n, b in named.items() if before.versions.get(n) != (id(b), b._version)}
        known = self._written.get(id(module))
        if known is None:
            changed = {n for n, v in before.values.items() if n in named and not _same(v, named[n])}
            if module.training:
                self._written[id(module)] = moved | changed
            return {n: v for n, v in before.values.items() if n in moved | changed}
        known.update(moved)
        return {n: v for n, v in before.values.items() if n in known}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


@contextlib.contextmanager
def as_before(module: nn.Module, values: dict[str, torch.Tensor]) -> Iterator[None]:
    """The block's buffers hold ``values`` inside; what they held is back afterwards."""
    if not values:
        yield
        return
    now = {}
    with torch.no_grad():
        for name, value in values.items():
            buffer = module.get_buffer(name)
            now[name] = buffer.detach().clone()
            buffer.copy_(value)
    try:
        yield
    finally:
        with torch.no_grad():
            for name, value in now.items():
                module.get_buffer(name).copy_(value)
