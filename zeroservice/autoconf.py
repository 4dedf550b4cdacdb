"""Automatic configuration: the fastest configuration whose predicted peak fits.

[Note: automatic configuration]
For the reference GPT, a memory budget per rank and a world size, ``auto_configure``
weighs every stage (0-3), every model-parallel degree N_m that divides the world, the
heads and the vocabulary (N_d = world / N_m), activation checkpointing off and on (with
P_a when N_m > 1), optimizer offload off and on, and two bucket sizes (the engine's
default C_B and 2^20 elements, with the stage-3 prefetch budget alike). A configuration
fits when its predicted peak (peak.py) plus ``RUNTIME_RESERVE`` (what a step holds that
the peak model does not count), times ``1 + margin``, is at most the budget: the oracle
(benchmarks/planner_oracle.py) holds every prediction within 10% of the measured peak,
so the default margin of 10% keeps a chosen configuration under the budget when
measured. Among those that fit it takes the least predicted step time; ties go to the
smaller peak. Nothing fits: ``fits`` is False, and the reason names the smallest
requirement against the budget. With ``device="cuda"`` the budget is the GPU's: the
peak is the CUDA allocator's, and what offload moves to the host does not count against
it (see [Note: peak on a GPU] in peak.py).

The step time is a model, not a measurement: the training FLOPs of this rank's share of
the micro-batch (``GPTConfig.flops_per_token``, / N_m; checkpointing adds one forward,
a third of them) at ``flops_per_second``; the bytes each rank sends per step
(``planner.communication_bytes``: data and model parallel) at ``link_bytes_per_second``
plus ``collective_seconds`` per collective (one per unit and pass: 2 passes at stages
0-2, 3 at stage 3, so small buckets cost latency); with offload, the gradient shard
copied to the host and the parameters back, at ``host_bytes_per_second``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .memory import PARAM_BYTES
from .peak import PeakConfig, PeakPrediction, _units, predict_peak

if TYPE_CHECKING:
    from .models.gpt import GPTConfig

SMALL_BUCKET = 2**20
"""The second bucket (and prefetch) size weighed besides the engine's default."""
RUNTIME_RESERVE = 4 * 2**20
"""Bytes per rank a step holds that the peak model does not count: measured, after the
first step, 3.3-4.1 MB above the prediction whatever the configuration (a 0.9 M GPT at
stage 2 and 3, with and without checkpointing, N_m 1 and 2, world 2 and 4). Next to the
oracle's 5-7 M models this is their mean under-prediction; next to a model of 1 M
parameters it is a quarter of the peak, so a choice is held to it as well."""


@dataclass(frozen=True)
class AutoCandidate:
    """One configuration weighed, with its predicted peak and step time."""

    config: PeakConfig
    peak: PeakPrediction
    step_seconds: float

    def engine_config(self) -> dict[str, Any]:
        """The engine's configuration (``ZeroConfig`` fields) for this choice."""
        c = self.config
        out: dict[str, Any] = {"stage": c.stage, "precision": c.precision}
        if c.bucket_elements is not None:
            out["bucket_elements"] = c.bucket_elements
        if c.prefetch_elements is not None and c.stage == 3:
            out["stage3_prefetch_elements"] = c.prefetch_elements
        if c.activation_checkpointing:
            out["activation_checkpointing"] = True
            out["partition_activations"] = c.partition_activations
        if c.offload_optimizer:
            out["offload_optimizer"] = True
        return out

    def describe(self) -> str:
        c = self.config
        ckpt = "on" if c.activation_checkpointing else "off"
        bucket = "default" if c.bucket_elements is None else f"{c.bucket_elements:,}"
        return (
            f"ZeRO stage {c.stage}, N_d = {c.dp}, N_m = {c.mp}, activation checkpointing "
            f"{ckpt}, optimizer offload {'on' if c.offload_optimizer else 'off'}, "
            f"buckets {bucket}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine_config(),
            "dp": self.config.dp,
            "mp": self.config.mp,
            "peak_bytes": self.peak.peak,
            "peak_phase": self.peak.phase,
            "step_seconds": self.step_seconds,
            "description": self.describe(),
        }


@dataclass(frozen=True)
class AutoChoice:
    """The chosen configuration, or why none fits (``fits`` False, ``choice`` None)."""

    fits: bool
    choice: AutoCandidate | None
    smallest: AutoCandidate
    """The candidate with the least predicted peak, fitting or not."""
    budget_bytes: int
    margin: float
    reserve_bytes: int
    candidates: tuple[AutoCandidate, ...]
    reason: str

    def need(self, candidate: AutoCandidate) -> int:
        """What ``candidate`` must have per rank to fit: (predicted peak + the runtime
        reserve) × (1 + margin)."""
        return _need(self.margin, self.reserve_bytes)(candidate)

    def as_dict(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "choice": self.choice.as_dict() if self.choice else None,
            "smallest": self.smallest.as_dict(),
            "budget_bytes": self.budget_bytes,
            "device": self.smallest.config.device,
            "margin": self.margin,
            "reserve_bytes": self.reserve_bytes,
            "considered": len(self.candidates),
            "reason": self.reason,
        }


def auto_configure(
    gpt: GPTConfig,
    *,
    world: int,
    memory_per_rank: int,
    precision: str = "fp32",
    micro_batch: int = 1,
    seq_len: int | None = None,
    mp: int | None = None,
    max_mp: int | None = None,
    max_dp: int | None = None,
    device: str = "cpu",
    collectives: str = "auto",
    persistence_elements: int | None = None,
    margin: float = 0.10,
    reserve_bytes: int = RUNTIME_RESERVE,
    flops_per_second: float = 5e10,
    link_bytes_per_second: float = 1e9,
    host_bytes_per_second: float = 5e9,
    collective_seconds: float = 1e-4,
) -> AutoChoice:
    """The configuration with the least predicted step time whose predicted peak, with
    ``margin``, fits ``memory_per_rank`` bytes. See [Note: automatic configuration].
    ``mp``: weigh only that N_m (an elastic job's replicas keep their size).
    ``max_mp``, ``max_dp``: weigh only splits within these degrees (a job spec's bounds),
    so the choice is one the caller can run.
    ``device``: "cpu" (the budget is resident host memory) or "cuda" (GPU memory).
    ``collectives`` and ``persistence_elements``: the engine's ``collectives`` and
    ``stage3_persistence_elements``, which auto keeps as the job names them. Every
    argument of the wrong kind or range is a ValueError naming it."""
    from .models.gpt import GPTConfig

    if not isinstance(gpt, GPTConfig):
        raise TypeError(
            f"model: the peak model covers the reference GPT (a GPTConfig), got "
            f"{type(gpt).__name__}; plan other models with planner.plan (model states only)"
        )
    for name, value in (
        ("world", world),
        ("memory_per_rank", memory_per_rank),
        ("micro_batch", micro_batch),
    ):
        _check_int(name, value, 1)
    if seq_len is not None:
        _check_int("seq_len", seq_len, 1)
        if seq_len > gpt.seq_len:
            raise ValueError(f"seq_len: must be in [1, {gpt.seq_len}] (the model's), got {seq_len}")
    _check_int("reserve_bytes", reserve_bytes, 0)
    if persistence_elements is not None:
        _check_int("persistence_elements", persistence_elements, 0)
    for name, rate in (
        ("flops_per_second", flops_per_second),
        ("link_bytes_per_second", link_bytes_per_second),
        ("host_bytes_per_second", host_bytes_per_second),
    ):
        if not _real(rate) or not 0 < rate < float("inf"):
            raise ValueError(f"{name}: must be a positive finite number, got {rate!r}")
    if not _real(collective_seconds) or not 0 <= collective_seconds < float("inf"):
        raise ValueError(
            f"collective_seconds: must be a finite number >= 0, got {collective_seconds!r}"
        )
    for name, bound in (("max_mp", max_mp), ("max_dp", max_dp)):
        if bound is not None:
            _check_int(name, bound, 1)
    if mp is not None:
        _check_int("mp", mp, 1)
        if world % mp or gpt.n_head % mp or gpt.vocab_size % mp:
            raise ValueError(
                f"mp: {mp} must divide the world ({world}), the heads ({gpt.n_head}) and the "
                f"vocabulary ({gpt.vocab_size})"
            )
        if mp > 1 and gpt.vocab_tiles > 1:
            raise ValueError(f"mp: the model's vocab_tiles ({gpt.vocab_tiles}) need N_m = 1")
    if not _real(margin) or not 0 <= margin < 1:
        raise ValueError(f"margin: must be a number in [0, 1), got {margin!r}")
    if precision not in ("fp32", "bf16"):
        raise ValueError(
            f"precision: {precision!r}: auto is modelled for 'fp32' and 'bf16' (fp16's loss "
            "scaling is not); name a stage for fp16"
        )
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: {device!r} is not 'cpu' or 'cuda'")
    if collectives not in ("auto", "native", "ring", "shm"):
        raise ValueError(f"collectives: {collectives!r} is not auto, native, ring or shm")
    rates = (flops_per_second, link_bytes_per_second, host_bytes_per_second, collective_seconds)
    extra = {"collectives": collectives, "persistence_elements": persistence_elements}
    candidates = [
        AutoCandidate(c, predict_peak(c), _step_seconds(c, *rates))
        for c in _configurations(gpt, world, precision, micro_batch, seq_len, device, extra)
        if (mp is None or c.mp == mp)
        and (max_mp is None or c.mp <= max_mp)
        and (max_dp is None or c.dp <= max_dp)
    ]
    if not candidates:
        raise ValueError(
            f"world: no split of {world} ranks into N_d <= {max_dp} and N_m <= {max_mp} "
            f"divides the heads ({gpt.n_head}) and the vocabulary ({gpt.vocab_size})"
        )
    smallest = min(candidates, key=lambda a: (a.peak.peak, a.step_seconds))
    need = _need(margin, reserve_bytes)
    fitting = [a for a in candidates if need(a) <= memory_per_rank]
    budget = _human(memory_per_rank)
    if not fitting:
        reason = (
            f"nothing fits: the smallest predicted peak is {_human(smallest.peak.peak)} "
            f"({smallest.describe()}), {_human(need(smallest))} with the "
            f"{_human(reserve_bytes)} runtime reserve and the {margin:.0%} margin, "
            f"above the {budget} per rank"
        )
        return AutoChoice(
            False, None, smallest, memory_per_rank, margin, reserve_bytes, tuple(candidates), reason
        )
    choice = min(fitting, key=lambda a: (a.step_seconds, a.peak.peak))
    reason = (
        f"{choice.describe()}: predicted peak {_human(choice.peak.peak)} "
        f"({choice.peak.phase}) of {budget} per rank with the {_human(reserve_bytes)} "
        f"runtime reserve and a {margin:.0%} margin, "
        f"predicted step {choice.step_seconds:.3g} s, the fastest of {len(fitting)} "
        f"fitting configurations ({len(candidates)} weighed)"
    )
    return AutoChoice(
        True, choice, smallest, memory_per_rank, margin, reserve_bytes, tuple(candidates), reason
    )


def _need(margin: float, reserve: int):
    return lambda a: int((a.peak.peak + reserve) * (1 + margin))


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: must be an integer >= {minimum}, got {value!r}")


def _real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _configurations(
    gpt: GPTConfig,
    world: int,
    precision: str,
    micro_batch: int,
    seq_len: int | None,
    device: str,
    extra: dict[str, Any],
) -> list[PeakConfig]:
    """Every configuration weighed; N_m divides the world, the heads and the vocabulary
    (so only divisors of their greatest common divisor are tried: a world of 2^62 ranks
    is answered at once), and is 1 where the model's vocabulary is tiled."""
    out = []
    common = 1 if gpt.vocab_tiles > 1 else math.gcd(world, gpt.n_head, gpt.vocab_size)
    for mp in range(1, common + 1):
        if common % mp:
            continue
        for stage in (0, 1, 2, 3):
            for ckpt in (False, True):
                for offload in (False, True):
                    for bucket in (None, SMALL_BUCKET):
                        out.append(
                            PeakConfig(
                                gpt,
                                stage=stage,
                                dp=world // mp,
                                mp=mp,
                                precision=precision,
                                micro_batch=micro_batch,
                                seq_len=seq_len,
                                activation_checkpointing=ckpt,
                                partition_activations=ckpt and mp > 1,
                                offload_optimizer=offload,
                                bucket_elements=bucket,
                                prefetch_elements=bucket,
                                device=device,
                                **extra,
                            )
                        )
    return out


def _step_seconds(
    c: PeakConfig, flops: float, link: float, host: float, per_collective: float
) -> float:
    """The step-time model of [Note: automatic configuration]."""
    from .planner import communication_bytes

    tokens = c.micro_batch * (c.seq_len or c.gpt.seq_len)
    work = c.gpt.flops_per_token() * tokens / c.mp
    if c.activation_checkpointing:
        work *= 4 / 3
    dp_bytes, mp_bytes = communication_bytes(
        c.gpt,
        stage=c.stage,
        dp=c.dp,
        mp=c.mp,
        precision=c.precision,
        activation_checkpointing=c.activation_checkpointing,
        seq_len=c.seq_len,
        micro_batch=c.micro_batch,
    )
    units = _units(c).sizes
    collectives = len(units) * (3 if c.stage == 3 else 2) if c.dp > 1 else 0
    seconds = work / flops + (dp_bytes + mp_bytes) / link + collectives * per_collective
    if c.offload_optimizer:
        shard = sum(units) // (c.dp if c.stage > 0 else 1)
        seconds += (4 + PARAM_BYTES[c.precision]) * shard / host
    return seconds


def _human(n: float) -> str:
    from .planner import human_bytes

    return human_bytes(n)
