"""FLOPs per token and peak FLOPS per device: what achieved TFLOPS and MFU are made of.

FLOPs per token are counted as torchtitan does: 6·N for the matmuls of forward and
backward over the N parameters that multiply in each token's step, plus the attention
term 12·L·d·s (scores and values, forward and backward). An embedding table is looked
up, not multiplied, so it is left out of N (position tables, an untied input
embedding), except where it is also the output head (a tied embedding: the head's
matmul is real work). In a Mixture-of-Experts model a token runs through top-k of E
experts, so only k/E of the experts' weights count. Recomputation (activation
checkpointing) is not counted: MFU measures useful work. With tensor parallelism each
rank does 1/mp of every token's work.
"""

from __future__ import annotations

import os
import re

import torch
from torch import nn

from .spec import GPTModelSpec, JobSpec

# Dense bf16 tensor-core peaks, vendor datasheets (SXM parts where there are two).
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "A10": 125.0,
    "V100": 125.0,
}
"""Matched as a whole word of the device's name ("NVIDIA L40" is not an L4, "NVIDIA
A10G" not an A10); a GPU not listed has no MFU unless ``peak_tflops`` is given."""


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
        return gpu_peak_tflops(torch.cuda.get_device_name(device))
    return cpu_peak_tflops(torch.get_num_threads())


def gpu_peak_tflops(name: str) -> float:
    """The datasheet peak of a GPU by its name; 0 (no MFU) for one not listed."""
    words = set(re.split(r"[^A-Za-z0-9]+", name.upper()))
    return next((value for key, value in PEAK_TFLOPS.items() if key in words), 0.0)


def flops_per_token(spec: JobSpec, model: nn.Module, psi: int) -> float:
    """Training FLOPs per token for the whole model (divide by mp for one rank);
    ``psi``: the trainable parameters (the engine's count: placeholders hold none)."""
    m = spec.model
    if isinstance(m, GPTModelSpec):
        return float(m.gpt_config().flops_per_token())
    n = (psi - _not_multiplied(model)) * spec.resources.mp
    cfg = getattr(getattr(model, "model", None), "config", None)
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    dim = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    attention = 12 * layers * dim * m.seq_len if layers and dim else 0
    return float(6 * n + attention)


def _not_multiplied(module: nn.Module) -> float:
    """Parameters of this rank that no token multiplies by: embedding tables other than
    the output head's weight, and the experts a token is not routed to (1 - k/E of
    them, by the model's config). Counted from the modules' shapes: at stage 3 the
    parameters are empty placeholders."""
    inner = getattr(module, "model", module)
    config = getattr(inner, "config", None)
    output = getattr(inner, "get_output_embeddings", lambda: None)()
    head = getattr(output, "weight", None)
    lookups = sum(
        m.num_embeddings * m.embedding_dim
        for m in module.modules()
        if isinstance(m, nn.Embedding) and m.weight is not head
    )
    experts = _experts_per_token(config)
    if experts is None:
        return float(lookups)
    k, e = experts
    routed = sum(
        m.in_features * m.out_features + (m.out_features if m.bias is not None else 0)
        for name, m in module.named_modules()
        if isinstance(m, nn.Linear) and ".experts." in f".{name}."
    )
    return lookups + routed * (1 - k / e)


def _experts_per_token(config) -> tuple[int, int] | None:
    """(k, E): experts per token and routed experts, from a transformers MoE config."""
    k = getattr(config, "num_experts_per_tok", None)
    e = next(
        (
            v
            for v in (getattr(config, n, None) for n in _EXPERT_COUNTS)
            if isinstance(v, int) and v > 0
        ),
        None,
    )
    if isinstance(k, int) and e and 0 < k <= e:
        return k, e
    return None


_EXPERT_COUNTS = ("num_local_experts", "n_routed_experts", "num_experts")
"""Where transformers' MoE configs keep the routed experts' count (Mixtral and PhiMoE;
DeepSeek; Qwen-MoE and OLMoE)."""
