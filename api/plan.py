"""The memory plan of a submitted job, and the refusal of one that cannot fit.

The plan is the engine's planner (zeroservice/planner.py) applied to the job at its
smallest size (min_dp replicas: the fewest ranks to partition over, so the most
memory per rank). The memory per rank it is checked against is the request's, or
the service's setting for GPU ranks or CPU ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from workers.spec import GPTModelSpec, JobSpec
from zeroservice.autoconf import RUNTIME_RESERVE
from zeroservice.config import KNOWN_MOE_LEAVES, ZeroConfig

from .confine import Refused

GIB = 2**30


class PlanRefused(Exception):
    def __init__(self, detail: dict[str, Any]):
        super().__init__(detail["message"])
        self.detail = detail


def plan_job(
    spec: JobSpec,
    settings,
    count_parameters: Callable[[JobSpec], int],
    device_memory_gib: float | None = None,
    refuse: bool = True,
) -> dict[str, Any]:
    """The plan; the size of a model other than the reference GPT comes from
    ``count_parameters`` (run on a worker: the control plane never builds one), and
    its activations, unknown from a count alone, are left out."""
    from zeroservice.planner import plan

    cfg = spec.zero_config()
    res = spec.resources
    gpt = isinstance(spec.model, GPTModelSpec)
    model: Any = (
        spec.model.gpt_config() if isinstance(spec.model, GPTModelSpec) else count_parameters(spec)
    )
    p = plan(
        model,
        **_sizing(spec, cfg),
        optimizer_bytes=optimizer_bytes(spec),
        micro_batch=spec.micro_batch if gpt else None,
        redundancy=cfg.redundancy,
        quantized_weights=cfg.quantized_weights,
        quantized_gradients=cfg.quantized_gradients,
        hierarchical_partition=cfg.hierarchical_partition,
        ranks_per_node=cfg.ranks_per_node,
        quantization_block=cfg.quantization_block,
    )
    gib, limit = memory_limit(spec, settings, device_memory_gib)
    per_rank = dataclasses.asdict(p) if dataclasses.is_dataclass(p) else dict(p)
    peak = _peak(spec) if gpt else None
    formula = int(per_rank["device_total"])
    if not res.gpus_per_rank:  # a CPU rank's "device" and host are the same memory
        formula += int(per_rank["host_total"])
    needed = peak.peak + RUNTIME_RESERVE if peak is not None else formula
    fits = needed <= limit
    if peak is not None:
        basis = (
            f" (predicted peak, at the {peak.phase}, plus the "
            f"{RUNTIME_RESERVE / 2**20:g} MiB runtime reserve)"
        )
    elif gpt:
        basis = (
            " (model states, activations and buffers by formula, host copies and ZeRO++'s"
            " secondary shards and quantized rows included)"
        )
    else:
        basis = " (model states only: activations not estimated)"
    message = (
        f"needs {needed / GIB:.2f} GiB per rank at dp {res.lowest_dp} × mp {res.mp}, "
        f"stage {cfg.stage}, {cfg.precision}; {gib:g} GiB available per "
        f"{'GPU' if res.gpus_per_rank else 'CPU'} rank" + basis
    )
    result = {
        "fits": fits,
        "message": message,
        "needed_bytes": needed,
        "available_bytes": limit,
        "dp": res.lowest_dp,
        "mp": res.mp,
        "per_rank": per_rank,
        "peak": None
        if peak is None
        else {
            "bytes": peak.peak,
            "reserve_bytes": RUNTIME_RESERVE,
            "phase": peak.phase,
            "by_kind": peak.breakdown[peak.phase],
        },
    }
    if refuse and not fits:
        raise PlanRefused({**result, "message": f"memory plan does not fit: {message}"})
    return result


def uncovered(spec: JobSpec, cfg: ZeroConfig) -> str | None:
    """What of a reference-GPT job the peak model (zeroservice/peak.py) does not cover,
    as the field to change; None when it covers the job."""
    gpt = spec.model.gpt_config()  # type: ignore[union-attr]
    if spec.optimizer.type not in ("adam", "adamw"):
        return f"optimizer.type: {spec.optimizer.type} (Adam or AdamW are modelled)"
    if gpt.dropout != 0:
        return "model.dropout: not 0"
    if cfg.gradient_accumulation_steps != 1:
        return "engine.gradient_accumulation_steps: not 1"
    if cfg.precision == "fp16":
        return "engine.precision: fp16 (bf16 or fp32 are modelled)"
    if cfg.redundancy != "none":
        return "engine.redundancy: host copies"
    if cfg.quantized_weights or cfg.hierarchical_partition or cfg.quantized_gradients != "none":
        return "engine: ZeRO++ switches"
    return uncovered_at_stage3(cfg) if cfg.stage == 3 else None


def uncovered_at_stage3(cfg: ZeroConfig) -> str | None:
    """What of the engine config the peak model does not cover at stage 3, whatever
    ``cfg.stage`` says (auto may choose stage 3)."""
    if set(cfg.stage3_leaf_modules) - set(KNOWN_MOE_LEAVES):
        # (the default's MoE layers are not in the reference GPT)
        return "engine.stage3_leaf_modules: leaf modules (gathered and staged whole in backward)"
    return None


def memory_limit(spec: JobSpec, settings, device_memory_gib: float | None) -> tuple[float, int]:
    """The memory per rank a job is held to (GiB, bytes): the request's, or the
    service's setting for GPU ranks or CPU ranks."""
    gib = device_memory_gib or (
        settings.device_memory_gib if spec.resources.gpus_per_rank else settings.cpu_rank_memory_gib
    )
    limit = int(gib * GIB)
    if limit < 1:
        raise Refused(f"device_memory_gib: {gib!r} GiB is less than one byte per rank")
    return gib, limit


def optimizer_bytes(spec: JobSpec) -> int:
    """Bytes of optimizer state per parameter (K): Adam's two moments, SGD's momentum
    buffer when it has momentum, nothing for plain SGD."""
    opt = spec.optimizer
    if opt.type == "sgd":
        return 4 if opt.momentum else 0
    return 8


def _sizing(spec: JobSpec, cfg: ZeroConfig) -> dict[str, Any]:
    """What the formula (``planner.plan``) and the peak model (``PeakConfig``) both take
    of a job, at its fewest replicas (where each rank holds the most)."""
    return {
        "dp": spec.resources.lowest_dp,
        "mp": spec.resources.mp,
        "stage": cfg.stage,
        "precision": cfg.precision,
        "offload_optimizer": cfg.offload_optimizer,
        "activation_checkpointing": cfg.activation_checkpointing,
        "partition_activations": cfg.partition_activations,
        "cpu_offload_activations": cfg.cpu_offload_activations,
        "seq_len": spec.model.seq_len,
        "bucket_elements": cfg.bucket_elements,
    }


def _peak(spec: JobSpec) -> Any:
    """The reference GPT's predicted peak per rank (zeroservice/peak.py, held within
    ±10% of measured peaks), where that model covers the job: Adam or AdamW, dropout 0,
    one micro-batch per step, no fp16 loss scaling, no host copies, no ZeRO++
    switches and no stage-3 leaf modules; None otherwise (the planner's formula is used)."""
    from zeroservice.peak import PeakConfig, predict_peak

    cfg = spec.zero_config()
    gpt = spec.model.gpt_config()  # type: ignore[union-attr]
    if uncovered(spec, cfg) is not None:
        return None
    try:
        return predict_peak(
            PeakConfig(
                gpt=gpt,
                **_sizing(spec, cfg),
                micro_batch=spec.micro_batch,
                prefetch_elements=cfg.stage3_prefetch_elements,
                persistence_elements=cfg.stage3_persistence_elements,
                collectives=cfg.collectives,
                device=spec.resources.device,
            )
        )
    except ValueError:
        return None
