"""A job's per-step history: what each rank reports about a step, one point per step
for the job, and how points are merged when the history is downsampled.

[Note: step history]
Every rank returns, per optimizer step, its loss, gradient norm, loss scale, learning
rate, step seconds, tokens and peak memory (``RankWorker.train``). The supervisor turns
the ranks' reports into one *point* per step (``step_points``):

    loss                mean over the data-parallel replicas (MP rank 0 of each)
    grad_norm, lr,
    loss_scale          rank 0's (the same on every rank: a global norm, one schedule)
    step_seconds        the slowest rank's (a step ends when every rank has finished)
    tokens_per_second   tokens of every replica / step_seconds
    memory_peak_bytes   the largest peak of any rank (device allocator, or process RSS)

A point covers ``steps`` consecutive steps ending at ``step``: 1 at full resolution.
The control plane keeps every step up to a limit; past it the *stride* doubles and
the points of each window of ``stride`` steps are merged into one (``merge``: means
weighted by steps, the throughput as all the tokens over all the seconds, the last
schedule values, the largest memory peak), so a job's
history stays between half the limit and the limit, evenly spaced, however long the
job runs. Windows are aligned on absolute step numbers (``window``), so merging never
depends on when points arrived.

Values that are not finite (an fp16 overflow's loss) are stored as None: JSON has no
NaN, and a chart leaves a gap.
"""

from __future__ import annotations

import math
from typing import Any

from .messages import RankChunk

FIELDS = (
    "loss",
    "grad_norm",
    "loss_scale",
    "lr",
    "step_seconds",
    "tokens_per_second",
    "memory_peak_bytes",
)
"""The values of a point besides ``step``, ``steps`` and ``dp``."""
_MEAN = ("loss", "grad_norm", "step_seconds", "tokens_per_second")
_LAST = ("loss_scale", "lr", "dp")


def finite(value: Any) -> float | None:
    """``value`` as a float, or None when missing or not finite."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def window(step: int, stride: int) -> int:
    """The window of ``stride`` steps that ``step`` (counted from 1) falls in."""
    return (step - 1) // stride


def step_points(chunks: list[RankChunk], mp: int, dp: int) -> list[dict[str, Any]]:
    """One point per step from the ranks' chunk reports, oldest first. See [Note: step
    history]."""
    by_step: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for chunk in chunks:
        for report in chunk.steps:
            by_step.setdefault(int(report["step"]), []).append((chunk.rank, report))
    points = []
    for step in sorted(by_step):
        reports = by_step[step]
        first = reports[0][1]
        reported = [finite(r.get("loss")) for rank, r in reports if rank % mp == 0]
        losses = [x for x in reported if x is not None]
        seconds = max(float(r.get("seconds", 0.0)) for _, r in reports)
        tokens = float(first.get("tokens", 0)) * dp
        peaks = [int(r.get("peak_bytes") or 0) for _, r in reports]
        points.append(
            {
                "step": step,
                "steps": 1,
                "loss": sum(losses) / len(losses) if losses else None,
                "grad_norm": finite(first.get("grad_norm")),
                "loss_scale": finite(first.get("loss_scale")),
                "lr": finite(first.get("lr")),
                "step_seconds": finite(seconds) if seconds > 0 else None,
                "tokens_per_second": finite(tokens / seconds) if seconds > 0 else None,
                "memory_peak_bytes": max(peaks) or None,
                "dp": dp,
            }
        )
    return points


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """One point for the steps of ``a`` followed by those of ``b``."""
    na, nb = int(a.get("steps") or 1), int(b.get("steps") or 1)
    out: dict[str, Any] = {"step": max(int(a["step"]), int(b["step"])), "steps": na + nb}
    for key in _MEAN:
        x, y = a.get(key), b.get(key)
        if x is None or y is None:
            out[key] = y if x is None else x
        else:
            out[key] = (x * na + y * nb) / (na + nb)
    rate = _throughput((a, na), (b, nb))
    if rate is not None:  # a mean of rates is not the rate: 1 s and 3 s steps of 1000
        out["tokens_per_second"] = rate  # tokens each ran at 500 tokens/s, not 667
    for key in _LAST:
        out[key] = b.get(key) if b.get(key) is not None else a.get(key)
    peaks = [p for p in (a.get("memory_peak_bytes"), b.get("memory_peak_bytes")) if p]
    out["memory_peak_bytes"] = max(peaks) if peaks else None
    return out


def _throughput(*sides: tuple[dict[str, Any], int]) -> float | None:
    """Tokens per second over the points' steps together, or None where a side lacks
    its rate or its step time."""
    tokens = seconds = 0.0
    for point, steps in sides:
        rate, step_seconds = point.get("tokens_per_second"), point.get("step_seconds")
        if rate is None or not step_seconds:
            return None
        tokens += rate * step_seconds * steps
        seconds += step_seconds * steps
    return tokens / seconds


def downsample(points: list[dict[str, Any]], stride: int) -> list[dict[str, Any]]:
    """``points`` (oldest first) with those of each window of ``stride`` steps merged."""
    out: list[dict[str, Any]] = []
    for point in points:
        if out and window(out[-1]["step"], stride) == window(point["step"], stride):
            out[-1] = merge(out[-1], point)
        else:
            out.append(dict(point))
    return out


class StepHistory:
    """An in-memory bounded history (every step up to ``limit`` points, then
    downsampled): what the control plane keeps per job, without a store."""

    def __init__(self, limit: int):
        if limit < 2:
            raise ValueError(f"limit: must be >= 2, got {limit}")
        self.limit = limit
        self.stride = 1
        self.points: list[dict[str, Any]] = []

    def add(self, point: dict[str, Any]) -> None:
        if self.points and point["step"] <= self.points[-1]["step"]:
            return  # a step redone after a restart: the first report is kept
        if self.points and window(self.points[-1]["step"], self.stride) == window(
            point["step"], self.stride
        ):
            self.points[-1] = merge(self.points[-1], point)
        else:
            self.points.append(dict(point))
        while len(self.points) > self.limit:
            self.stride *= 2
            self.points = downsample(self.points, self.stride)
