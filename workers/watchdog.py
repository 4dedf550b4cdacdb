"""Hang diagnosis: which rank stalled, and which collective each rank was in.

[Note: watchdog]
Every rank counts the collectives it has launched (engine and tensor-parallel groups)
and remembers the last one. The supervisor polls each rank's progress (a threaded
actor answers while training runs) and notes when it last changed. When a rank has
not changed for the step timeout, the job is stalled and the snapshots say why:

* a rank that does not answer at all is frozen (stopped, swapped out, wedged in C);
* a rank that launched fewer collectives than the others is stuck outside them (the
  others wait for it inside their next one);
* ranks that launched the same number but whose last collectives differ have
  diverged (their code took different paths: gathers that no longer match).

Collective counts are comparable within a group of ranks running the same schedule,
which is every rank of one job.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .messages import RankProgress


@dataclass
class Stall:
    stalled: list[int]
    """Ranks named as the cause."""
    message: str


def _where(rank: int, p: RankProgress | None, seen: RankProgress | None) -> str:
    if p is None:
        if seen is None:
            return f"rank {rank}: not responding, never reported"
        return (
            f"rank {rank}: not responding; last seen in collective #{seen.collectives} "
            f"{seen.last_collective or '-'} at step {seen.step}"
        )
    return (
        f"rank {rank}: collective #{p.collectives} {p.last_collective or '-'} "
        f"at step {p.step} ({p.phase})"
    )


def diagnose(
    progress: dict[int, RankProgress | None],
    last_seen: dict[int, RankProgress],
    timeout_s: float,
    describe=lambda r: f"rank {r}",
) -> Stall:
    """``progress``: this poll's answer per rank (None: no answer); ``last_seen``: each
    rank's last answer. See [Note: watchdog]."""
    frozen = sorted(r for r, p in progress.items() if p is None)
    answered = {r: p for r, p in progress.items() if p is not None}
    counts = {r: p.collectives for r, p in answered.items()}
    behind: list[int] = []
    diverged: list[int] = []
    if counts:
        top = max(counts.values())
        behind = sorted(r for r, c in counts.items() if c < top)
        at_top = {r: answered[r].last_collective for r, c in counts.items() if c == top}
        common, _ = Counter(at_top.values()).most_common(1)[0]
        diverged = sorted(r for r, op in at_top.items() if op != common)
    if frozen:
        stalled, why = frozen, "not responding (frozen or stopped)"
    elif behind:
        stalled, why = behind, "behind the others (stuck outside the collective they wait in)"
    elif diverged:
        stalled, why = diverged, "in a different collective than the other ranks (diverged)"
    else:
        stalled, why = sorted(progress), "all ranks wait in the same collective"
    names = ", ".join(describe(r) for r in stalled)
    head = f"stalled: {names}: no progress for {timeout_s:g} s, {why}"
    where = "; ".join(_where(r, progress.get(r), last_seen.get(r)) for r in sorted(progress))
    return Stall(stalled, f"{head}. Last collective per rank: {where}")
