"""FLOPs per token and peak FLOPS per device: what achieved TFLOPS and MFU are made of.

FLOPs per token are counted as torchtitan does: 6·N for the matmuls of forward and
backward over N parameters (embeddings excluded from neither side: the tied head's
matmul is real work), plus the attention term 12·L·d·s (scores and values, forward and
backward). Recomputation (activation checkpointing) is not counted: MFU measures useful
work. With tensor parallelism each rank does 1/mp of every token's work.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .spec import GPTModelSpec, JobSpec

# Dense bf16 tensor-core peaks, vendor datasheets (SXM parts where there are two).
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10": 125.0,
    "V100": 125.0,
}


def cpu_peak_tflops(threads: int) -> float:
    """An estimate for CPU ranks: threads × 2.5 GHz × 32 fp32 FLOP per cycle (two AVX2
    FMA units). Set ``peak_tflops`` in the job for a measured figure."""
    return threads * 2.5e9 * 32 / 1e12


def peak_tflops(device: torch.device, override: float | None = None) -> float:
    if override is not None:
        return override
    env = os.environ.get("ZEROSERVICE_PEAK_TFLOPS")
    if env:
        return float(env)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in PEAK_TFLOPS.items():
            if key in name:
                return value
    return cpu_peak_tflops(torch.get_num_threads())


def flops_per_token(spec: JobSpec, model: nn.Module, psi: int) -> float:
    """Training FLOPs per token for the whole model (divide by mp for one rank);
    ``psi``: the trainable parameters (the engine's count: placeholders hold none)."""
    m = spec.model
    if isinstance(m, GPTModelSpec):
        return float(m.gpt_config().flops_per_token())
    n = psi * spec.resources.mp
    cfg = getattr(getattr(model, "model", None), "config", None)
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    dim = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    attention = 12 * layers * dim * m.seq_len if layers and dim else 0
    return float(6 * n + attention)
