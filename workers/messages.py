"""Typed messages between the ranks, the supervisor and the control plane.

Ray pickles dataclasses as they are, so ranks answer the supervisor with these
objects; what crosses to the control plane (and into its store as JSON) is
``as_dict()`` of them, the same keys as before these types existed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class RankProgress:
    """A rank's answer to the watchdog's poll (see [Note: watchdog])."""

    step: int
    """Optimizer steps done."""
    phase: str
    """What the rank is doing: created, bootstrap, ready, forward m, backward m, step,
    checkpoint, idle."""
    collectives: int
    """Collectives launched so far (engine and tensor-parallel groups)."""
    last_collective: str = ""
    """The last one, ``op/tag``."""
    saved_step: int = -1
    """The step of the rank's newest checkpoint save (-1: none since it started)."""

    @property
    def key(self) -> tuple[int, str, int]:
        """What must change for the rank to count as making progress."""
        return (self.step, self.phase, self.collectives)


@dataclass(frozen=True)
class RankChunk:
    """A rank's report after a chunk of optimizer steps."""

    rank: int
    step: int
    losses: dict[int, float]
    """Per step: the mean loss of this rank's micro-batches."""
    stats: dict[str, Any] = field(default_factory=dict)
    """The ledger, the communication volume per step, tokens/s."""
    steps: list[dict[str, Any]] = field(default_factory=list)
    """Each step's report: loss, grad_norm, loss_scale, lr, seconds, tokens, peak_bytes
    (workers/history.py makes the job's points of them)."""


@dataclass(frozen=True)
class RankSetup:
    """What a rank reports once it joined the group and built its engine."""

    rank: int
    dp_rank: int
    mp_rank: int
    start_step: int
    """The step it resumes from (0 without a checkpoint)."""
    loaded: str | None
    """The checkpoint it loaded, if any."""
    metrics: str = ""
    """``host:port`` of its Prometheus endpoint."""
    psi: int = 0
    unreported: RankChunk | None = None
    """After a live shrink: the steps up to the restored one that the rank trained in a
    chunk its caller never received (their values are over every replica, see
    ``RankWorker._agree_loss``), so that no step is missing from the history."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """The job's history points the loaded checkpoint carries (in its client state):
    every point the control plane had not stored when it was saved. A supervisor that
    died before the control plane read them has them back this way."""
    fallback: str = ""
    """Set by a live resize that could not restore from the peers' memory: why, and so
    ``loaded`` is the checkpoint it loaded instead."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds of the setup or re-forming by phase, in order (settle, snapshot, leave,
    rendezvous, build, load or restore, ready): where a resize's time went. ``settle``:
    a survivor's, from the interrupt until its re-forming began (its call in flight, a
    step or a save, ending; then the supervisor's calls)."""


@dataclass(frozen=True)
class RankSaved:
    """A rank's answer to a save: the committed directory, or why the save failed
    (every rank of a data-parallel group reports the same failure)."""

    path: str | None
    error: str = ""


@dataclass(frozen=True)
class RankIdle:
    """A rank with no call in flight, as a new supervisor finds it (see [Note:
    supervised supervisor] in api/scheduler.py)."""

    progress: RankProgress
    setup: RankSetup
    since_save: RankChunk
    """Its step reports since its last save, as one chunk: the lost supervisor may not
    have handed them on (nor even received the last chunk's)."""
    saved_history: list[dict[str, Any]] = field(default_factory=list)
    """The history points its last save carried (or the checkpoint it loaded): those
    the control plane had not stored by then, which the lost supervisor may have held
    unread when it was lost."""
    failed: str = ""
    """How its last call ended when it raised (say a collective its peers never joined,
    when the lost supervisor's call reached only some ranks): its group is broken, and
    a new supervisor must not go on with it."""
    newest_checkpoint: tuple[int, str] | None = None
    """(step, directory) of the newest checkpoint it saved or loaded: one its lost
    supervisor never reported (lost with it) is reported by the new one."""


@dataclass(frozen=True)
class Succession:
    """What the control plane hands a supervisor that replaces a lost one (see [Note:
    supervised supervisor] in api/scheduler.py)."""

    restarts: int
    """The job's restarts so far, this one included."""
    reported_save: int = 0
    """The step of the newest ``checkpoint/saved`` event the control plane stored (0:
    none). A newer checkpoint the new supervisor finds (saved by the ranks it adopts,
    or the one it loads) was committed while its predecessor's event was lost with it,
    and the new supervisor reports it."""


@dataclass(frozen=True)
class JobStatus:
    """The supervisor's view of its job, as the control plane stores it."""

    job_id: str
    status: str
    reason: str
    message: str
    dp: int
    mp: int
    workers: int
    step: int
    steps: int
    restarts: int
    events: int
    started_at: str | None
    finished_at: str | None
    checkpoint_root: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class JobSnapshot:
    """Everything the control plane syncs in one poll: what is new since the positions
    it has seen."""

    status: JobStatus
    events: list[dict[str, Any]]
    logs: list[str]
    metrics: dict[str, Any]
    history: list[dict[str, Any]]
    history_total: int
    """The next history position."""
    targets: list[dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["status"] = self.status.as_dict()
        return out
