"""Resident bytes MKL keeps after fp32 matrix products: its buffer cache, on and off.

MKL's "fast memory manager" keeps a product's buffers for the next one. A fresh process
(``MALLOC_MMAP_THRESHOLD_=131072``, one thread) runs a tiny product, then each shape
below once, forward only, and reports how much its resident size grew and stayed; the
same again with ``MKL_DISABLE_FAST_MM=1``. The shapes are the reference GPT's products
at the planner oracle's wide shape (512 tokens, dim 384, MLP 1536, vocabulary 4096).
The peak model (docs/planner.md) does not count these bytes.

    python -m benchmarks.mkl_cache      # prints the table, writes JSON to results/
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks.output import write_result

SHAPES = [(512, 384, 1152), (512, 384, 1536), (512, 1536, 384), (512, 384, 4096)]
"""(tokens, inputs, outputs) of each product, in the order run."""


def child() -> list[float]:
    """In this process: MiB kept after each product (beyond its output, freed)."""
    import torch

    from zeroservice.memory import process_status_kib

    torch.set_num_threads(1)
    a = torch.randn(16, 16)
    a @ a
    kept = []
    for m, k, n in SHAPES:
        x, w = torch.randn(m, k), torch.randn(n, k)
        before = process_status_kib("VmRSS")
        y = x @ w.t()
        del y
        kept.append((process_status_kib("VmRSS") - before) / 1024)
    return kept


def _run(cache_off: bool) -> list[float]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    env.pop("MKL_DISABLE_FAST_MM", None)
    if cache_off:
        env["MKL_DISABLE_FAST_MM"] = "1"
    code = "import json; from benchmarks.mkl_cache import child; print(json.dumps(child()))"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    on, off = _run(False), _run(True)
    print(f"{'product (tokens x in -> out)':30s}{'cache on MiB':>14s}{'cache off MiB':>15s}")
    for (m, k, n), a, b in zip(SHAPES, on, off, strict=True):
        print(f"{f'{m} x {k} -> {n}':30s}{a:14.2f}{b:15.2f}")
    print(f"{'all':30s}{sum(on):14.2f}{sum(off):15.2f}")
    record = {"shapes": SHAPES, "cache_on": on, "cache_off": off}
    write_result("benchmarks/results", "mkl-cache", record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
