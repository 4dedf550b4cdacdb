"""Scenarios of tests/gpu: any engine or checkpoint scenario, run on this rank's GPU."""

from __future__ import annotations

import torch

from tests.engine import harness
from tests.engine.scenarios import Spec, engine_for
from zeroservice import ConfigError


def on_gpu(fn, *args):
    """``fn(*args)`` with its models and batches on the GPU, and the GPU memory it took:
    a scenario that fell back to the CPU shows as 0 bytes."""
    assert harness.device().type == "cuda", harness.device()
    torch.cuda.reset_peak_memory_stats()
    result = fn(*args)
    return {"result": result, "cuda_bytes": torch.cuda.max_memory_allocated()}


def ring_refused() -> str:
    """The error of an engine asked for the point-to-point ring over GPU tensors."""
    try:
        engine_for(Spec(stage=2, collectives="ring"))
    except ConfigError as exc:
        return str(exc)
    return "built"
