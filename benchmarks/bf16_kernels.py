"""Resident bytes per bf16 matrix-product shape: the constant behind peak.py's kernels.

On a CPU where oneDNN multiplies bf16 natively (AVX512-BF16, AMX), each distinct
product shape keeps a compiled kernel and its buffers for the life of the process.
This measures, in fresh processes with ``MALLOC_MMAP_THRESHOLD_=131072``, the resident
size a process keeps after running new shapes, as the host runs them and with oneDNN
held below bf16 instructions (``ONEDNN_MAX_CPU_ISA=AVX512_CORE``), and divides the
difference by the number of product shapes:

* ``linear``: 30 bf16 linear maps of new shapes (256 tokens, 64-528 inputs, 512-2368
  outputs), forward and backward: 90 products;
* GPT rows: two training steps of a bf16 reference GPT, the resident size beyond its
  parameters; the step's distinct products are ``peak.BF16_MATMUL_SHAPES``.

Both processes first run a tiny product and a tiny GPT step, so that what every bf16
process loads once counts as start-up.

    python -m benchmarks.bf16_kernels     # prints the table, writes JSON to results/
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks.output import write_result

GPTS = [  # vocab, seq_len, layers, heads, dim, micro-batch
    (1024, 128, 2, 2, 128, 4),
    (2048, 64, 4, 4, 256, 2),
    (4096, 64, 2, 6, 384, 4),
    (1024, 64, 3, 2, 96, 4),
]
RESTRICTED = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}


def _rss() -> int:
    from zeroservice.memory import process_status_kib

    return process_status_kib("VmRSS") * 1024


def _linear_maps() -> dict:
    import torch

    start = _rss()
    for i in range(30):
        x = torch.randn(256, 64 + 16 * i, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(512 + 64 * i, 64 + 16 * i, dtype=torch.bfloat16, requires_grad=True)
        torch.nn.functional.linear(x, w).sum().backward()
        del x, w
    return {"products": 90, "retained_bytes": _rss() - start}


def _gpt(shape: tuple[int, ...]) -> dict:
    import torch

    from zeroservice.models import GPT, GPTConfig

    vocab, seq, layers, heads, dim, batch = shape
    cfg = GPTConfig(vocab_size=vocab, seq_len=seq, n_layer=layers, n_head=heads, dim=dim)
    start = _rss()
    model = GPT(cfg).to(torch.bfloat16)
    x = torch.randint(0, vocab, (batch, seq))
    for _ in range(2):
        model(x, x).backward()
        model.zero_grad(set_to_none=True)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"products": None, "retained_bytes": _rss() - start - params}


def child(row: str) -> dict:
    """In a fresh process: warm up, then measure ``row`` ("linear" or a GPTS index)."""
    import torch

    from zeroservice.models import GPT, GPTConfig

    torch.manual_seed(0)
    a = torch.randn(16, 16, dtype=torch.bfloat16, requires_grad=True)
    (a @ a.t()).sum().backward()
    tiny = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, dim=32))
    x = torch.randint(0, 64, (2, 16))
    tiny.to(torch.bfloat16)(x, x).backward()
    del tiny
    return _linear_maps() if row == "linear" else _gpt(GPTS[int(row)])


def _run(row: str, extra_env: dict) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", **extra_env}
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bf16_kernels", "--child", row],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child)))
        return 0
    from zeroservice.peak import BF16_KERNEL_BYTES, BF16_MATMUL_SHAPES, native_bf16_matmul

    native = native_bf16_matmul()
    print(f"native bf16 products on this host: {native}")
    if not native:
        print("nothing to measure: this host keeps no bf16 kernels (the term is 0 here)")
        return 0
    mib = 2**20
    rows = []
    print(f"{'row':28s} {'products':>8s} {'native MiB':>10s} {'without':>8s} {'MiB/product':>11s}")
    for row in ["linear", *map(str, range(len(GPTS)))]:
        here, below = _run(row, {}), _run(row, RESTRICTED)
        products = here["products"] or BF16_MATMUL_SHAPES
        per = (here["retained_bytes"] - below["retained_bytes"]) / products
        name = (
            "linear maps"
            if row == "linear"
            else "gpt v{} s{} L{} h{} d{} b{}".format(*GPTS[int(row)])
        )
        rows.append({"row": name, "products": products, "native": here, "restricted": below})
        rows[-1]["bytes_per_product"] = per
        print(
            f"{name:28s} {products:8d} {here['retained_bytes'] / mib:10.2f} "
            f"{below['retained_bytes'] / mib:8.2f} {per / mib:11.3f}"
        )
    worst = max(r["bytes_per_product"] for r in rows)
    print(
        f"\nlargest {worst / mib:.3f} MiB per product; peak.py counts "
        f"{BF16_KERNEL_BYTES / mib:.3f} MiB ({'above' if worst <= BF16_KERNEL_BYTES else 'BELOW'})"
    )
    write_result(args.out, "bf16-kernels", {"kernel_bytes": BF16_KERNEL_BYTES, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
