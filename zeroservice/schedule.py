"""Learning-rate schedules as a pure function of the optimizer step."""

from __future__ import annotations

import math

from .config import ScheduleConfig


def lr_factor(cfg: ScheduleConfig, step: int) -> float:
    """Multiplier of the base learning rate for optimizer step ``step`` (0-based)."""
    if step < cfg.warmup_steps:
        frac = (step + 1) / cfg.warmup_steps
        return cfg.warmup_start_ratio + (1.0 - cfg.warmup_start_ratio) * frac
    if cfg.kind == "constant" or cfg.total_steps is None:
        return 1.0
    span = cfg.total_steps - cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    decay = cosine if cfg.kind == "cosine" else 1.0 - progress
    return cfg.min_ratio + (1.0 - cfg.min_ratio) * decay
