"""A job's states, one definition for the Ray side (the supervisor sets them) and the
control plane (which stores and serves them).

``queued`` → ``starting`` → ``running`` (↔ ``resizing`` on a restart or a resize) →
``succeeded`` | ``failed`` | ``cancelled``.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    QUEUED = "queued"
    """Stored, waiting for admission (the control plane only)."""
    STARTING = "starting"
    """Admitted: the supervisor is placing the ranks."""
    RUNNING = "running"
    RESIZING = "resizing"
    """Restarting from the newest checkpoint on another number of replicas."""
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        """The job is over: no state follows, it holds no resources."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)

    @property
    def is_active(self) -> bool:
        """Admitted and not over: the job holds (or is taking) cluster resources."""
        return self in (JobState.STARTING, JobState.RUNNING, JobState.RESIZING)


TERMINAL: tuple[str, ...] = tuple(s.value for s in JobState if s.is_terminal)
ACTIVE: tuple[str, ...] = tuple(s.value for s in JobState if s.is_active)
