"""A job's states and the transitions between them: one definition for the Ray side
(the supervisor's state machine moves along them) and the control plane (which stores
and serves them).

``queued`` → ``starting`` → ``running`` (↔ ``resizing`` on a restart or a resize) →
``succeeded`` | ``failed`` | ``cancelled``. ``TRANSITIONS`` is the whole graph: the
supervisor refuses any move it does not list, so a new state (an in-place shrink or
grow) is one enum member and one row here.
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
    """Changing the number of replicas: the running ranks re-form their group from
    host memory (a live resize), or a new group restarts from the newest checkpoint."""
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        """The job is over: no state follows, it holds no resources."""
        return not TRANSITIONS[self]

    @property
    def is_active(self) -> bool:
        """Admitted and not over: the job holds (or is taking) cluster resources."""
        return self in (JobState.STARTING, JobState.RUNNING, JobState.RESIZING)

    def can_become(self, other: JobState) -> bool:
        return other in TRANSITIONS[self]


_ENDS = frozenset({JobState.FAILED, JobState.CANCELLED})
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.STARTING}) | _ENDS,
    JobState.STARTING: frozenset({JobState.RUNNING, JobState.RESIZING}) | _ENDS,
    JobState.RUNNING: frozenset({JobState.RUNNING, JobState.RESIZING, JobState.SUCCEEDED}) | _ENDS,
    JobState.RESIZING: frozenset({JobState.RUNNING, JobState.RESIZING}) | _ENDS,
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}
"""Which states may follow each one (a state may follow itself: a running job's next
chunk of steps, a second restart in a row). Terminal states have no successor."""


class IllegalTransition(RuntimeError):
    """A move the graph does not allow: a bug in the state machine, never a job failure."""


def check_transition(before: JobState, after: JobState) -> None:
    if not before.can_become(after):
        raise IllegalTransition(f"a job cannot go from {before} to {after}")


TERMINAL: tuple[str, ...] = tuple(s.value for s in JobState if s.is_terminal)
ACTIVE: tuple[str, ...] = tuple(s.value for s in JobState if s.is_active)
