"""Bring a DeepSpeed JSON config: translate what we support, refuse the rest by name.

Nothing is silently ignored: a key we do not implement, or a value whose behaviour
we do not reproduce, raises ConfigError naming the key. Every value is read with its
type (a count is an integer, or an integral float such as 5e8; a switch is true or
false), so a wrong one is refused by its key too, and ``"auto"``, which the Hugging
Face Trainer replaces by its own arguments before DeepSpeed reads the config, is
refused with that said. A few keys change only DeepSpeed's logging or its memory and
time trade-offs, never what is trained: they are accepted and listed, with why, in
``DeepSpeedSettings.without_effect`` (and a warning).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, overload

import torch

from .config import (
    KNOWN_MOE_LEAVES,
    ConfigError,
    LossScaleConfig,
    ScheduleConfig,
    ZeroConfig,
    _is_int,
)
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
    "leaf_module",
}
_FP16 = {
    "enabled",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "min_loss_scale",
    "auto_cast",
    "consecutive_hysteresis",
}


WITHOUT_EFFECT = {
    "steps_per_print": "DeepSpeed's own logging",
    "wall_clock_breakdown": "DeepSpeed's own timers",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        "DeepSpeed's save_16bit_model; engine.state_dict() always gathers whole weights"
    ),
    "zero_optimization.sub_group_size": (
        "DeepSpeed steps its optimizer in groups of this many elements to bound memory; "
        "the update is the same, and here each rank's shard is stepped whole"
    ),
    "zero_optimization.stage3_max_reuse_distance": (
        "when DeepSpeed keeps a released parameter for a near reuse; the prefetch here "
        "follows the recorded order within stage3_prefetch_elements"
    ),
    "zero_optimization.stage3_prefetch_bucket_size": (
        "how much DeepSpeed fetches ahead; here stage3_prefetch_elements (from "
        "stage3_max_live_parameters) bounds gathered and in-flight elements together"
    ),
    "zero_optimization.round_robin_gradients": "the order DeepSpeed copies offloaded gradients",
    "prescale_gradients": (
        "whether DeepSpeed divides gradients before or after summing them over the ranks: "
        "the mean is the same; here fp16 gradients are divided first (their range) and "
        "fp32 and bf16 ones after"
    ),
    "gradient_predivide_factor": (
        "how DeepSpeed splits that division between before and after the sum: the mean is the same"
    ),
}
"""Keys accepted without effect, and why: none of them changes what is trained."""
_NUMERIC_WITHOUT_EFFECT = {
    "steps_per_print",
    "zero_optimization.sub_group_size",
    "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.stage3_prefetch_bucket_size",
}
_REAL_WITHOUT_EFFECT = {"gradient_predivide_factor"}

AUTO = (
    "'auto' is filled in by the Hugging Face Trainer from its own arguments before "
    "DeepSpeed reads the config; zeroservice reads the config as it is: give the value"
)


@dataclass
class DeepSpeedSettings:
    config: ZeroConfig
    optimizer: OptimizerFactory | None
    """Built from the ``optimizer`` section, if the config has one."""
    without_effect: dict[str, str] = field(default_factory=dict)
    """Keys of the config accepted without effect here, and why (``WITHOUT_EFFECT``)."""


def _not_auto(value: Any, name: str) -> None:
    if isinstance(value, str) and value == "auto":
        raise ConfigError(f"{name}='auto': {AUTO}")


def _section(parent: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    """A sub-object (absent or null: empty)."""
    value = parent.get(key)
    if value is None:
        return {}
    _not_auto(value, f"{where}{key}")
    if not isinstance(value, dict):
        raise ConfigError(f"{where}{key}: expected an object, got {type(value).__name__}")
    return value


def _checked(
    section: dict[str, Any], key: str, where: str, default: Any, ok: Any, what: str
) -> Any:
    """``section[key]`` (``default`` when absent) if ``ok(value)``; else refused by key."""
    if key not in section:
        return default
    value = section[key]
    _not_auto(value, f"{where}{key}")
    if not ok(value):
        raise ConfigError(f"{where}{key}={value!r}: must be {what}")
    return value


def _flag(section: dict[str, Any], key: str, where: str, default: bool) -> bool:
    return _checked(section, key, where, default, lambda v: isinstance(v, bool), "true or false")


@overload
def _integer(
    section: dict[str, Any], key: str, where: str, default: int, minimum: int = 0
) -> int: ...
@overload
def _integer(
    section: dict[str, Any], key: str, where: str, default: None = None, minimum: int = 0
) -> int | None: ...
def _integer(
    section: dict[str, Any], key: str, where: str, default: int | None = None, minimum: int = 0
) -> int | None:
    """An integer, or an integral float (DeepSpeed configs write 5e8)."""
    if key not in section:
        return default
    value = section[key]
    _not_auto(value, f"{where}{key}")
    integral = _is_int(value) or (
        isinstance(value, float) and math.isfinite(value) and value.is_integer()
    )
    if not integral or value < minimum:
        raise ConfigError(f"{where}{key}={value!r}: must be an integer >= {minimum}")
    return int(value)


@overload
def _real(section: dict[str, Any], key: str, where: str, default: float) -> float: ...
@overload
def _real(section: dict[str, Any], key: str, where: str, default: None = None) -> float | None: ...
def _real(
    section: dict[str, Any], key: str, where: str, default: float | None = None
) -> float | None:
    """A finite number >= 0."""
    if key not in section:
        return default
    value = section[key]
    _not_auto(value, f"{where}{key}")
    if not _is_real(value) or value < 0:
        raise ConfigError(f"{where}{key}={value!r}: must be a finite number >= 0")
    return float(value)


def _is_real(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and math.isfinite(value)


def _text(section: dict[str, Any], key: str, where: str, default: str | None = None) -> str | None:
    return _checked(section, key, where, default, lambda v: isinstance(v, str), "a string")


def _without_effect(ds: dict[str, Any], zero: dict[str, Any]) -> dict[str, str]:
    """The keys of ``WITHOUT_EFFECT`` the config has, their values checked."""
    found: dict[str, str] = {}
    for name, why in WITHOUT_EFFECT.items():
        section, where, key = ds, "", name
        if name.startswith("zero_optimization."):
            section, where, key = zero, "zero_optimization.", name.split(".", 1)[1]
        if key not in section:
            continue
        if name in _NUMERIC_WITHOUT_EFFECT:
            _integer(section, key, where)
        elif name in _REAL_WITHOUT_EFFECT:
            if _real(section, key, where) == 0:
                raise ConfigError(f"{where}{key}=0: must be a finite number > 0")
        else:
            _flag(section, key, where, False)
        found[name] = why
    return found


def _refuse_unknown(section: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(section) - allowed)
    if unknown:
        names = ", ".join(f"{where}{k}" for k in unknown)
        raise ConfigError(f"{names}: not supported by zeroservice (refused, not ignored)")


def _insist(section: dict[str, Any], key: str, value: bool, where: str) -> None:
    if _flag(section, key, where, value) != value:
        raise ConfigError(
            f"{where}{key}={section[key]!r}: zeroservice always behaves as {key}={value!r}"
        )


def _zero(zero: dict[str, Any], out: dict[str, Any]) -> None:
    where = "zero_optimization."
    _refuse_unknown(zero, _ZERO, where)
    for key in ("contiguous_gradients", "reduce_scatter", "allgather_partitions"):
        _insist(zero, key, True, where)
    out["stage"] = _integer(zero, "stage", where, 0)
    reduce_size = _integer(zero, "reduce_bucket_size", where, minimum=1)
    gather_size = _integer(zero, "allgather_bucket_size", where, minimum=1)
    if reduce_size is not None and gather_size is not None and reduce_size != gather_size:
        raise ConfigError(
            "zero_optimization.allgather_bucket_size: zeroservice uses one constant bucket "
            f"size; got {gather_size} beside reduce_bucket_size {reduce_size}"
        )
    size = reduce_size if reduce_size is not None else gather_size
    if size is not None:
        out["bucket_elements"] = size
    if "overlap_comm" in zero:
        out["overlap_comm"] = _flag(zero, "overlap_comm", where, True)
    # Both are per parameter in DeepSpeed and per unit here: the same budget, coarser grain.
    live = _integer(zero, "stage3_max_live_parameters", where)
    if live is not None:
        out["stage3_prefetch_elements"] = live
    persistence = _integer(zero, "stage3_param_persistence_threshold", where)
    if persistence is not None:
        out["stage3_persistence_elements"] = persistence
    if zero.get("offload_optimizer") is not None:
        offload = _section(zero, "offload_optimizer", where)
        inner = f"{where}offload_optimizer."
        _refuse_unknown(offload, {"device", "pin_memory"}, inner)
        device = _text(offload, "device", inner, "none")
        if device not in ("cpu", "none"):
            raise ConfigError(f"{inner}device={device!r}: only cpu (or none)")
        # Copy speed only: host copies are pinned whenever the model is on a GPU.
        _flag(offload, "pin_memory", inner, False)
        out["offload_optimizer"] = device == "cpu"
    if zero.get("leaf_module") is not None:
        out["stage3_leaf_modules"] = _leaf_modules(_section(zero, "leaf_module", where))
    _zeropp(zero, out)


def _leaf_modules(leaf: dict[str, Any]) -> list[str]:
    """``zero_optimization.leaf_module``: ``classes`` (replacing the default list, as in
    DeepSpeed; a dotted path is matched by its class name) and qualified ``names``."""
    where = "zero_optimization.leaf_module."
    _refuse_unknown(leaf, {"classes", "names", "name_suffixes"}, where)
    if _names(leaf, "name_suffixes", where):
        raise ConfigError(
            f"{where}name_suffixes: not supported; list the modules' qualified names in "
            "names, or their classes in classes"
        )
    classes = _names(leaf, "classes", where) if "classes" in leaf else list(KNOWN_MOE_LEAVES)
    return [c.rsplit(".", 1)[-1] for c in classes] + _names(leaf, "names", where)


def _names(section: dict[str, Any], key: str, where: str) -> list[str]:
    """A list of non-empty strings (one string: a list of one; absent: none)."""
    value = section.get(key, [])
    _not_auto(value, f"{where}{key}")
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(v, str) and v.strip() for v in names):
        raise ConfigError(f"{where}{key}={value!r}: must be a list of names")
    return names


def _zeropp(zero: dict[str, Any], out: dict[str, Any]) -> None:
    """ZeRO++'s three switches, refused by their DeepSpeed names where the stage does not
    have them. DeepSpeed's qgZ sends int4 blocks; its hpZ partition size is the number of
    ranks that share a node, which is also what splits our ledger into intra- and
    cross-node bytes and makes qgZ go in two hops."""
    where, stage = "zero_optimization.", out["stage"]
    _insist(zero, "zero_quantized_nontrainable_weights", False, where)
    if _flag(zero, "zero_quantized_weights", where, False):
        if stage != 3:
            raise ConfigError(
                f"{where}zero_quantized_weights: needs stage 3 (weights are gathered only "
                f"there); stage is {stage}"
            )
        out["quantized_weights"] = True
    if _flag(zero, "zero_quantized_gradients", where, False):
        if stage < 1:
            raise ConfigError(
                f"{where}zero_quantized_gradients: needs stage 1, 2 or 3 (stage 0 "
                "all-reduces gradients)"
            )
        out["quantized_gradients"] = "int4"
    size = zero.get("zero_hpz_partition_size", 1)
    _not_auto(size, f"{where}zero_hpz_partition_size")
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


def _activations(ds: dict[str, Any], out: dict[str, Any]) -> None:
    """DeepSpeed checkpoints what the model wraps itself; here the engine checkpoints
    every block, so the section turns checkpointing on."""
    if ds.get("activation_checkpointing") is None:
        return
    where = "activation_checkpointing."
    section = _section(ds, "activation_checkpointing", "")
    _refuse_unknown(section, _ACTIVATIONS, where)
    for key in ("number_checkpoints", "synchronize_checkpoint_boundary", "profile"):
        if section.get(key) is not None and section[key] is not False:  # 0 is no false
            raise ConfigError(
                f"{where}{key}={section[key]!r}: not supported (every block is checkpointed)"
            )
    out["activation_checkpointing"] = True
    out["partition_activations"] = _flag(section, "partition_activations", where, False)
    out["cpu_offload_activations"] = _flag(section, "cpu_checkpointing", where, False)
    out["contiguous_activations"] = _flag(section, "contiguous_memory_optimization", where, True)


def _precision(ds: dict[str, Any], out: dict[str, Any]) -> None:
    bf16_section, fp16_section = _section(ds, "bf16", ""), _section(ds, "fp16", "")
    _refuse_unknown(bf16_section, {"enabled"}, "bf16.")
    _refuse_unknown(fp16_section, _FP16, "fp16.")
    bf16 = _flag(bf16_section, "enabled", "bf16.", False)
    fp16 = _flag(fp16_section, "enabled", "fp16.", False)
    if bf16 and fp16:
        raise ConfigError("bf16.enabled, fp16.enabled: choose one")
    out["precision"] = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    if fp16:
        _insist(fp16_section, "auto_cast", False, "fp16.")
        if _real(fp16_section, "loss_scale", "fp16.", 0.0) != 0:
            raise ConfigError("fp16.loss_scale: only dynamic loss scaling (0) is supported")
        power = _integer(fp16_section, "initial_scale_power", "fp16.", 16)
        if power > 64:  # 2^1024 overflows a float; beyond 2^64 no fp16 gradient fits anyway
            raise ConfigError(f"fp16.initial_scale_power={power}: at most 64")
        out["loss_scale"] = LossScaleConfig(
            initial_scale=2.0**power,
            growth_interval=_integer(fp16_section, "loss_scale_window", "fp16.", 1000, 1),
            hysteresis=_integer(fp16_section, "hysteresis", "fp16.", 2, 1),
            consecutive_hysteresis=_flag(fp16_section, "consecutive_hysteresis", "fp16.", False),
            min_scale=_real(fp16_section, "min_loss_scale", "fp16.", 1.0),
        )
    comm_dtype = _text(ds, "communication_data_type", "")
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
    """DeepSpeed's batch arithmetic (train_batch_size = micro x accumulation x world):
    what is left out is derived from the rest, as DeepSpeed derives it, and values that
    cannot agree are refused naming them. Without ``world_size`` a train_batch_size
    needs gradient_accumulation_steps (the micro-batch and the world are not known)."""
    accum = _integer(ds, "gradient_accumulation_steps", "", minimum=1)
    micro = _integer(ds, "train_micro_batch_size_per_gpu", "", minimum=1)
    total = _integer(ds, "train_batch_size", "", minimum=1)
    if total is not None and world_size is not None:
        if micro is None:
            accum = accum or 1
            if total % (accum * world_size):
                raise ConfigError(
                    f"train_batch_size={total} is not a multiple of "
                    f"gradient_accumulation_steps {accum} x world size {world_size}"
                )
            micro = total // (accum * world_size)
        elif accum is None:
            per_step = micro * world_size
            if total % per_step:
                raise ConfigError(
                    f"train_batch_size={total} is not a multiple of "
                    f"train_micro_batch_size_per_gpu x world size = {per_step}"
                )
            accum = total // per_step
        elif total != micro * accum * world_size:
            raise ConfigError(
                f"train_batch_size={total} != train_micro_batch_size_per_gpu {micro} x "
                f"gradient_accumulation_steps {accum} x world size {world_size}"
            )
    elif total is not None:
        if accum is None:
            raise ConfigError(
                "train_batch_size: also give train_micro_batch_size_per_gpu and world_size, "
                "or gradient_accumulation_steps"
            )
        if micro is not None and total % (micro * accum):
            raise ConfigError(
                f"train_batch_size={total} is not a multiple of train_micro_batch_size_per_gpu "
                f"{micro} x gradient_accumulation_steps {accum}: no world size agrees"
            )
    if accum is not None:
        out["gradient_accumulation_steps"] = accum
    if micro is not None:
        out["train_micro_batch_size"] = micro


_ADAM = {"lr", "betas", "eps", "weight_decay", "amsgrad"}
_SGD = {"lr", "momentum", "weight_decay", "nesterov", "dampening"}


def _optimizer(ds: dict[str, Any]) -> OptimizerFactory | None:
    if ds.get("optimizer") is None:
        return None
    section = _section(ds, "optimizer", "")
    _refuse_unknown(section, {"type", "params"}, "optimizer.")
    kind = (_text(section, "type", "optimizer.", "") or "").lower()
    where = "optimizer.params."
    raw = _section(section, "params", "optimizer.")
    defaults: dict[str, Any] = {}
    if kind in ("adam", "adamw"):
        # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false.
        decoupled = _flag(raw, "adam_w_mode", where, True) if kind == "adam" else True
        if not _flag(raw, "torch_adam", where, False):
            # DeepSpeed's own Adam (FusedAdam, or DeepSpeedCPUAdam under offload) decays
            # nothing unless told; torch's AdamW, built here, would decay by 0.01.
            defaults["weight_decay"] = 0.0
        allowed = _ADAM | ({"adam_w_mode", "torch_adam"} if kind == "adam" else {"torch_adam"})
        _refuse_unknown(raw, allowed, where)
        cls: type[torch.optim.Optimizer] = torch.optim.AdamW if decoupled else torch.optim.Adam
        keys = _ADAM
    elif kind == "sgd":
        _refuse_unknown(raw, _SGD, where)
        cls, keys = torch.optim.SGD, _SGD
    else:
        raise ConfigError(f"optimizer.type={section.get('type')!r}: supported are Adam, AdamW, SGD")
    params: dict[str, Any] = dict(defaults)
    for key in sorted(keys & set(raw)):
        if key in ("amsgrad", "nesterov"):
            params[key] = _flag(raw, key, where, False)
        elif key == "betas":
            betas = raw["betas"]
            _not_auto(betas, f"{where}betas")
            ok = isinstance(betas, list | tuple) and len(betas) == 2
            if not ok or not all(_is_real(b) and 0 <= b < 1 for b in betas):
                raise ConfigError(f"{where}betas={betas!r}: must be two numbers in [0, 1)")
            params["betas"] = tuple(float(b) for b in betas)
        else:
            params[key] = _real(raw, key, where)

    def factory(shards):
        return cls(shards, **params)

    return factory


DEEPSPEED_WARMUP_STEPS = 1000
"""``warmup_num_steps`` when a DeepSpeed scheduler leaves it out (both schedulers)."""


def _scheduler(ds: dict[str, Any], out: dict[str, Any]) -> None:
    if ds.get("scheduler") is None:
        return
    section = _section(ds, "scheduler", "")
    _refuse_unknown(section, {"type", "params"}, "scheduler.")
    kind = _text(section, "type", "scheduler.")
    where = "scheduler.params."
    p = _section(section, "params", "scheduler.")
    if kind not in ("WarmupCosineLR", "WarmupLR"):
        raise ConfigError(
            f"scheduler.type={kind!r}: supported are WarmupCosineLR and WarmupLR "
            "(learning rates come from the optimizer section)"
        )
    warmup = _text(p, "warmup_type", where)
    steps = _integer(p, "warmup_num_steps", where, DEEPSPEED_WARMUP_STEPS)
    if warmup is None and steps:
        raise ConfigError(
            "scheduler.params.warmup_type: unset means DeepSpeed's default, 'log', which "
            "is not supported; set 'linear' (lr_schedule warms up linearly)"
        )
    if warmup not in (None, "linear"):
        raise ConfigError(f"scheduler.params.warmup_type={warmup!r}: only 'linear' is supported")
    if kind == "WarmupCosineLR":
        if "total_num_steps" not in p:
            raise ConfigError("scheduler.params.total_num_steps: WarmupCosineLR needs it")
        allowed = {"total_num_steps", "warmup_num_steps", "warmup_min_ratio", "cos_min_ratio"}
        _refuse_unknown(p, allowed | {"warmup_type"}, where)
        out["lr_schedule"] = ScheduleConfig(
            kind="cosine",
            warmup_steps=steps,
            total_steps=_integer(p, "total_num_steps", where, minimum=1),
            min_ratio=_real(p, "cos_min_ratio", where, 0.0001),
            warmup_start_ratio=_real(p, "warmup_min_ratio", where, 0.0),
        )
    else:
        _refuse_unknown(
            p, {"warmup_num_steps", "warmup_type", "warmup_min_lr", "warmup_max_lr"}, where
        )
        out["lr_schedule"] = ScheduleConfig(
            warmup_steps=steps, warmup_start_ratio=_warmup_start_ratio(ds, p, where)
        )


def _warmup_start_ratio(ds: dict[str, Any], p: dict[str, Any], where: str) -> float:
    """WarmupLR climbs from ``warmup_min_lr`` (DeepSpeed's default 0) to
    ``warmup_max_lr`` (its default since 0.17.2: the optimizer's lr). Here the peak is
    the optimizer's lr: another ``warmup_max_lr`` is refused, and the start is that
    rate's share of it."""
    low = _real(p, "warmup_min_lr", where, 0.0)
    high = _real(p, "warmup_max_lr", where)
    if low == 0.0 and high is None:
        return 0.0
    opt = ds.get("optimizer")
    params = opt.get("params") if isinstance(opt, dict) else None
    lr = _real(params, "lr", "optimizer.params.") if isinstance(params, dict) else None
    if lr is None or lr == 0:
        raise ConfigError(
            f"{where}warmup_min_lr, warmup_max_lr: relative to the optimizer's lr here; give "
            "optimizer.params.lr"
        )
    if high is not None and high != lr:
        raise ConfigError(
            f"{where}warmup_max_lr={high!r}: the warm-up climbs to the optimizer's lr ({lr}) "
            "here; set optimizer.params.lr to it"
        )
    if not 0 <= low <= lr:
        raise ConfigError(f"{where}warmup_min_lr={low!r}: must be in [0, the optimizer's lr {lr}]")
    return low / lr


_DEEPSPEED_KEY = {
    "loss_scale.min_scale": "fp16.min_loss_scale",
    "loss_scale.initial_scale": "fp16.initial_scale_power",
    "loss_scale.growth_interval": "fp16.loss_scale_window",
    "loss_scale.hysteresis": "fp16.hysteresis",
    "bucket_elements": "zero_optimization.reduce_bucket_size",
    "stage3_prefetch_elements": "zero_optimization.stage3_max_live_parameters",
    "stage3_persistence_elements": "zero_optimization.stage3_param_persistence_threshold",
    "lr_schedule.min_ratio": "scheduler.params.cos_min_ratio",
    "lr_schedule.warmup_start_ratio": "scheduler.params.warmup_min_ratio",
    "lr_schedule.total_steps": "scheduler.params.total_num_steps",
    "lr_schedule.warmup_steps": "scheduler.params.warmup_num_steps",
    "gradient_clipping": "gradient_clipping",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "train_micro_batch_size": "train_micro_batch_size_per_gpu",
}
"""The DeepSpeed key each translated field comes from: a value the engine's config
refuses is named by the key the user wrote."""


def _translate(ds: dict[str, Any], zero: dict[str, Any], world_size: int | None) -> ZeroConfig:
    out: dict[str, Any] = {}
    _zero(zero, out)
    _precision(ds, out)
    _batch(ds, out, world_size)
    clipping = _real(ds, "gradient_clipping", "")
    if clipping is not None:
        out["gradient_clipping"] = clipping
    _scheduler(ds, out)
    _activations(ds, out)
    return ZeroConfig(**out)


def from_deepspeed(ds: dict[str, Any], world_size: int | None = None) -> DeepSpeedSettings:
    """Translate a DeepSpeed config dict; ``world_size`` checks ``train_batch_size``."""
    if not isinstance(ds, dict):
        raise ConfigError(f"DeepSpeed config: expected a dict, got {type(ds).__name__}")
    _refuse_unknown(ds, _TOP | {k for k in WITHOUT_EFFECT if "." not in k}, "")
    zero = _section(ds, "zero_optimization", "")
    without_effect = _without_effect(ds, zero)
    zero = {k: v for k, v in zero.items() if f"zero_optimization.{k}" not in WITHOUT_EFFECT}
    try:
        config = _translate(ds, zero, world_size)
    except ConfigError as exc:  # named by the DeepSpeed key the value came from
        field, sep, why = str(exc).partition(": ")
        key = _DEEPSPEED_KEY.get(field)
        raise ConfigError(f"{key} (as {field}): {why}" if key and sep else str(exc)) from None
    settings = DeepSpeedSettings(config, _optimizer(ds), without_effect)
    if without_effect:
        warnings.warn(
            "DeepSpeed config: accepted without effect here: "
            + "; ".join(f"{k} ({why})" for k, why in without_effect.items()),
            stacklevel=2,
        )
    return settings
