"""Training dtypes and fp16's dynamic loss scaling."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .config import ConfigError, LossScaleConfig
from .naming import some_names

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def param_dtype(precision: str) -> torch.dtype:
    return DTYPES[precision]


def check_param_dtypes(module: nn.Module, precision: str) -> None:
    """Refuse parameters the engine would silently cast: every parameter goes into a
    flat buffer of the training dtype, with fp32 masters, so a float64 (or other)
    weight would reach the model's forward as another dtype than the one it was built
    with, and fail there or lose precision without a word. float32 weights, and
    weights already in the training dtype, are what a precision starts from."""
    allowed = (torch.float32, DTYPES[precision])
    odd = [(n, p.dtype) for n, p in module.named_parameters() if p.dtype not in allowed]
    if not odd:
        return
    shown = some_names([f"{n} ({_name(d)})" for n, d in odd])
    train = _name(DTYPES[precision])
    accepted = "float32" if train == "float32" else f"float32 or {train}"
    masters = "" if train == "float32" else " with float32 masters"
    floating = all(d.is_floating_point for _, d in odd)
    fix = (
        "convert the model first (e.g. model.float())"
        if floating
        else "keep integer, boolean or complex tensors as buffers (register_buffer), "
        "not parameters, and convert floating ones first (e.g. model.float())"
    )
    raise ConfigError(
        f"model: parameters {shown} are not {accepted}: precision {precision!r} "
        f"trains every parameter in {train}{masters}; {fix}"
    )


def cast_floating(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``module``'s floating-point tensors (parameters and buffers) to ``dtype``,
    as ``Module.bfloat16()`` and ``.half()`` do; nothing at fp32. ``module.to(dtype)``
    would also cast complex buffers to a real dtype (a rotary embedding's
    ``freqs_cis`` lost its imaginary part) and, at fp32, a float64 buffer to float32:
    DDP, under autocast or not, keeps both as the model built them."""
    if dtype == torch.float32:
        return
    module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def reduce_dtype(precision: str, reduce: str) -> torch.dtype:
    return torch.float32 if reduce == "fp32" else DTYPES[precision]


@dataclass
class DynamicLossScaler:
    """Scale the loss so fp16 gradients do not underflow; back off when they overflow.

    An overflow on any rank is agreed by all ranks before this is called (the engine
    all-reduces the gradient norm, which is non-finite on every rank if any rank
    overflowed), so every rank skips the same steps and keeps the same scale.

    Hysteresis as DeepSpeed's (its default, non-consecutive) and Megatron-LM's scalers
    keep it: ``hysteresis`` overflows back the scale off the first time, and from then
    every overflow backs it off until the scale next grows, which restores the
    allowance (with ``consecutive_hysteresis``, every step without overflow does). An
    overflow that would back off below ``min_scale`` sets ``exhausted``:
    the scale can no longer keep the gradients finite (the engine stops the run).
    """

    config: LossScaleConfig = field(default_factory=LossScaleConfig)
    scale: float = 0.0
    clean_steps: int = 0
    hysteresis_left: int = 0
    skipped_steps: int = 0
    exhausted: bool = False
    """The last overflow came with the scale at ``min_scale`` already."""

    def __post_init__(self) -> None:
        if self.scale == 0.0:
            self.scale = self.config.initial_scale
        self.hysteresis_left = self.config.hysteresis

    def update(self, overflow: bool) -> None:
        cfg = self.config
        self.exhausted = False
        if overflow:
            self.skipped_steps += 1
            self.clean_steps = 0
            self.hysteresis_left = max(self.hysteresis_left - 1, 0)
            if self.hysteresis_left == 0:
                self.exhausted = self.scale <= cfg.min_scale
                self.scale = max(self.scale * cfg.backoff_factor, cfg.min_scale)
            return
        self.clean_steps += 1
        if cfg.consecutive_hysteresis:
            self.hysteresis_left = cfg.hysteresis
        if self.clean_steps % cfg.growth_interval == 0:
            self.scale *= cfg.growth_factor
            self.hysteresis_left = cfg.hysteresis

    def state_dict(self) -> dict[str, float | int]:
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "hysteresis_left": self.hysteresis_left,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.skipped_steps = int(state["skipped_steps"])
