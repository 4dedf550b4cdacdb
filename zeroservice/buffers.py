"""Buffers the engine allocates once and reuses: the gradient staging pool (the paper's
constant buffers C_B), stage 3's cache of whole-unit buffers, the activation
checkpoints' arena and contiguous slices for long-lived tensors (both M_D). See [Note:
constant buffers] in reduce.py."""

from __future__ import annotations

from typing import Protocol

import torch


class BufferPool:
    """Reusable staging buffers of constant size (the paper's C_B).

    Buffers are allocated at first use, up to ``count``. When every buffer is taken and
    nothing is in flight to free one, a temporary one is allocated and counted in
    ``overflows`` rather than blocking. ``trim`` lets idle buffers go (stage 3 holds
    them only while an oversized unit is reduced: see [Note: constant buffers] in
    reduce.py).
    """

    def __init__(self, count: int, numel: int, dtype, device):
        self._shape = (numel, dtype, device)
        self._count = count if numel else 0
        self._made = 0
        self._free: list[torch.Tensor] = []
        self.buffer_bytes = numel * dtype.itemsize if self._count else 0
        """Bytes of one buffer (0 when the pool holds none)."""
        self.resident_bytes = self._count * self.buffer_bytes
        """Bytes of the pool's buffers when all are allocated."""
        self.overflows = 0
        self.temporary_bytes = 0
        """Bytes of temporary buffers alive now."""
        self.temporary_peak = 0
        """The most temporary bytes alive at once: the ledger adds it to the pool's."""

    def try_acquire(self) -> torch.Tensor | None:
        if self._free:
            return self._free.pop()
        if self._made < self._count:
            numel, dtype, device = self._shape
            self._made += 1
            return torch.empty(numel, dtype=dtype, device=device)
        return None

    def acquire_temporary(self) -> torch.Tensor:
        numel, dtype, device = self._shape
        self.overflows += 1
        buffer = torch.empty(numel, dtype=dtype, device=device)
        self.temporary_bytes += buffer.numel() * buffer.element_size()
        self.temporary_peak = max(self.temporary_peak, self.temporary_bytes)
        return buffer

    def release(self, buffer: torch.Tensor, temporary: bool) -> None:
        if temporary:
            self.temporary_bytes -= buffer.numel() * buffer.element_size()
        else:
            self._free.append(buffer)

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the pool's buffers allocated now (lent or idle)."""
        return self._made * self.buffer_bytes

    @property
    def idle(self) -> bool:
        """No buffer of the pool is lent."""
        return len(self._free) == self._made

    def trim(self) -> None:
        """Let the idle buffers go; later acquires allocate again."""
        self._made -= len(self._free)
        self._free.clear()


class BufferSource(Protocol):
    """Somewhere to borrow a unit-sized staging buffer from (stage 3: the gather cache)."""

    def take(self, numel: int) -> torch.Tensor: ...

    def give(self, buffer: torch.Tensor) -> None: ...


def _sole_owner(buffer: torch.Tensor) -> bool:
    """No view of ``buffer`` is alive anywhere (so its memory may be reused)."""
    try:
        # The tensor itself and the temporary storage object: 2 references.
        return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) <= 2
    except (AttributeError, RuntimeError):
        return False


class BufferCache:
    """Whole-unit buffers kept after release and reused by the next gather of that size.

    Gathering allocates and frees the same few sizes over and over; through malloc,
    glibc keeps such freed blocks in its heap, so the process grows well past what it
    uses (ZeRO-R's fragmentation, on the host). Reusing the buffers keeps the resident
    size at the gathered peak. Gradient staging at stage 3 borrows from the same cache
    (the sizes are the units' sizes again), except for a unit larger than C_B, which
    the reducer reduces in pieces through its own constant buffers. A buffer still
    referenced by a view (a user kept a weight) is never reused, only dropped. Idle
    plus lent buffers stay within the most ever lent at once (capped by ``limit``):
    the cache never raises the high-water mark, it only keeps what the last peak will
    need again.

    A buffer of more than ``largest_kept`` elements (an oversized unit's: a parameter
    larger than C_B, such as an untied output head) is never kept idle. Its release
    comes just before the moments a step peaks (the loss after the head's forward; the
    head's gradient reduced in pieces after its backward), where an idle copy of the
    whole parameter would sit beside them; malloc maps a block that large on its own,
    so dropping it returns the memory and leaves no hole in the heap.
    """

    def __init__(
        self,
        dtype: torch.dtype,
        device: torch.device,
        limit: int,
        largest_kept: int | None = None,
    ):
        self.dtype, self.device, self.limit = dtype, device, limit
        self.largest_kept = limit if largest_kept is None else largest_kept
        self._free: dict[int, list[torch.Tensor]] = {}
        self.idle_elements = 0
        self.lent_elements = 0
        self.peak_lent_elements = 0

    def take(self, numel: int) -> torch.Tensor:
        self.lent_elements += numel
        self.peak_lent_elements = max(self.peak_lent_elements, self.lent_elements)
        free = self._free.get(numel)
        if free:
            self.idle_elements -= numel
            return free.pop()
        return torch.empty(numel, dtype=self.dtype, device=self.device)

    def give(self, buffer: torch.Tensor) -> None:
        numel = buffer.numel()
        self.lent_elements -= numel
        cap = min(self.limit, self.peak_lent_elements)
        room = cap - self.lent_elements - self.idle_elements
        if numel <= min(room, self.largest_kept) and _sole_owner(buffer):
            self._free.setdefault(numel, []).append(buffer)
            self.idle_elements += numel

    @property
    def largest_idle(self) -> int:
        """Elements of the largest idle buffer."""
        return max((n for n, free in self._free.items() if free), default=0)

    def clear(self) -> None:
        """Drop the idle buffers (at the end of a pass: reuse is within a pass)."""
        self._free.clear()
        self.idle_elements = 0


class Arena:
    """One buffer handed out in consecutive pieces, from its start again after
    ``rewind`` (M_D: a forward's activation checkpoints never interleave with other
    allocations). Sized at the first pass for ``blocks`` pieces like the first; a pass
    that needed more makes the next rewind allocate that much. A piece that does not fit
    is a tensor of its own, counted in ``overflows``."""

    def __init__(self, blocks: int):
        self.blocks = blocks
        self._buffer: torch.Tensor | None = None
        self._want = 0
        """Elements the arena should hold (grows when a pass needed more)."""
        self._used = 0
        self._pass_need = 0
        self.overflows = 0
        self.allocations = 0
        self._rewound = True

    def rewind(self) -> None:
        """Nothing taken is held any more: the next pass starts at the beginning."""
        self._used = 0
        self._want = max(self._want, self._pass_need)
        self._pass_need = 0
        self._rewound = True

    def take(self, numel: int, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
        if self._rewound:
            self._rewound = False
            buffer = self._buffer
            stale = buffer is not None and (
                buffer.numel() < self._want or buffer.dtype != dtype or buffer.device != device
            )
            if buffer is None or stale:
                want = max(self._want, numel * self.blocks)
                self._buffer = torch.empty(want, dtype=dtype, device=device, pin_memory=pin)
                self._want = want
                self.allocations += 1
        self._pass_need += numel
        buffer = self._buffer
        assert buffer is not None
        if buffer.dtype != dtype or self._used + numel > buffer.numel():
            self.overflows += 1
            return torch.empty(numel, dtype=dtype, device=device, pin_memory=pin)
        piece = buffer[self._used : self._used + numel]
        self._used += numel
        return piece

    def forget(self, numel: int) -> None:
        """A piece taken in this pass moved out: the next rewind does not size for it."""
        self._pass_need -= numel

    def holds(self, piece: torch.Tensor) -> bool:
        """Whether ``piece`` is a slice of the arena's buffer (not an overflow)."""
        b = self._buffer
        return (
            b is not None and piece.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        )

    @property
    def bytes(self) -> int:
        b = self._buffer
        return 0 if b is None else b.numel() * b.element_size()


def contiguous_slices(
    sizes: list[int], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Zeroed tensors of the given sizes, all views of one contiguous allocation."""
    flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
    return list(flat.split(sizes))
