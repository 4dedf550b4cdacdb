"""Stage 3: what autograd saves of a gathered weight is a reference, not the buffer.

A saved-tensor hook replaces every tensor that aliases a gathered buffer by a
``SavedRef`` (unit, offset, shape, stride); in backward the reference gathers the unit
again and returns the same view of the new buffer. So a buffer can be released after
forward whatever the module did with its weights, and backward gathers exactly what
it reads. See [Note: gather and release] in gather.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SavedRef:
    """A saved tensor that aliased a gathered buffer: where to find it again."""

    unit: int
    offset: int
    size: torch.Size
    stride: tuple[int, ...]


class GatheredBuffers(Protocol):
    dtype: torch.dtype

    def unit_of_storage(self, data_ptr: int) -> int | None: ...

    def buffer_for_backward(self, index: int, first_use: bool) -> torch.Tensor: ...


class SavedTensorRefs:
    """The pack and unpack hooks for ``torch.autograd.graph.saved_tensors_hooks``."""

    def __init__(self, buffers: GatheredBuffers):
        self.buffers = buffers
        self._touched: set[int] = set()
        """Units a backward has read through a reference (each asks to be gathered once)."""

    def begin_backward(self) -> None:
        self._touched.clear()

    def pack(self, tensor: torch.Tensor):
        """Replace an alias of a gathered buffer by a reference."""
        try:
            key = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return tensor
        index = self.buffers.unit_of_storage(key)
        if index is None or tensor.dtype != self.buffers.dtype:
            return tensor
        return SavedRef(index, int(tensor.storage_offset()), tensor.size(), tensor.stride())

    def unpack(self, saved):
        if type(saved) is not SavedRef:
            return saved
        first = saved.unit not in self._touched
        self._touched.add(saved.unit)
        buffer = self.buffers.buffer_for_backward(saved.unit, first)
        return buffer.as_strided(saved.size, saved.stride, saved.offset)
