"""With ``trim_host_memory``, freed heap pages go back to the system at the points
[Note: host heap trimming] names, and only there: counted exactly per step, stage by
stage; off (the default), never."""

from __future__ import annotations

import ctypes
import functools

import pytest
import torch

import zeroservice
from zeroservice import host_memory
from zeroservice.config import ZeroConfig
from zeroservice.data import SyntheticTokens, micro_batch
from zeroservice.host_memory import MIN_FREE_BYTES, HostTrim, return_free_heap
from zeroservice.launch import run_local
from zeroservice.models import GPT, GPTConfig

WORLD = 2
CFG = GPTConfig(vocab_size=256, seq_len=16, n_layer=3, n_head=2, dim=32, tie_weights=False)
STEPS = 2


def test_trim_calls_glibc_and_counts():
    trim = HostTrim(True, min_free_bytes=0)
    assert trim.active  # glibc: the machines this runs on have malloc_trim
    trim()
    trim()
    assert trim.points == trim.calls == 2 and trim.seconds >= 0


def test_trim_waits_for_enough_free_heap():
    trim = HostTrim(True, min_free_bytes=2**62)
    trim()
    assert trim.points == 1 and trim.calls == 0


class _Libc:
    """Stands in for glibc: a heap with ``free`` bytes free; counts trims."""

    def __init__(self, free: int | None):
        self.free, self.trims = free, 0

    def free_bytes(self) -> int | None:
        return self.free

    def trim(self, pad: int) -> int:
        self.trims += 1
        return 1


@pytest.mark.parametrize("free,trims", [(MIN_FREE_BYTES, 1), (MIN_FREE_BYTES - 1, 0), (None, 1)])
def test_return_free_heap_trims_a_large_heap_only(monkeypatch, free, trims):
    """Once, now, when the heaps hold MIN_FREE_BYTES free (or glibc cannot say)."""
    libc = _Libc(free)
    monkeypatch.setattr(host_memory, "_glibc", lambda: libc)
    assert return_free_heap() == free and libc.trims == trims
    monkeypatch.setattr(host_memory, "_glibc", lambda: None)
    assert return_free_heap() is None


def test_return_free_heap_on_this_glibc():
    assert isinstance(return_free_heap(min_free_bytes=0), int)


def test_trim_switched_off_does_nothing():
    trim = HostTrim(False)
    assert not trim.active
    trim()
    assert trim.calls == 0


def test_trim_returns_freed_heap_pages():
    # Blocks below glibc's mmap threshold come from the heap; freed, they stay resident
    # until trimmed. Many small blocks, every other one freed, leave no free top to
    # shrink: only malloc_trim's page-wise release brings the resident size down.
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, count = 64 * 1024, 1024  # 64 MiB in 64 KiB blocks

    def resident_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

    blocks = [libc.malloc(size) for _ in range(count)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in blocks[::2]:
        libc.free(b)
    before = resident_kib()
    HostTrim(True, min_free_bytes=0)()
    after = resident_kib()
    for b in blocks[1::2]:
        libc.free(b)
    # Half the blocks (32 MiB) were free; most of their pages go back.
    assert before - after > 16 * 1024, (before, after)


def _calls_in_rank(cases: list[tuple[int, bool]]) -> list[dict]:
    out = []
    for stage, enabled in cases:
        torch.manual_seed(0)
        model = GPT(CFG)
        engine = zeroservice.initialize(
            model,
            ZeroConfig(stage=stage, trim_host_memory=enabled, bucket_elements=4096),
            optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        )
        engine.host_trim.min_free_bytes = 0  # trim at every point, whatever the heap holds
        data = SyntheticTokens(CFG.vocab_size, CFG.seq_len, seed=1)
        rank = torch.distributed.get_rank()
        for step in range(STEPS):
            x, y = micro_batch(data, step, 0, 2, rank, WORLD, 1)
            engine.backward(engine(x, y))
            engine.step()
        with torch.no_grad():
            engine(x, y)  # an evaluation forward frees nothing of a step's: no trim
        units_with_grads = len(engine.trainable_units)
        trim = engine.host_trim
        out.append({"points": trim.points, "calls": trim.calls, "units": units_with_grads})
        engine.close()
    return out


CASES = [(0, True), (2, True), (3, True), (3, False), (1, False)]


@functools.cache
def _calls() -> list[dict]:
    return run_local(_calls_in_rank, WORLD, CASES, start="spawn")[0]


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"s{s}-{e}" for s, e in CASES])
def test_trims_per_step(index):
    stage, enabled = CASES[index]
    r = _calls()[index]
    if not enabled:
        assert r["points"] == r["calls"] == 0
        return
    # Before each forward and each backward, and after each unit's backward (every
    # unit of this model has gradients).
    assert r["points"] == (2 + r["units"]) * STEPS
    assert r["calls"] == r["points"]
