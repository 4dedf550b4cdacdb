"""Freed host memory handed back to the operating system while a step runs.

[Note: host heap trimming]
On a CPU, tensors live in malloc's memory. Under glibc's default settings a block
smaller than its mmap threshold (which rises, up to 32 MiB, each time a larger mapped
block is freed) comes from a heap, and a freed block stays in that heap: the process's
resident size then follows the sum of what a pass freed and what it holds, not what it
holds. A backward frees each block's activations as it goes and allocates their
gradients, in sizes that do not line up, so its heaps grow well past the live tensors
(on the 106M GPT at stage 3, world 2: 1709 MiB peak against 1402 with
``MALLOC_MMAP_THRESHOLD_=131072``, which maps every block above 128 KiB on its own).

``malloc_trim(0)`` returns every whole free page of every heap to the system (glibc
2.8 and later). The engine offers it where a pass has just freed a share of its memory
and before it allocates again: before each forward, before each backward, and after
each unit's backward (at stage 3 its weights released and its gradient staged; at
stages 0-2 when its last gradient arrived). Pages handed back are faulted in again
when reused, which costs time in proportion to them. So a point trims only when
the heaps hold at least ``MIN_FREE_BYTES`` free (``mallinfo2``'s free bytes over all
arenas): a heap that large is what the trim is for, and what it returns is worth its
faults. With ``MALLOC_MMAP_THRESHOLD_`` set the heaps hold little and nothing is
trimmed. Still, a heap of a few hundred MiB refaulted every step is a cost the user
should choose: on the 106M GPT at stage 3 (world 2, glibc's default) the peak falls
from 1740-1776 to 1456-1459 MiB for 6-9% of step time, but on the 7.4M GPT the step
takes 28% longer at stage 3 and 23% at stage 0 for 28-34 MiB (docs/benchmarks.md).
So it is on only with ``trim_host_memory: true``, and a no-op where the C library has
no ``malloc_trim`` (musl, macOS) or the engine's tensors are not on the CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import time

MIN_FREE_BYTES = 64 * 2**20
"""A point trims only when the heaps hold at least this much free."""


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33 and later): sizes in bytes, as size_t."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


class _Glibc:
    """``malloc_trim`` and, where there (glibc 2.33+), ``mallinfo2``."""

    def __init__(self, libc: ctypes.CDLL):
        self.trim = libc.malloc_trim
        self.trim.argtypes = [ctypes.c_size_t]
        self.trim.restype = ctypes.c_int
        self.info = getattr(libc, "mallinfo2", None)
        if self.info is not None:
            self.info.argtypes = []
            self.info.restype = _MallInfo2

    def free_bytes(self) -> int | None:
        """Free bytes in malloc's heaps (all arenas), or None if glibc cannot say."""
        return None if self.info is None else int(self.info().fordblks)


@functools.cache
def _glibc() -> _Glibc | None:
    """The C library's trimming functions, or None where it has no ``malloc_trim``.
    Looked up once (``find_library`` reads the loader's cache: 1.5-2.7 ms here)."""
    try:
        return _Glibc(ctypes.CDLL(ctypes.util.find_library("c")))
    except (OSError, AttributeError, TypeError):
        return None


class HostTrim:
    """At each point the engine names (``__call__``), ``malloc_trim(0)`` if the heaps
    hold at least ``min_free_bytes`` free. Counts points, trims and time."""

    def __init__(self, enabled: bool, min_free_bytes: int = MIN_FREE_BYTES):
        self._libc = _glibc() if enabled else None
        self.min_free_bytes = min_free_bytes
        self.points = 0
        """Points offered since the engine began."""
        self.calls = 0
        """Trims made (points where the heaps held enough free)."""
        self.seconds = 0.0
        """Time spent at the points (the check and the trims)."""

    @property
    def active(self) -> bool:
        return self._libc is not None

    def __call__(self) -> None:
        libc = self._libc
        if libc is None:
            return
        t0 = time.perf_counter()
        self.points += 1
        free = libc.free_bytes()
        if free is None or free >= self.min_free_bytes:
            libc.trim(0)
            self.calls += 1
        self.seconds += time.perf_counter() - t0


def return_free_heap(min_free_bytes: int = MIN_FREE_BYTES) -> int | None:
    """``malloc_trim(0)`` once, now, if the heaps hold at least ``min_free_bytes``
    free: for a caller that has just dropped a large share of its memory at once (a
    closed engine, spent host copies), where glibc's heaps would otherwise keep it. A
    small heap is left alone: what a trim hands back, the next allocations fault in
    again. Returns the heaps' free bytes before, or None where the C library cannot
    trim (or cannot say)."""
    libc = _glibc()
    if libc is None:
        return None
    free = libc.free_bytes()
    if free is None or free >= min_free_bytes:
        libc.trim(0)
    return free
