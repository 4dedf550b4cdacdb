"""The environment a rank process runs with, and how it gets there.

[Note: rank settings in process]
A rank's host allocator is set by variables that count only before the memory they
govern is allocated: torch reads ``THP_MEM_ALLOC_ENABLE`` once, at its first host
allocation, and glibc reads ``MALLOC_MMAP_THRESHOLD_`` at the process's start. Carried
as a Ray runtime environment, they make Ray start a new worker process for each rank
instead of handing it one of the idle workers it keeps started; on a node that has just
joined, such a rank was up 4.3 s after ``add_node`` (median of 11; 4.0-5.2 s), and the
rank actor as it is now 4.0 s (3.6-4.4 s; ``python -m benchmarks.newcomer_start``). So
the rank actor (``workers.rank_actor.RankActor``) has no runtime environment: it
imports nothing heavy, sets these variables in its own process in its constructor
(``apply_in_process``), the mapping threshold through glibc's ``mallopt`` (what the
variable does at start-up), and only then imports torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
from collections.abc import Mapping

MAPPED_THRESHOLD = "131072"
"""``MALLOC_MMAP_THRESHOLD_`` for ranks whose job asks for ``host_allocator: mapped``:
the setting the planner's host-memory predictions hold for (docs/planner.md)."""

HUGE_PAGES = "1"
"""``THP_MEM_ALLOC_ENABLE`` for ranks whose job does not ask to ``inherit``: torch asks
the kernel for transparent huge pages (``madvise``) for each host block of 2 MiB or
more, so fresh memory faults once per 2 MiB instead of once per 4 KiB page. Torch
reads it once, at its first allocation: see [Note: rank settings in process]."""

ALLOCATOR = ("MALLOC_MMAP_THRESHOLD_", "THP_MEM_ALLOC_ENABLE")
"""The host allocator's variables (``ResourcesSpec.host_allocator``)."""

FORWARDED = (
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    *ALLOCATOR,
    "ZEROSERVICE_PEAK_TFLOPS",
    "RAY_USAGE_STATS_ENABLED",
)
"""Variables a rank takes from the process that creates it (the supervisor), where set."""

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter that ``MALLOC_MMAP_THRESHOLD_`` sets (malloc.h)."""


def actor_env(host_allocator: str | None = None) -> dict[str, str]:
    """Variables every rank actor gets (``FORWARDED``, from this process's environment),
    with the host allocator's settings the job's ``resources.host_allocator`` names
    (unset: ``huge``; see ``ResourcesSpec.host_allocator``)."""
    env = {k: os.environ[k] for k in FORWARDED if k in os.environ}
    if host_allocator != "inherit":
        env["THP_MEM_ALLOC_ENABLE"] = HUGE_PAGES
    if host_allocator == "mapped":
        env["MALLOC_MMAP_THRESHOLD_"] = MAPPED_THRESHOLD
    return env


def allocator_settings() -> dict[str, str]:
    """The host allocator's variables this process runs with (a rank reports them)."""
    return {k: os.environ[k] for k in ALLOCATOR if k in os.environ}


def apply_in_process(env: Mapping[str, str]) -> None:
    """Set ``env`` in this process as if it had started with it. Call before torch is
    imported; raises ``RuntimeError`` if torch was imported already under another
    ``THP_MEM_ALLOC_ENABLE`` (it could not take effect), and ``ValueError`` if glibc
    does not take the mapping threshold."""
    huge = env.get("THP_MEM_ALLOC_ENABLE")
    late = "torch" in sys.modules and os.environ.get("THP_MEM_ALLOC_ENABLE") != huge
    if huge is not None and late:
        raise RuntimeError(
            f"THP_MEM_ALLOC_ENABLE={huge} cannot take effect: torch was imported in this "
            "worker process before the rank started (is torch among Ray's preloaded "
            "modules?); give the job resources.host_allocator: inherit, or set the "
            "variable in the Ray node's environment"
        )
    threshold = env.get("MALLOC_MMAP_THRESHOLD_")
    if threshold is not None:
        set_mmap_threshold(threshold)
    os.environ.update(env)


def set_mmap_threshold(value: str) -> None:
    """What ``MALLOC_MMAP_THRESHOLD_=value`` does at a process's start: blocks above
    ``value`` bytes are mapped on their own, and the threshold stays fixed. Without
    glibc the variable means nothing either, and this does nothing once ``value`` is
    checked."""
    try:
        nbytes = int(value)
    except ValueError:
        nbytes = -1
    if not 0 <= nbytes < 2**31:
        raise ValueError(f"MALLOC_MMAP_THRESHOLD_={value!r}: not a size from 0 to 2**31 - 1 bytes")
    if platform.libc_ver()[0] != "glibc":
        return
    mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, nbytes) != 1:
        raise ValueError(f"MALLOC_MMAP_THRESHOLD_={value}: glibc's mallopt refuses it")
