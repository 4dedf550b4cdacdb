"""Capacity promised to admitted jobs whose ranks are not placed yet.

[Note: claims of admitted jobs]
Admission asks whether a job's smallest size (``min_dp`` replicas) fits the cluster's
free resources. Ray counts those resources as used only once the job's placement group
is created, and that happens seconds after the launch: the supervisor's actor starts,
then asks for the group. Measured against Ray's free resources alone, one round, and
the ticks after it, admitted every queued job against the same free CPUs; the later
ones started and then waited for room, outside the queue's order and its backfill rule.

So each launched job claims its smallest size's bundles, and ``fits`` takes the claims
from the free resources. A claim ends when the job's placement group is created (then
Ray's own count has it), after ``settle_s`` more for Ray's view of the free resources
to show it, or when the job ends or is reaped. Claims live in the replica that made
them: a replica that takes the scheduler's lease over starts with none, as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass
class _Claim:
    bundles: list[dict[str, float]]
    placed_at: float | None = None
    """When the job's placement group was first seen created (monotonic)."""


class Claims:
    """See [Note: claims of admitted jobs]."""

    def __init__(self, settle_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.settle_s, self.clock = settle_s, clock
        self._claims: dict[str, _Claim] = {}
        self._lock = threading.Lock()

    def claim(self, job_id: str, bundles: list[dict[str, float]]) -> None:
        """The job was launched: hold its smallest size until it is placed."""
        with self._lock:
            self._claims[job_id] = _Claim([dict(b) for b in bundles])

    def release(self, job_id: str) -> None:
        """The job ended or was reaped: it holds nothing any more."""
        with self._lock:
            self._claims.pop(job_id, None)

    @property
    def jobs(self) -> list[str]:
        with self._lock:
            return list(self._claims)

    def unclaimed(self, free: dict[str, float], placed: Iterable[str]) -> dict[str, float]:
        """``free`` less what the claims still hold; ``placed``: the claiming jobs whose
        placement group is created now."""
        now, placed = self.clock(), set(placed)
        out = dict(free)
        with self._lock:
            for job_id, claim in list(self._claims.items()):
                if job_id in placed and claim.placed_at is None:
                    claim.placed_at = now
                if claim.placed_at is not None and now - claim.placed_at >= self.settle_s:
                    del self._claims[job_id]
                    continue
                for b in claim.bundles:
                    for k, v in b.items():
                        out[k] = out.get(k, 0.0) - v
        return out
