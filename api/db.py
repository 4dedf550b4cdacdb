"""The job store: tenants, API tokens (hashed), jobs, their events, log lines and
per-step history.

SQLAlchemy 2 on SQLite (a file under the data directory) or PostgreSQL (by URL). The
schema is created and upgraded by the migrations in api/migrations (Alembic), applied
when the service starts; nothing here calls ``create_all``.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    create_engine,
    event,
    func,
)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator):
    """Timestamps stored and returned in UTC, also on SQLite (which drops the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is not None:
            if value.tzinfo is None:
                raise ValueError("naive datetime: the store keeps UTC timestamps only")
            value = value.astimezone(timezone.utc)
        return value

    def process_result_value(self, value, dialect):
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, datetime: UTCDateTime()}


class Tenant(Base):
    __tablename__ = "tenants"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    max_priority: Mapped[int] = mapped_column(Integer, default=0)
    """The highest priority the tenant's jobs may ask for (set by an admin)."""
    max_ranks: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """Ranks the tenant's active jobs may hold together; None: no limit."""
    max_gpus: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """GPUs the tenant's active jobs may hold together; None: no limit."""
    max_queued_jobs: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """Jobs the tenant may have queued; None: the service's default."""
    __table_args__ = (
        # Names differing only in case would share a directory on a case-insensitive
        # file system (migration 0005).
        Index("uq_tenants_name_folded", func.lower(name), unique=True),
    )


class ApiToken(Base):
    __tablename__ = "api_tokens"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    """SHA-256 of the token: the token itself is shown once and never stored."""
    prefix: Mapped[str] = mapped_column(String(16))
    """The first characters, to tell tokens apart in listings."""
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    name: Mapped[str] = mapped_column(String(128), default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    """None: never (the provisioned and first admin tokens, rotated by the operator)."""


class Lease(Base):
    """A named lease one process holds until ``expires_at`` unless it renews it: the
    scheduler's, so that among several API replicas one schedules at a time."""

    __tablename__ = "leases"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (UniqueConstraint("tenant_id", "submission_id"),)
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    submission_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    request_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)
    """SHA-256 of the submission as parsed (spec and priority): a retry under the same
    submission_id must carry the same request (see api/idempotency.py). None for jobs
    stored before it was kept."""
    name: Mapped[str] = mapped_column(String(128))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    status: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str] = mapped_column(String(64), default="")
    message: Mapped[str] = mapped_column(Text, default="")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    """Restarts so far (worker loss, stalls, failed starts)."""
    current_dp: Mapped[int] = mapped_column(Integer, default=0)
    step: Mapped[int] = mapped_column(Integer, default=0)
    checkpoint_path: Mapped[str] = mapped_column(Text, default="")
    events_seen: Mapped[int] = mapped_column(Integer, default=0)
    """Supervisor events already copied into job_events."""
    logs_seen: Mapped[int] = mapped_column(Integer, default=0)
    """Supervisor log lines already copied into job_logs."""
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    """The latest per-rank stats the supervisor reported."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    version: Mapped[int] = mapped_column(Integer, default=1)
    """Bumped by every write; a write from a stale read fails (StaleDataError)."""

    __mapper_args__ = {"version_id_col": version}


class JobEvent(Base):
    __tablename__ = "job_events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    time: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    kind: Mapped[str] = mapped_column(String(32))
    reason: Mapped[str] = mapped_column(String(64))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class JobLog(Base):
    __tablename__ = "job_logs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    time: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    line: Mapped[str] = mapped_column(Text)


class JobStep(Base):
    """One point of a job's per-step history: the ``steps`` steps ending at ``step``
    (1 at full resolution; more once the history is downsampled). See workers/history.py,
    [Note: step history]."""

    __tablename__ = "job_steps"
    __table_args__ = (Index("ix_job_steps_job_step", "job_id", "step"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    step: Mapped[int] = mapped_column(Integer)
    steps: Mapped[int] = mapped_column(Integer, default=1)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    grad_norm: Mapped[float | None] = mapped_column(Float, nullable=True)
    loss_scale: Mapped[float | None] = mapped_column(Float, nullable=True)
    lr: Mapped[float | None] = mapped_column(Float, nullable=True)
    step_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    tokens_per_second: Mapped[float | None] = mapped_column(Float, nullable=True)
    memory_peak_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    dp: Mapped[int] = mapped_column(Integer, default=0)


CONNECT_TIMEOUT_S = 5
"""A store that does not accept a connection within this is reported unavailable (503)."""
STATEMENT_TIMEOUT_S = 30
"""No statement runs longer (PostgreSQL's statement_timeout; SQLite's lock wait)."""


def make_engine(url: str) -> Engine:
    """The store's engine, with connect and statement timeouts: a store that hangs
    turns into an error the routes answer with 503, never into a hung request."""
    if url.startswith("sqlite"):
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": STATEMENT_TIMEOUT_S}
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(conn, _record) -> None:
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    return create_engine(
        url,
        pool_pre_ping=True,
        pool_timeout=CONNECT_TIMEOUT_S,
        connect_args={
            "connect_timeout": CONNECT_TIMEOUT_S,
            "options": f"-c statement_timeout={STATEMENT_TIMEOUT_S * 1000}",
            # The server's statement timeout never fires for a query it never received:
            # an open connection whose peer stopped answering (a partition, a frozen
            # host) is given up by the client after about the same time.
            "keepalives": 1,
            "keepalives_idle": 5,
            "keepalives_interval": 2,
            "keepalives_count": 3,
            "tcp_user_timeout": STATEMENT_TIMEOUT_S * 1000,
        },
    )


def session_factory(engine: Engine) -> sessionmaker:
    return sessionmaker(engine, expire_on_commit=False)
