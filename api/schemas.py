"""Request and response bodies of the REST API (the job spec itself is workers.spec)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from workers.spec import JobSpec
from workers.state import JobState

STATUSES: tuple[str, ...] = tuple(JobState)


class _Body(BaseModel):
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False, strict=True
    )


class JobSubmit(_Body):
    spec: JobSpec
    """The job (see docs/configuration.md, "Job spec")."""
    submission_id: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[\w.\-:]+$")
    """Chosen by the client: resubmitting the same request under the same id returns the
    first job (idempotent); a different request under it is refused (409)."""
    priority: int | None = Field(None, ge=-100, le=100)
    """Higher is admitted first; equal priorities in order of submission. Absent: 0, or
    the tenant's ceiling where that is below 0 (a default the tenant may not ask for
    would refuse every job submitted without one)."""


class JobOut(BaseModel):
    id: str
    name: str
    tenant: str
    status: JobState
    reason: str
    message: str
    priority: int
    submission_id: str | None
    attempts: int
    """Restarts so far."""
    current_dp: int
    step: int
    steps: int
    checkpoint_path: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    updated_at: datetime
    spec: dict[str, Any] | None = None


class JobList(BaseModel):
    items: list[JobOut]
    total: int
    limit: int
    offset: int
    next_offset: int | None
    """The next page's offset; null on the last page, and when paging by cursor."""
    next_cursor: str | None
    """The next page's cursor (null on the last page): it starts after this page's last
    job, so jobs submitted meanwhile neither repeat nor hide a row."""


class EventOut(BaseModel):
    id: int
    time: datetime
    kind: str
    reason: str
    message: str
    data: dict[str, Any]


class LogLine(BaseModel):
    id: int
    time: datetime
    line: str


class HistoryPoint(BaseModel):
    """The ``steps`` optimizer steps ending at ``step`` (1 at full resolution): means
    of loss, gradient norm, step seconds and tokens/s, the last learning rate and loss
    scale, the largest memory peak. None: not reported (or not finite)."""

    step: int
    steps: int
    loss: float | None
    grad_norm: float | None
    loss_scale: float | None
    lr: float | None
    step_seconds: float | None
    """The slowest rank's seconds per step."""
    tokens_per_second: float | None
    """Tokens of all replicas per second."""
    memory_peak_bytes: int | None
    """The largest memory peak of any rank (device allocator, or process RSS on CPU)."""
    dp: int


class MetricsOut(BaseModel):
    job_id: str
    step: int
    ranks: dict[str, Any]
    """Per rank: memory by kind (ledger), loss, step seconds, TFLOPS, bus bandwidth,
    collectives per step-phase (``phases``)."""
    history: list[HistoryPoint] = []
    """Per-step points after ``history_after``, oldest first (one page)."""
    history_stride: int = 1
    """Steps per point: 1 until the job holds the service's limit of points, then
    2, 4, 8... (older points are merged, see docs/metrics.md)."""
    history_total: int = 0
    """Points the job holds."""
    next_after: int | None = None
    """``history_after`` for the next page; None on the last page."""
    live: bool
    """True when read from the running supervisor, False when the stored last snapshot."""


class ClusterOut(BaseModel):
    total: dict[str, float]
    free: dict[str, float]
    nodes: int
    requested: list[dict[str, float]]
    """Bundles asked of the autoscaler for the queue (empty when it drained)."""


class PlanRequest(_Body):
    spec: JobSpec
    device_memory_gib: float | None = Field(None, gt=0, le=100_000)
    """Memory per rank to check the plan against (default: the service's setting)."""


class TenantCreate(_Body):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
    """Letters, digits, ``_ . -``, not starting with a dot (it names the tenant's
    checkpoint and data directories)."""


class TenantLimits(_Body):
    """What an admin allows a tenant (see docs/operations.md, "Quotas")."""

    max_priority: int = Field(0, ge=-100, le=100)
    """The highest priority its jobs may ask for."""
    max_ranks: int | None = Field(None, ge=1, le=1_000_000)
    """Ranks its active jobs may hold together (None: no limit)."""
    max_gpus: int | None = Field(None, ge=0, le=1_000_000)
    """GPUs its active jobs may hold together (None: no limit)."""
    max_queued_jobs: int | None = Field(None, ge=0, le=1_000_000)
    """Jobs it may have queued (None: the service's default)."""


class TokenCreate(_Body):
    tenant: str = Field(min_length=1, max_length=128)
    admin: bool = False
    name: str = Field("", max_length=128)
    expires_in_days: int | None = Field(None, ge=1, le=3650)
    """Lifetime of the token (default: the service's ZEROSERVICE_TOKEN_TTL_DAYS)."""


class TokenInfo(BaseModel):
    """A token as listed: never the token itself."""

    id: int
    tenant: str
    admin: bool
    name: str
    prefix: str
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None


class TokenOut(TokenInfo):
    token: str
    """Shown once; only its digest is stored."""


class TokenRevoke(_Body):
    prefix: str = Field(min_length=8, max_length=16)
    """The token's first characters, as listed when it was created (``prefix``)."""
