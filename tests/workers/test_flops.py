"""FLOPs per token and the peak TFLOPS that MFU divides by (workers/flops.py): counted
by hand from the model's shapes, the way torchtitan counts them."""

from __future__ import annotations

import pytest

from tests.workers.jobs import TINY_MIXTRAL
from workers import flops
from workers.build import _transformers_model
from workers.spec import JobSpec
from zeroservice.models import GPTConfig


@pytest.mark.parametrize("tied", [True, False])
def test_a_gpt_counts_the_matmuls_not_the_lookups(tied):
    """The position table and an untied token embedding are looked up: tied or not,
    the head's matmul is the same work."""
    cfg = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=4, dim=64, tie_weights=tied)
    d, v, f, s, layers = 64, 256, 256, 16, 2
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    matmuls = layers * block + 2 * d + v * d  # the head, tied or its own
    assert cfg.flops_per_token() == 6 * matmuls + 12 * layers * d * s


def test_a_mixture_of_experts_counts_the_experts_a_token_runs_through():
    spec = JobSpec.model_validate({"name": "moe", "model": TINY_MIXTRAL, "micro_batch": 2})
    model = _transformers_model(spec.model)
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    c = TINY_MIXTRAL["config"]
    layers, d, f = c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]
    idle = layers * (c["num_local_experts"] - c["num_experts_per_tok"]) * 3 * d * f  # w1-w3
    lookup = c["vocab_size"] * d  # the input embedding (Mixtral's head is its own)
    expected = 6 * (psi - idle - lookup) + 12 * layers * d * TINY_MIXTRAL["seq_len"]
    assert flops.flops_per_token(spec, model, psi) == expected


@pytest.mark.parametrize(
    "name,peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L40", 181.0),  # not an L4
        ("NVIDIA L4", 121.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA A10G", 0.0),  # not an A10: not listed, no MFU
        ("Tesla V100-SXM2-16GB", 125.0),
    ],
)
def test_a_gpus_peak_is_found_by_its_whole_name(name, peak):
    assert flops.gpu_peak_tflops(name) == peak
