"""Bring a DeepSpeed JSON config: translate what we support, refuse the rest by name.

Nothing is silently ignored: a key we do not implement, or a value whose behaviour
we do not reproduce, raises ConfigError naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .config import ConfigError, LossScaleConfig, ScheduleConfig, ZeroConfig, _is_int
from .optim import OptimizerFactory

_TOP = {
    "zero_optimization",
    "bf16",
    "fp16",
    "gradient_clipping",
    "gradient_accumulation_steps",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "communication_data_type",
    "optimizer",
    "scheduler",
    "activation_checkpointing",
}
_ACTIVATIONS = {
    "partition_activations",
    "cpu_checkpointing",
    "contiguous_memory_optimization",
    "number_checkpoints",
    "synchronize_checkpoint_boundary",
    "profile",
}
_ZERO = {
    "stage",
    "reduce_bucket_size",
    "allgather_bucket_size",
    "overlap_comm",
    "contiguous_gradients",
    "reduce_scatter",
    "allgather_partitions",
    "stage3_max_live_parameters",
    "stage3_param_persistence_threshold",
    "offload_optimizer",
    "zero_quantized_weights",
    "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights",
    "zero_hpz_partition_size",
}
_FP16 = {
    "enabled",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "min_loss_scale",
    "auto_cast",
}


@dataclass
class DeepSpeedSettings:
    config: ZeroConfig
    optimizer: OptimizerFactory | None
    """Built from the ``optimizer`` section, if the config has one."""


def _refuse_unknown(section: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(section) - allowed)
    if unknown:
        names = ", ".join(f"{where}{k}" for k in unknown)
        raise ConfigError(f"{names}: not supported by zeroservice (refused, not ignored)")


def _insist(section: dict[str, Any], key: str, value: Any, where: str) -> None:
    if key in section and section[key] != value:
        raise ConfigError(
            f"{where}{key}={section[key]!r}: zeroservice always behaves as {key}={value!r}"
        )


def _zero(zero: dict[str, Any], out: dict[str, Any]) -> None:
    _refuse_unknown(zero, _ZERO, "zero_optimization.")
    for key in ("contiguous_gradients", "reduce_scatter", "allgather_partitions"):
        _insist(zero, key, True, "zero_optimization.")
    out["stage"] = zero.get("stage", 0)
    reduce_size = zero.get("reduce_bucket_size")
    gather_size = zero.get("allgather_bucket_size")
    if reduce_size is not None and gather_size is not None and reduce_size != gather_size:
        raise ConfigError(
            "zero_optimization.allgather_bucket_size: zeroservice uses one constant bucket "
            f"size; got {gather_size} beside reduce_bucket_size {reduce_size}"
        )
    size = reduce_size if reduce_size is not None else gather_size
    if size is not None:
        out["bucket_elements"] = int(size)
    if "overlap_comm" in zero:
        out["overlap_comm"] = bool(zero["overlap_comm"])
    # Both are per parameter in DeepSpeed and per unit here: the same budget, coarser grain.
    if "stage3_max_live_parameters" in zero:
        out["stage3_prefetch_elements"] = int(zero["stage3_max_live_parameters"])
    if "stage3_param_persistence_threshold" in zero:
        out["stage3_persistence_elements"] = int(zero["stage3_param_persistence_threshold"])
    offload = zero.get("offload_optimizer")
    if offload is not None:
        _refuse_unknown(offload, {"device", "pin_memory"}, "zero_optimization.offload_optimizer.")
        device = offload.get("device", "none")
        if device not in ("cpu", "none"):
            raise ConfigError(
                f"zero_optimization.offload_optimizer.device={device!r}: only cpu (or none)"
            )
        _insist(offload, "pin_memory", True, "zero_optimization.offload_optimizer.")
        out["offload_optimizer"] = device == "cpu"
    _zeropp(zero, out)


def _zeropp(zero: dict[str, Any], out: dict[str, Any]) -> None:
    """ZeRO++'s three switches, refused by their DeepSpeed names where the stage does not
    have them. DeepSpeed's qgZ sends int4 blocks; its hpZ partition size is the number of
    ranks that share a node, which is also what splits our ledger into intra- and
    cross-node bytes and makes qgZ go in two hops."""
    where, stage = "zero_optimization.", out["stage"]
    _insist(zero, "zero_quantized_nontrainable_weights", False, where)
    for key in ("zero_quantized_weights", "zero_quantized_gradients"):
        if not isinstance(zero.get(key, False), bool):
            raise ConfigError(f"{where}{key}={zero[key]!r}: must be true or false")
    if zero.get("zero_quantized_weights", False):
        if stage != 3:
            raise ConfigError(
                f"{where}zero_quantized_weights: needs stage 3 (weights are gathered only "
                f"there); stage is {stage}"
            )
        out["quantized_weights"] = True
    if zero.get("zero_quantized_gradients", False):
        if stage < 1:
            raise ConfigError(
                f"{where}zero_quantized_gradients: needs stage 1, 2 or 3 (stage 0 "
                "all-reduces gradients)"
            )
        out["quantized_gradients"] = "int4"
    size = zero.get("zero_hpz_partition_size", 1)
    if not _is_int(size) or size < 1:
        raise ConfigError(f"{where}zero_hpz_partition_size={size!r}: must be an integer >= 1")
    if size > 1:
        if stage != 3:
            raise ConfigError(
                f"{where}zero_hpz_partition_size={size}: needs stage 3 (the secondary "
                f"shard is of gathered weights); stage is {stage}"
            )
        out["hierarchical_partition"] = True
        out["ranks_per_node"] = size


def _activations(section: dict[str, Any] | None, out: dict[str, Any]) -> None:
    """DeepSpeed checkpoints what the model wraps itself; here the engine checkpoints
    every block, so the section turns checkpointing on."""
    if section is None:
        return
    _refuse_unknown(section, _ACTIVATIONS, "activation_checkpointing.")
    for key in ("number_checkpoints", "synchronize_checkpoint_boundary", "profile"):
        if section.get(key) not in (None, False):
            raise ConfigError(
                f"activation_checkpointing.{key}={section[key]!r}: not supported "
                "(every block is checkpointed)"
            )
    out["activation_checkpointing"] = True
    out["partition_activations"] = bool(section.get("partition_activations", False))
    out["cpu_offload_activations"] = bool(section.get("cpu_checkpointing", False))
    out["contiguous_activations"] = bool(section.get("contiguous_memory_optimization", True))


def _precision(ds: dict[str, Any], out: dict[str, Any]) -> None:
    bf16 = ds.get("bf16", {}).get("enabled", False)
    fp16_section = ds.get("fp16", {})
    _refuse_unknown(ds.get("bf16", {}), {"enabled"}, "bf16.")
    _refuse_unknown(fp16_section, _FP16, "fp16.")
    fp16 = fp16_section.get("enabled", False)
    if bf16 and fp16:
        raise ConfigError("bf16.enabled, fp16.enabled: choose one")
    out["precision"] = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    if fp16:
        _insist(fp16_section, "auto_cast", False, "fp16.")
        if fp16_section.get("loss_scale", 0) != 0:
            raise ConfigError("fp16.loss_scale: only dynamic loss scaling (0) is supported")
        out["loss_scale"] = LossScaleConfig(
            initial_scale=2.0 ** fp16_section.get("initial_scale_power", 16),
            growth_interval=fp16_section.get("loss_scale_window", 1000),
            hysteresis=fp16_section.get("hysteresis", 2),
            min_scale=fp16_section.get("min_loss_scale", 1),
        )
    comm_dtype = ds.get("communication_data_type")
    if comm_dtype is not None:
        if comm_dtype == "fp32":
            out["reduce_dtype"] = "fp32"
        elif comm_dtype == out["precision"]:
            out["reduce_dtype"] = "param"
        else:
            raise ConfigError(
                f"communication_data_type={comm_dtype!r}: use fp32 or the training "
                f"precision ({out['precision']})"
            )


def _batch(ds: dict[str, Any], out: dict[str, Any], world_size: int | None) -> None:
    accum = ds.get("gradient_accumulation_steps")
    micro = ds.get("train_micro_batch_size_per_gpu")
    total = ds.get("train_batch_size")
    if total is not None and micro is not None and world_size is not None:
        per_step = micro * world_size
        if accum is None:
            if total % per_step:
                raise ConfigError(
                    f"train_batch_size={total} is not a multiple of "
                    f"train_micro_batch_size_per_gpu x world size = {per_step}"
                )
            accum = total // per_step
        elif total != per_step * accum:
            raise ConfigError(
                f"train_batch_size={total} != train_micro_batch_size_per_gpu {micro} x "
                f"gradient_accumulation_steps {accum} x world size {world_size}"
            )
    elif total is not None and (micro is None or world_size is None) and accum is None:
        raise ConfigError(
            "train_batch_size: also give train_micro_batch_size_per_gpu and world_size, "
            "or gradient_accumulation_steps"
        )
    if accum is not None:
        out["gradient_accumulation_steps"] = int(accum)
    if micro is not None:
        out["train_micro_batch_size"] = int(micro)


def _optimizer(section: dict[str, Any] | None) -> OptimizerFactory | None:
    if section is None:
        return None
    _refuse_unknown(section, {"type", "params"}, "optimizer.")
    kind = str(section.get("type", "")).lower()
    params = dict(section.get("params", {}))
    if kind in ("adam", "adamw"):
        # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false.
        decoupled = params.pop("adam_w_mode", True) if kind == "adam" else True
        params.pop("torch_adam", None)
        adam_keys = {"lr", "betas", "eps", "weight_decay", "amsgrad"}
        _refuse_unknown(params, adam_keys, "optimizer.params.")
        cls: type[torch.optim.Optimizer] = torch.optim.AdamW if decoupled else torch.optim.Adam
    elif kind == "sgd":
        _refuse_unknown(
            params, {"lr", "momentum", "weight_decay", "nesterov", "dampening"}, "optimizer.params."
        )
        cls = torch.optim.SGD
    else:
        raise ConfigError(f"optimizer.type={section.get('type')!r}: supported are Adam, AdamW, SGD")
    if "betas" in params:
        params["betas"] = tuple(params["betas"])

    def factory(shards):
        return cls(shards, **params)

    return factory


DEEPSPEED_WARMUP_STEPS = 1000
"""``warmup_num_steps`` when a DeepSpeed scheduler leaves it out (both schedulers)."""


def _scheduler(section: dict[str, Any] | None, out: dict[str, Any]) -> None:
    if section is None:
        return
    _refuse_unknown(section, {"type", "params"}, "scheduler.")
    kind, p = section.get("type"), dict(section.get("params", {}))
    if kind not in ("WarmupCosineLR", "WarmupLR"):
        raise ConfigError(
            f"scheduler.type={kind!r}: supported are WarmupCosineLR and WarmupLR "
            "(learning rates come from the optimizer section)"
        )
    warmup = p.pop("warmup_type", None)
    if warmup is None and p.get("warmup_num_steps", DEEPSPEED_WARMUP_STEPS):
        raise ConfigError(
            "scheduler.params.warmup_type: unset means DeepSpeed's default, 'log', which "
            "is not supported; set 'linear' (lr_schedule warms up linearly)"
        )
    if warmup not in (None, "linear"):
        raise ConfigError(f"scheduler.params.warmup_type={warmup!r}: only 'linear' is supported")
    if kind == "WarmupCosineLR":
        if "total_num_steps" not in p:
            raise ConfigError("scheduler.params.total_num_steps: WarmupCosineLR needs it")
        _refuse_unknown(
            p,
            {"total_num_steps", "warmup_num_steps", "warmup_min_ratio", "cos_min_ratio"},
            "scheduler.params.",
        )
        out["lr_schedule"] = ScheduleConfig(
            kind="cosine",
            warmup_steps=p.get("warmup_num_steps", DEEPSPEED_WARMUP_STEPS),
            total_steps=p["total_num_steps"],
            min_ratio=p.get("cos_min_ratio", 0.0001),
            warmup_start_ratio=p.get("warmup_min_ratio", 0.0),
        )
    else:
        _refuse_unknown(p, {"warmup_num_steps"}, "scheduler.params.")
        out["lr_schedule"] = ScheduleConfig(
            warmup_steps=p.get("warmup_num_steps", DEEPSPEED_WARMUP_STEPS)
        )


def from_deepspeed(ds: dict[str, Any], world_size: int | None = None) -> DeepSpeedSettings:
    """Translate a DeepSpeed config dict; ``world_size`` checks ``train_batch_size``."""
    if not isinstance(ds, dict):
        raise ConfigError(f"DeepSpeed config: expected a dict, got {type(ds).__name__}")
    _refuse_unknown(ds, _TOP, "")
    out: dict[str, Any] = {}
    _zero(ds.get("zero_optimization", {}), out)
    _precision(ds, out)
    _batch(ds, out, world_size)
    if "gradient_clipping" in ds:
        out["gradient_clipping"] = float(ds["gradient_clipping"])
    _scheduler(ds.get("scheduler"), out)
    _activations(ds.get("activation_checkpointing"), out)
    return DeepSpeedSettings(ZeroConfig(**out), _optimizer(ds.get("optimizer")))
