"""MKL's buffer cache: the resident bytes a CPU rank's fp32 matrix products leave
behind, measured on this host for one GPT configuration.

[Note: MKL's buffer cache]
torch's fp32 matrix products on x86 run in MKL, whose "fast memory manager" keeps each
product's work buffers for the next one, sized by the largest products run so far, for
the life of the process. On a ~6M-parameter GPT that is 2-7 MiB per rank, which the
peak model's count of tensors does not see (docs/planner.md): its sizes are MKL's own
and differ by CPU (the same four products keep 13.3 MiB on an Intel Xeon and 6.5 MiB on
an AMD EPYC), so no constant would hold on both. Layers of one shape share the buffers,
so one block of the model, its embedding and its head at the rank's micro-batch make
the same products as the whole model: ``measure_mkl_cache`` runs them (forward and
backward, twice) in fresh local ranks after a tiny model's warm-up (as the planner's
oracle measures from a warmed-up start), once with MKL's cache and once with
``MKL_DISABLE_FAST_MM=1``, and returns what the cache keeps beyond the second run.
bf16 products go through oneDNN, not MKL's cache (the peak model counts their kernels
on their own), so only fp32 is measured. The result feeds ``PeakConfig.mkl_cache``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .models.gpt import GPTConfig

OFF = "MKL_DISABLE_FAST_MM"


def measure_mkl_cache(
    gpt: GPTConfig, micro_batch: int, mp: int = 1, seq_len: int | None = None
) -> int:
    """Bytes MKL's buffer cache keeps resident in one rank (the largest over the ``mp``
    ranks) that trains ``gpt`` in fp32 at ``micro_batch`` samples of ``seq_len`` tokens
    (default: the model's), on this host. Takes two runs of fresh local processes (a few
    seconds); 0 where the cache keeps nothing (MKL off, or another BLAS)."""
    from .launch import run_local

    if micro_batch < 1 or mp < 1:
        raise ValueError(f"micro_batch and mp: must be >= 1, got {micro_batch} and {mp}")
    seq = gpt.seq_len if seq_len is None else seq_len
    one_block = dataclasses.replace(gpt, n_layer=1, seq_len=seq)
    fields = dataclasses.asdict(one_block)
    kept = {}
    for off in (False, True):
        with _cache_setting(off):
            kept[off] = max(run_local(_retained, mp, fields, micro_batch, mp, timeout_s=300))
    return max(0, kept[False] - kept[True])


@contextlib.contextmanager
def _cache_setting(off: bool) -> Iterator[None]:
    """MKL reads its setting when a process first multiplies: the ranks inherit it."""
    before = os.environ.get(OFF)
    if off:
        os.environ[OFF] = "1"
    else:
        os.environ.pop(OFF, None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(OFF, None)
        else:
            os.environ[OFF] = before


def _retained(fields: dict, micro_batch: int, mp: int) -> int:
    """In each rank: resident bytes the model's products leave once all of its tensors
    are freed, above a tiny model's warm-up."""
    import torch.distributed as dist

    from .memory import process_status_kib
    from .models.gpt import GPTConfig
    from .tensor_parallel import MPGroup

    group = MPGroup(dist.group.WORLD) if mp > 1 else None
    heads = max(2, mp)  # divisible by mp, as the vocabulary (64) is for mp <= 64
    tiny = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=heads, dim=16 * heads)
    _products(tiny, 2, group)
    gc.collect()
    dist.barrier()
    before = process_status_kib("VmRSS")
    _products(GPTConfig(**fields), micro_batch, group)
    gc.collect()
    return (process_status_kib("VmRSS") - before) * 1024


def _products(cfg: GPTConfig, batch: int, group) -> None:
    """Two forwards and backwards of ``cfg`` in fp32; every tensor freed after."""
    import torch

    from .models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(cfg, group)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    for _ in range(2):
        model(idx, idx).backward()
    del model, idx
