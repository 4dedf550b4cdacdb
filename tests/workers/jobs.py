"""Small job specs shared by the worker tests."""

from __future__ import annotations

from typing import Any

from workers.spec import JobSpec

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
        if isinstance(value, dict) and isinstance(body.get(key), dict):
            body[key] = {**body[key], **value}
        else:
            body[key] = value
    return JobSpec.model_validate(body)
