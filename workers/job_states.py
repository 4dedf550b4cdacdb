"""The supervisor's states: one small class per ``JobState``, holding what that state
needs and nothing else (the running state owns its worker group; a failure its
reason). The controller (workers/controller.py) decides what follows each; the graph
of allowed moves is ``workers.state.TRANSITIONS``.

Every state carries the ``reason`` and ``message`` the job's status shows while it
lasts, so that entering a state is also what the control plane reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from .state import JobState

if TYPE_CHECKING:
    from .messages import Succession
    from .worker_group import WorkerGroup


@dataclass(kw_only=True)
class State:
    kind: ClassVar[JobState]
    reason: str
    message: str = ""

    @property
    def is_terminal(self) -> bool:
        return self.kind.is_terminal


@dataclass(kw_only=True)
class Queued(State):
    """The supervisor exists and has not begun."""

    kind: ClassVar[JobState] = JobState.QUEUED
    reason: str = "submitted"


@dataclass(kw_only=True)
class Starting(State):
    """Placing the first group of ranks."""

    kind: ClassVar[JobState] = JobState.STARTING
    reason: str = "placing"


@dataclass(kw_only=True)
class Resizing(State):
    """Placing a new group after a restart (a lost or stalled rank, a failed start,
    a lost supervisor) or to grow: the ranks load the newest checkpoint."""

    kind: ClassVar[JobState] = JobState.RESIZING
    adopt: bool = False
    """First look for the ranks a lost supervisor left running."""


@dataclass(kw_only=True)
class Regrouping(State):
    """Re-forming the running group at another size without restarting its ranks (see
    [Note: live resize] in workers/controller.py): without the ``lost`` ranks, or with
    ``grow`` more ranks."""

    kind: ClassVar[JobState] = JobState.RESIZING
    group: WorkerGroup = field(repr=False)
    lost: list[int] = field(default_factory=list)
    grow: int = 0
    step: int = 0
    """The ranks' step when growing (a shrink restores to the step the peers hold)."""


@dataclass(kw_only=True)
class Running(State):
    """A group trains; each step of the controller is one chunk of steps up to the
    next checkpoint boundary, then a save."""

    kind: ClassVar[JobState] = JobState.RUNNING
    group: WorkerGroup = field(repr=False)
    step: int
    """The ranks' step (the job's status shows the newest checkpointed one)."""
    reason: str = "training"
    failed_saves: int = 0
    """Saves that failed in a row (a full disk): the ranks hold steps no checkpoint has."""
    save_first: bool = False
    """The ranks stand at a checkpoint boundary not saved yet (adopted from a lost
    supervisor between its train and its save)."""


@dataclass(kw_only=True)
class Succeeded(State):
    kind: ClassVar[JobState] = JobState.SUCCEEDED
    reason: str = "completed"


@dataclass(kw_only=True)
class Failed(State):
    kind: ClassVar[JobState] = JobState.FAILED


@dataclass(kw_only=True)
class Cancelled(State):
    kind: ClassVar[JobState] = JobState.CANCELLED
    reason: str = "cancelled"


def replacing_supervisor(succession: Succession) -> Resizing:
    """Where a supervisor that replaces a lost one begins (see [Note: supervised
    supervisor] in api/scheduler.py): it adopts the ranks still running, or places a
    group that loads the newest sound checkpoint."""
    return Resizing(
        reason="supervisor_lost",
        message=f"a new supervisor (restart {succession.restarts}) goes on with the running ranks "
        "or from the newest checkpoint",
        adopt=True,
    )
