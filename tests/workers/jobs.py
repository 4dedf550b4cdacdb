"""Small job specs shared by the worker tests."""

from __future__ import annotations

from typing import Any

from workers.spec import JobSpec

TINY_GPT2 = {
    "kind": "transformers",
    "architecture": "GPT2LMHeadModel",
    "vocab_size": 256,
    "seq_len": 16,
    "config": {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 256, "n_positions": 16},
}
"""A transformers GPT-2 built from a config, as small as TINY_GPT."""
TINY_MIXTRAL = {
    "kind": "transformers",
    "architecture": "MixtralForCausalLM",
    "vocab_size": 256,
    "seq_len": 4,
    "config": {
        "vocab_size": 256,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
    },
}
"""A transformers Mixture-of-Experts model: with 4 tokens per rank, ranks route to
different experts."""
TINY_GPT = {"kind": "gpt", "vocab_size": 256, "seq_len": 16, "n_layer": 2, "n_head": 4, "dim": 32}


def tiny_job(**overrides: Any) -> JobSpec:
    body: dict[str, Any] = {
        "name": "tiny",
        "model": TINY_GPT,
        "engine": {"stage": 2, "bucket_elements": 4096},
        "optimizer": {"type": "adamw", "lr": 3e-3},
        "steps": 8,
        "micro_batch": 2,
        "resources": {"dp": 2, "cpus_per_rank": 1},
        "checkpoint": {"interval_steps": 4, "keep": 2},
        "timeouts": {"bootstrap_s": 60, "step_s": 60},
    }
    for key, value in overrides.items():
        replaces_model = key == "model" and value.get("kind", "gpt") != "gpt"
        if isinstance(value, dict) and isinstance(body.get(key), dict) and not replaces_model:
            body[key] = {**body[key], **value}
        else:
            body[key] = value
    return JobSpec.model_validate(body)


def factory_model(factory: str, **kwargs: Any) -> dict[str, Any]:
    """A job's ``model`` of the ``factory`` kind: ``module:function`` called with kwargs,
    the tiny models' vocabulary and sequence length."""
    return {
        "kind": "factory",
        "factory": factory,
        "kwargs": kwargs,
        "vocab_size": 256,
        "seq_len": 16,
    }


def tiny_model(dim: int = 16, vocab: int = 256):
    """A model factory for the ``factory`` kind: ``forward(inputs, targets)`` -> loss."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Bigram(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
            self.out = nn.Linear(dim, vocab)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            for block in self.blocks:
                h = h + torch.tanh(block(h))
            return F.cross_entropy(self.out(h).reshape(-1, vocab), y.reshape(-1))

    return Bigram()
