"""What a supervisor remembers of its job and serves to the control plane: status,
events, progress lines, the history of chunks, per-step losses and per-rank stats.
Thread-safe: the controller writes from its thread while the actor's methods read.

Every status change is also an event ``{seq, time (UTC), kind, reason, message, dp,
step, ...}`` and a log line, so the control plane's copy tells the job's story.
"""

from __future__ import annotations

import threading
from datetime import datetime, timezone
from typing import Any

from .messages import JobStatus, RankChunk
from .ring import Ring
from .state import JobState

MAX_EVENTS = 10_000
MAX_LOG_LINES = 10_000
MAX_HISTORY = 10_000
MAX_LOSSES = 10_000
"""What a supervisor keeps in memory (the newest); the control plane keeps its own
copies under its own retention limits (docs/operations.md, "Retention")."""


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JobRecord:
    def __init__(self, job_id: str, mp: int, steps: int, checkpoint_root: str):
        self.job_id, self.mp, self.steps, self.root = job_id, mp, steps, checkpoint_root
        self.lock = threading.RLock()
        self.status, self.reason, self.message = JobState.QUEUED, "submitted", ""
        self.events: Ring[dict[str, Any]] = Ring(MAX_EVENTS)
        self.log: Ring[str] = Ring(MAX_LOG_LINES)
        self.history: Ring[dict[str, Any]] = Ring(MAX_HISTORY)
        """One point per step (workers/history.py, [Note: step history])."""
        self.stored = 0
        """The history position up to which the control plane has stored the points:
        those after it are lost with this supervisor unless a checkpoint carries them
        (see ``unstored``)."""
        self.losses: dict[int, float] = {}
        self.rank_stats: dict[int, dict[str, Any]] = {}
        self.restarts = 0
        self.dp = 0
        self.step = 0
        self.started_at: str | None = None
        self.finished_at: str | None = None

    # -- writing ----------------------------------------------------------------------
    def line(self, text: str) -> None:
        with self.lock:
            self.log.append(f"{now()} {text}")

    def event(self, kind: str, reason: str, message: str, **extra: Any) -> None:
        self.line(f"[{kind}/{reason}] {message}")
        with self.lock:
            self.events.append(
                {
                    "seq": self.events.total,
                    "time": now(),
                    "kind": kind,
                    "reason": reason,
                    "message": message,
                    "dp": self.dp,
                    "step": self.step,
                    **extra,
                }
            )

    def set_status(self, status: JobState, reason: str, message: str) -> None:
        """Record the status; an event when it differs from the one before."""
        with self.lock:
            changed = status != self.status
            self.status, self.reason, self.message = status, reason, message
            if status == JobState.RUNNING and self.started_at is None:
                self.started_at = now()
            if status.is_terminal:
                self.finished_at = now()
        if changed:
            self.event("status", reason, f"{status}: {message}", status=status)

    def add_chunk(self, chunks: list[RankChunk], stats: dict[int, dict[str, Any]]) -> None:
        """The ranks' reports after a chunk: losses averaged over the DP replicas (one
        report per MP group: its ranks see the same loss), per-rank stats."""
        per_step: dict[int, list[float]] = {}
        for chunk in chunks:
            if chunk.rank % self.mp == 0:
                for s, loss in chunk.losses.items():
                    per_step.setdefault(int(s), []).append(loss)
        with self.lock:
            for s, values in per_step.items():
                self.losses[s] = sum(values) / len(values)
            for s in sorted(self.losses)[: max(0, len(self.losses) - MAX_LOSSES)]:
                del self.losses[s]
            for chunk in chunks:  # a chunk without stats (steps a lost call trained) keeps them
                self.rank_stats.setdefault(chunk.rank, {}).update(step=chunk.step, **chunk.stats)
            for r, s in stats.items():
                self.rank_stats.setdefault(r, {}).update(s)

    def keep_ranks(self, world: int) -> None:
        """The group has ``world`` ranks now: the stats of ranks beyond it (gone with a
        shrink) are dropped, not served as if they were still training."""
        with self.lock:
            for r in [r for r in self.rank_stats if r >= world]:
                del self.rank_stats[r]

    def add_points(self, points: list[dict[str, Any]]) -> None:
        """The chunk's per-step points (workers/history.py), oldest first."""
        with self.lock:
            for point in points:
                self.history.append(point)

    def mark_stored(self, position: int) -> None:
        """The control plane asks for the history from ``position`` on: it has stored
        every point before it (it advances its position only once they are
        committed)."""
        with self.lock:
            self.stored = max(self.stored, min(position, self.history.total))

    def unstored(self, up_to: int) -> list[dict[str, Any]]:
        """The points of steps up to ``up_to`` that the control plane has not stored,
        oldest first: what a checkpoint at that step carries, so that a supervisor
        lost before they were read does not lose them (see ``RankSetup.history``)."""
        with self.lock:
            return [dict(p) for p in self.history.since(self.stored) if p["step"] <= up_to]

    def loss_at(self, step: int) -> float | None:
        with self.lock:
            return self.losses.get(step)

    # -- reading ----------------------------------------------------------------------
    def snapshot_status(self) -> JobStatus:
        with self.lock:
            return JobStatus(
                job_id=self.job_id,
                status=str(self.status),
                reason=self.reason,
                message=self.message,
                dp=self.dp,
                mp=self.mp,
                workers=self.dp * self.mp,
                step=self.step,
                steps=self.steps,
                restarts=self.restarts,
                events=self.events.total,
                started_at=self.started_at,
                finished_at=self.finished_at,
                checkpoint_root=self.root,
            )

    def events_since(self, since: int) -> list[dict[str, Any]]:
        with self.lock:
            return [dict(e) for e in self.events.since(since)]

    def logs_since(self, since: int) -> list[str]:
        with self.lock:
            return self.log.since(since)

    def history_since(self, since: int) -> tuple[list[dict[str, Any]], int]:
        with self.lock:
            return [dict(h) for h in self.history.since(since)], self.history.total

    def metrics(self) -> dict[str, Any]:
        with self.lock:
            return {str(r): dict(s) for r, s in self.rank_stats.items()}
