"""Operations on the job store, each in the caller's session.

Tenancy is enforced here: a tenant's queries only ever see its own rows (an admin
token sees every tenant's), so a route cannot leak another tenant's job by mistake.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.orm.exc import StaleDataError

from workers.history import FIELDS, finite, merge, window
from workers.state import TERMINAL, JobState

from .auth import Principal, hash_token, new_token
from .confine import checkpoint_path
from .db import ApiToken, Job, JobEvent, JobLog, JobStep, Tenant, utcnow
from .schemas import JobOut


class Conflict(Exception):
    """A name that must be unique is taken."""


def _live():
    """Tokens that authenticate now: neither revoked nor expired."""
    return and_(
        ApiToken.revoked_at.is_(None),
        or_(ApiToken.expires_at.is_(None), ApiToken.expires_at > utcnow()),
    )


def authenticate(session: Session, token: str) -> Principal | None:
    row = session.execute(
        select(ApiToken, Tenant)
        .join(Tenant, Tenant.id == ApiToken.tenant_id)
        .where(ApiToken.token_hash == hash_token(token), _live())
    ).first()
    if row is None:
        return None
    tok, tenant = row
    return Principal(tenant.id, tenant.name, tok.admin, tok.id)


def create_tenant(session: Session, name: str) -> Tenant:
    """A new tenant; its name must differ from every other by more than letter case
    (it names a directory: see migration 0005)."""
    tenant = Tenant(name=name)
    session.add(tenant)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        taken = session.execute(
            select(Tenant.name).where(func.lower(Tenant.name) == name.lower())
        ).scalar_one_or_none()
        if taken is None or taken == name:
            raise Conflict(f"tenant {name!r} exists") from None
        raise Conflict(
            f"tenant {name!r}: tenant {taken!r} exists, and names that differ only in "
            "letter case would share a directory"
        ) from None
    return tenant


def set_limits(session: Session, tenant: Tenant, **limits: int | None) -> None:
    """An admin's priority ceiling and quotas for the tenant (see api/quota.py)."""
    for name, value in limits.items():
        setattr(tenant, name, value)
    session.commit()


def tenant_by_name(session: Session, name: str) -> Tenant | None:
    return session.execute(select(Tenant).where(Tenant.name == name)).scalar_one_or_none()


PREFIX_LENGTH = 10
"""How many of a drawn token's first characters the store keeps to list it by."""


def create_token(
    session: Session,
    tenant: Tenant,
    admin: bool,
    name: str = "",
    expires_at: datetime | None = None,
) -> tuple[str, ApiToken]:
    """A new token (returned once) and its stored row (digest only)."""
    token = new_token()
    row = ApiToken(
        tenant_id=tenant.id,
        token_hash=hash_token(token),
        prefix=token[:PREFIX_LENGTH],
        admin=admin,
        name=name,
        expires_at=expires_at,
    )
    session.add(row)
    session.commit()
    return token, row


def list_tokens(session: Session, tenant: str | None) -> list[tuple[ApiToken, str]]:
    """Every token (revoked and expired ones too) with its tenant's name, oldest first."""
    query = select(ApiToken, Tenant.name).join(Tenant, Tenant.id == ApiToken.tenant_id)
    if tenant is not None:
        query = query.where(Tenant.name == tenant)
    return list(session.execute(query.order_by(ApiToken.id)).tuples())


def bootstrap_admin(session: Session, provisioned: str | None = None) -> str | None:
    """The ``admin`` tenant's token. A provisioned token (from a secret) is made to
    exist and None returned; otherwise, at first start only (no token at all), a new
    token is created and returned once."""
    if provisioned is not None:
        if len(provisioned) < 20:
            raise ValueError("ZEROSERVICE_ADMIN_TOKEN: use at least 20 random characters")
        digest = hash_token(provisioned)
        label = provisioned_prefix(digest)
        row = session.execute(select(ApiToken).where(ApiToken.token_hash == digest)).scalar()
        if row is not None:
            if row.prefix != label:  # stored by an older version: the secret's own start
                row.prefix = label
                session.commit()
            return None
        tenant = tenant_by_name(session, "admin") or create_tenant(session, "admin")
        session.add(
            ApiToken(
                tenant_id=tenant.id,
                token_hash=digest,
                prefix=label,
                admin=True,
                name="provisioned",
            )
        )
        session.commit()
        return None
    if session.execute(select(func.count(ApiToken.id))).scalar_one():
        return None
    tenant = tenant_by_name(session, "admin") or create_tenant(session, "admin")
    return create_token(session, tenant, admin=True, name="bootstrap")[0]


def provisioned_prefix(digest: str) -> str:
    """What a provisioned token is listed by: its digest's start, never the secret's
    (an operator's token is chosen, not drawn: its own first characters would be a
    readable part of it in the store and its backups)."""
    return "sha256:" + digest[:8]


def revoke_token(session: Session, prefix: str, caller: Principal) -> int:
    """Revoke every live token starting with ``prefix`` (literally: ``%`` and ``_`` match
    only themselves); never the caller's own (it would lock the caller out
    mid-rotation): Conflict then. The store keeps a token's first ``PREFIX_LENGTH``
    characters, so a longer prefix (more of the token pasted) matches by those."""
    near = ApiToken.prefix.startswith(prefix[:PREFIX_LENGTH], autoescape=True)
    rows = session.execute(select(ApiToken).where(near, _live())).scalars()
    matching = [r for r in rows if r.prefix.startswith(prefix) or prefix.startswith(r.prefix)]
    return _revoke(session, matching, caller)


def revoke_token_by_id(session: Session, token_id: int, caller: Principal) -> int:
    """Revoke one live token by its id (as listed); 0 when no live token has it (an
    expired one is not: it no longer authenticates)."""
    query = select(ApiToken).where(ApiToken.id == token_id, _live())
    return _revoke(session, list(session.execute(query).scalars()), caller)


def _revoke(session: Session, rows: list[ApiToken], caller: Principal) -> int:
    """Revoke ``rows`` and count the tokens this call revoked: the update names only
    those still live when it runs, so of revocations sent at once one counts each token
    and the others find it revoked already (their count is 0: a 404)."""
    if any(row.id == caller.token_id for row in rows):
        raise Conflict("this is the token making the request; revoke it with another one")
    if not rows:
        return 0
    result = session.execute(  # an UPDATE: its result is a cursor's, with a rowcount
        update(ApiToken)
        .where(ApiToken.id.in_([row.id for row in rows]), _live())
        .values(revoked_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return cast(CursorResult, result).rowcount


@dataclass
class Created:
    job: Job
    created: bool


def _refuse_shared_checkpoints(session: Session, tenant_id: int, path: str) -> None:
    """Conflict when an active job of the tenant writes the same checkpoint directory,
    or one inside or around it: two jobs would save, prune and resume from each other's
    steps. A finished job's directory is free (resuming from it is what naming a
    directory is for). Checkpoint directories lie under the tenant's own base, so other
    tenants' jobs never overlap; the caller holds the tenant (quota.check_submission),
    so submissions sent at once are judged one after the other."""
    active = session.execute(
        select(Job.id, Job.status, Job.checkpoint_path).where(
            Job.tenant_id == tenant_id, Job.status.not_in(list(TERMINAL))
        )
    )
    for other, status, theirs in active:
        if _nested(path, theirs):
            raise Conflict(
                f"checkpoint.dir: {path} is in use by job {other} ({status}), which "
                f"writes {theirs}; name another directory, or submit once that job ends"
            )


def _nested(a: str, b: str) -> bool:
    """Whether one of two checkpoint locations (paths or s3 URIs) lies in the other.
    Directories are compared case-folded, as tenant names are: on a file system that
    ignores case (or a share mounted from one) ``run1`` and ``RUN1`` are one directory.
    Object keys are case-sensitive everywhere and compared as they are."""

    def parts(x: str) -> tuple[str, ...]:
        return tuple(p if x.startswith("s3://") else p.casefold() for p in x.split("/") if p)

    pa, pb = parts(a), parts(b)
    return pa[: len(pb)] == pb or pb[: len(pa)] == pa


def submit(
    session: Session,
    who: Principal,
    spec: dict[str, Any],
    name: str,
    submission_id: str | None,
    priority: int,
    checkpoint_base: str,
    checkpoint_sub: str | None = None,
    events: list[dict[str, Any]] | None = None,
    request_digest: str | None = None,
) -> Created:
    """Store a queued job, its checkpoints placed under ``checkpoint_base`` (see
    api/confine.py), with ``events`` (kind, reason, message, data) after "submitted";
    with a submission id already used by this tenant, the existing job instead (the
    unique constraint decides under concurrency; the caller compares its
    ``request_digest``, see api/idempotency.py)."""
    if submission_id is not None:
        found = by_submission(session, who.tenant_id, submission_id)
        if found is not None:
            return Created(found, False)
    now = utcnow()
    job_id = str(uuid.uuid4())
    path = checkpoint_path(checkpoint_base, job_id, checkpoint_sub)
    _refuse_shared_checkpoints(session, who.tenant_id, path)
    job = Job(
        id=job_id,
        tenant_id=who.tenant_id,
        submission_id=submission_id,
        request_digest=request_digest,
        name=name,
        spec=spec,
        priority=priority,
        status=JobState.QUEUED,
        reason="submitted",
        message="waiting for capacity",
        attempts=0,
        current_dp=0,
        step=0,
        checkpoint_path=path,
        events_seen=0,
        logs_seen=0,
        metrics={},
        created_at=now,
        updated_at=now,
    )
    session.add(job)
    session.add(
        JobEvent(
            job_id=job.id, time=now, kind="status", reason="submitted", message="queued", data={}
        )
    )
    for event in events or []:
        session.add(JobEvent(job_id=job.id, time=now, **event))
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        if submission_id is None:
            raise
        found = by_submission(session, who.tenant_id, submission_id)
        if found is None:
            raise
        return Created(found, False)
    return Created(job, True)


def by_submission(session: Session, tenant_id: int, submission_id: str) -> Job | None:
    return session.execute(
        select(Job).where(Job.tenant_id == tenant_id, Job.submission_id == submission_id)
    ).scalar_one_or_none()


def _visible(who: Principal):
    query = select(Job)
    return query if who.admin else query.where(Job.tenant_id == who.tenant_id)


def get_job(session: Session, who: Principal, job_id: str) -> Job | None:
    return session.execute(_visible(who).where(Job.id == job_id)).scalar_one_or_none()


def list_jobs(
    session: Session,
    who: Principal,
    status: str | None,
    limit: int,
    offset: int,
    after: tuple[datetime, str] | None = None,
) -> tuple[list[Job], int]:
    """Up to ``limit`` + 1 jobs, newest first (the one more says another page follows),
    from ``offset`` or after the job at ``after`` (creation time, id: see
    api/job_cursor.py); and how many match in all."""
    query = _visible(who)
    if status is not None:
        query = query.where(Job.status == status)
    total = session.execute(select(func.count()).select_from(query.subquery())).scalar_one()
    if after is not None:
        created_at, job_id = after
        query = query.where(
            or_(Job.created_at < created_at, and_(Job.created_at == created_at, Job.id > job_id))
        )
    rows = session.execute(
        query.order_by(Job.created_at.desc(), Job.id).limit(limit + 1).offset(offset)
    ).scalars()
    return list(rows), int(total)


def tenant_names(session: Session, ids: set[int]) -> dict[int, str]:
    rows = session.execute(select(Tenant.id, Tenant.name).where(Tenant.id.in_(ids)))
    return dict(rows.tuples().all())


def to_out(job: Job, tenant: str, with_spec: bool = False) -> JobOut:
    return JobOut(
        id=job.id,
        name=job.name,
        tenant=tenant,
        status=job.status,  # type: ignore[arg-type]
        reason=job.reason,
        message=job.message,
        priority=job.priority,
        submission_id=job.submission_id,
        attempts=job.attempts,
        current_dp=job.current_dp,
        step=job.step,
        steps=int(job.spec.get("steps", 0)),
        checkpoint_path=job.checkpoint_path,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        updated_at=job.updated_at,
        spec=job.spec if with_spec else None,
    )


def add_event(
    session: Session, job: Job, kind: str, reason: str, message: str, data: dict | None = None
) -> None:
    session.add(
        JobEvent(
            job_id=job.id, time=utcnow(), kind=kind, reason=reason, message=message, data=data or {}
        )
    )


def set_status(
    session: Session, job: Job, status: str, reason: str, message: str, record: bool = True
) -> None:
    """Change a job's status; ``record``: also as an event (statuses synced from the
    supervisor come with its own events)."""
    if job.status == status and job.reason == reason and job.message == message:
        return
    now = utcnow()
    job.status, job.reason, job.message, job.updated_at = status, reason, message, now
    if status == JobState.RUNNING and job.started_at is None:
        job.started_at = now
    if status in TERMINAL and job.finished_at is None:
        job.finished_at = now
    if record:
        add_event(session, job, "status", reason, f"{status}: {message}", {"status": status})


def cancel_queued(session: Session, job: Job, message: str) -> None:
    """Cancel a job still queued; Conflict when admission changed it meanwhile (the
    write is checked against the version read)."""
    set_status(session, job, JobState.CANCELLED, "cancelled", message)
    try:
        session.commit()
    except StaleDataError:
        session.rollback()
        raise Conflict(f"job {job.id} changed meanwhile; retry") from None


def record_cancel_request(session: Session, job: Job, tenant: str) -> None:
    """A running job was asked to stop; its status follows from its supervisor. The
    request is kept: the scheduler honours it until the job ends (see [Note: a
    cancel is kept])."""
    by = f"cancelled by {tenant}"
    add_event(session, job, "request", "cancel", f"cancel requested by {tenant}", {"by": by})
    session.commit()


def cancel_request(session: Session, job: Job) -> str | None:
    """The status message of the newest cancel request recorded for ``job``, or None."""
    event = session.execute(
        select(JobEvent)
        .where(JobEvent.job_id == job.id, JobEvent.kind == "request", JobEvent.reason == "cancel")
        .order_by(JobEvent.id.desc())
        .limit(1)
    ).scalar_one_or_none()
    if event is None:
        return None
    return str((event.data or {}).get("by", "cancelled by request"))


def _after(session: Session, table, job: Job, after: int, limit: int) -> list:
    """Rows of ``table`` (events, log lines) of ``job`` with ids above ``after``, in order."""
    query = select(table).where(table.job_id == job.id, table.id > after)
    return list(session.execute(query.order_by(table.id).limit(limit)).scalars())


def events(session: Session, job: Job, after: int, limit: int) -> list[JobEvent]:
    return _after(session, JobEvent, job, after, limit)


def logs(session: Session, job: Job, after: int, limit: int) -> list[JobLog]:
    return _after(session, JobLog, job, after, limit)


def add_events(session: Session, job: Job, events: list[dict], keep: int) -> None:
    """Store the supervisor's new events (its own fields as ``data``), keeping the
    newest ``keep`` of the job."""
    for event in events:
        data = {k: v for k, v in event.items() if k not in ("kind", "reason", "message")}
        add_event(session, job, event["kind"], event["reason"], event["message"], data)
    job.events_seen += len(events)
    if events:  # a cancel request stays: it is honoured until the job ends (a cancel is kept)
        cancel = (JobEvent.kind == "request") & (JobEvent.reason == "cancel")
        _prune(session, JobEvent, job, keep, spare=cancel)


def newest_save(session: Session, job: Job) -> int:
    """The step of the job's newest stored ``checkpoint/saved`` event (0: none, or
    pruned): what a supervisor that replaces a lost one is told was reported (see
    ``workers.messages.Succession``)."""
    row = session.execute(
        select(JobEvent)
        .where(
            JobEvent.job_id == job.id,
            JobEvent.kind == "checkpoint",
            JobEvent.reason == "saved",
        )
        .order_by(JobEvent.id.desc())
        .limit(1)
    ).scalar_one_or_none()
    step = (row.data or {}).get("step") if row is not None else None
    return step if isinstance(step, int) and step > 0 else 0


def add_log_lines(session: Session, job: Job, lines: list[str], keep: int) -> None:
    """Store new log lines, keeping the newest ``keep`` of the job."""
    now = utcnow()
    session.add_all(JobLog(job_id=job.id, time=now, line=line) for line in lines)
    job.logs_seen += len(lines)
    if lines:
        _prune(session, JobLog, job, keep)


def add_metrics(
    session: Session,
    job: Job,
    ranks: dict[str, Any],
    points: list[dict],
    history_seen: int,
    keep: int,
) -> None:
    """The newest per-rank stats, and the history extended by the supervisor's new
    points (see ``add_steps``); ``history_seen``: the supervisor's next position."""
    stored = job.metrics or {}
    stride = add_steps(session, job, points, int(stored.get("history_stride", 1)), keep)
    job.metrics = {
        "ranks": ranks or stored.get("ranks", {}),
        "history_seen": history_seen,
        "history_stride": stride,
    }


def add_steps(session: Session, job: Job, points: list[dict], stride: int, keep: int) -> int:
    """Add per-step points (oldest first) to the job's history at resolution
    ``stride``, doubling it (and merging each window's points) whenever the job would
    hold more than ``keep``; returns the stride. A step already recorded (redone after
    a restart) keeps its first report. See workers/history.py, [Note: step history]."""
    if not points:
        return stride
    keep = max(2, keep)  # one point per window: at least two windows
    last = _last_step(session, job)
    count = _count_steps(session, job)
    for point in sorted(points, key=lambda p: p["step"]):
        if last is not None and point["step"] <= last.step:
            continue
        if last is not None and window(last.step, stride) == window(point["step"], stride):
            _assign(last, merge(_as_point(last), point))
            continue
        last = JobStep(job_id=job.id, **_columns(point))
        session.add(last)
        count += 1
        while count > keep:
            stride *= 2
            count = _downsample(session, job, stride)
            last = _last_step(session, job)
    return stride


def _downsample(session: Session, job: Job, stride: int) -> int:
    """Merge the job's points window by window (``stride`` steps); returns how many
    are left."""
    session.flush()
    rows = list(
        session.execute(
            select(JobStep).where(JobStep.job_id == job.id).order_by(JobStep.step)
        ).scalars()
    )
    kept: list[JobStep] = []
    for row in rows:
        if kept and window(kept[-1].step, stride) == window(row.step, stride):
            merged = merge(_as_point(kept[-1]), _as_point(row))
            _assign(row, merged)
            session.delete(kept[-1])
            kept[-1] = row
        else:
            kept.append(row)
    session.flush()
    return len(kept)


def _last_step(session: Session, job: Job) -> JobStep | None:
    query = select(JobStep).where(JobStep.job_id == job.id).order_by(JobStep.step.desc())
    return session.execute(query.limit(1)).scalar_one_or_none()


def _count_steps(session: Session, job: Job) -> int:
    query = select(func.count(JobStep.id)).where(JobStep.job_id == job.id)
    return int(session.execute(query).scalar_one())


_POINT = ("step", "steps", *FIELDS, "dp")


def _columns(point: dict) -> dict[str, Any]:
    out = {key: point.get(key) for key in _POINT}
    out["steps"] = int(out["steps"] or 1)
    out["dp"] = int(out["dp"] or 0)
    for key in FIELDS:
        out[key] = finite(out[key])
    if out["memory_peak_bytes"] is not None:
        out["memory_peak_bytes"] = int(out["memory_peak_bytes"])
    return out


def _as_point(row: JobStep) -> dict[str, Any]:
    return {key: getattr(row, key) for key in _POINT}


def _assign(row: JobStep, point: dict) -> None:
    for key, value in _columns(point).items():
        setattr(row, key, value)


def history(session: Session, job: Job, after: int, limit: int) -> tuple[list[JobStep], int, bool]:
    """The job's points after step ``after``, oldest first, at most ``limit``; the
    number of points the job holds; whether more follow this page."""
    query = (
        select(JobStep)
        .where(JobStep.job_id == job.id, JobStep.step > after)
        .order_by(JobStep.step)
        .limit(limit + 1)
    )
    rows = list(session.execute(query).scalars())
    return rows[:limit], _count_steps(session, job), len(rows) > limit


def _prune(session: Session, table, job: Job, keep: int, spare=None) -> None:
    """Delete the job's rows of ``table`` older than its newest ``keep`` (``spare``: a
    condition on rows never deleted)."""
    session.flush()
    newest = select(table.id).where(table.job_id == job.id).order_by(table.id.desc())
    cutoff = session.execute(newest.offset(keep).limit(1)).scalar_one_or_none()
    if cutoff is not None:
        old = delete(table).where(table.job_id == job.id, table.id <= cutoff)
        session.execute(old if spare is None else old.where(~spare))


def jobs_in(session: Session, statuses: tuple[str, ...]) -> list[Job]:
    return list(
        session.execute(
            select(Job)
            .where(Job.status.in_(statuses))
            .order_by(Job.priority.desc(), Job.created_at, Job.id)
        ).scalars()
    )


def count_by_status(session: Session) -> dict[str, int]:
    rows = session.execute(select(Job.status, func.count()).group_by(Job.status)).tuples()
    return {status: int(n) for status, n in rows}
