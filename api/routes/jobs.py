"""Jobs: submit, list, read, cancel, and a job's events, log lines and metrics. The
routes read the store (and a running job's live stats); every change goes through
api/store.py."""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Response
from sqlalchemy.orm import Session

from workers.spec import JobSpec
from workers.state import ACTIVE, TERMINAL, JobState

from .. import job_cursor, quota, store
from ..auth import Principal
from ..auto_config import configured_event
from ..backend import SupervisorSilent
from ..confine import checkpoint_base
from ..db import Job
from ..deps import CurrentPrincipal, JobId, ServiceDep, SessionDep, job_or_404
from ..errors import Rejected
from ..idempotency import SubmissionIdReused, check_retry, request_digest
from ..responses import AUTHENTICATED, errors
from ..schemas import (
    STATUSES,
    EventOut,
    HistoryPoint,
    JobList,
    JobOut,
    JobSubmit,
    LogLine,
    MetricsOut,
)
from ..service import MAX_ID, Service

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=errors(*AUTHENTICATED))
Cursor = Annotated[int, Query(ge=0, le=MAX_ID)]
MAX_HISTORY_PAGE = 1000
"""Most history points one metrics request returns."""
CANCEL_WAIT_S = 5.0
"""How long a cancel request waits for the supervisor to take it; one that does not is
kept and sent again by the scheduler (see [Note: a cancel is kept] in api/scheduler.py)."""
log = logging.getLogger("zeroservice.api")


def _out(db: Session, job: Job, with_spec: bool = False) -> JobOut:
    names = store.tenant_names(db, {job.tenant_id})
    return store.to_out(job, names.get(job.tenant_id, "?"), with_spec)


@router.post(
    "",
    status_code=201,
    response_model=JobOut,
    responses={
        200: {"model": JobOut, "description": "the job first submitted under this submission_id"},
        **errors(409),
    },
)
def submit(
    body: JobSubmit, service: ServiceDep, db: SessionDep, who: CurrentPrincipal, response: Response
) -> JobOut:
    digest = request_digest(body)
    if body.submission_id is not None:
        # A retry returns the first job before anything is checked again: its own
        # queued job fills the quota it would be measured against.
        found = store.by_submission(db, who.tenant_id, body.submission_id)
        if found is not None:
            return _retried(db, found, digest, response)
    # The checks that cost nothing come first: a model is built (on the cluster) and
    # auto searched only for a job that may be queued; they are made again, the tenant
    # held, on the spec as planned (auto may split its world otherwise).
    _may_queue(db, who, body.spec, body.priority, service, hold=False)
    spec, plan = service.confined_plan(body.spec, who.tenant, None, refuse=True)
    auto = plan.get("auto")
    priority = _may_queue(db, who, spec, body.priority, service, hold=True)
    try:
        created = store.submit(
            db,
            who,
            spec.model_dump(mode="json"),
            spec.name,
            body.submission_id,
            priority,
            checkpoint_base(service.settings, who.tenant),
            spec.checkpoint.dir,
            events=[] if auto is None else [configured_event(auto)],
            request_digest=digest,
        )
    except store.Conflict as exc:
        raise HTTPException(409, str(exc)) from None
    if not created.created:  # the same submission_id stored meanwhile
        return _retried(db, created.job, digest, response)
    return _out(db, created.job, with_spec=True)


def _may_queue(
    db: Session,
    who: Principal,
    spec: JobSpec,
    priority: int | None,
    service: Service,
    hold: bool,
) -> int:
    try:
        return quota.check_submission(db, who, spec, priority, service.settings, hold=hold)
    except quota.OverLimit as over:
        raise Rejected(over.status, str(over)) from None


def _retried(db: Session, job: Job, digest: str, response: Response) -> JobOut:
    """The answer to a retry: the first job (200), or 409 where the request differs."""
    try:
        check_retry(job, digest)
    except SubmissionIdReused as exc:
        raise HTTPException(409, str(exc)) from None
    response.status_code = 200
    return _out(db, job, with_spec=True)


@router.get("", response_model=JobList)
def list_jobs(
    db: SessionDep,
    who: CurrentPrincipal,
    status: Annotated[JobState | None, Query(description="one of " + ", ".join(STATUSES))] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
    cursor: Annotated[
        str | None,
        Query(
            max_length=256,
            description="the next_cursor of the page before: the page after the last job "
            "it showed, whatever was submitted since (an offset would repeat rows then)",
        ),
    ] = None,
) -> JobList:
    after = None
    if cursor is not None:
        if offset:
            raise Rejected(422, "cursor and offset: give one (a cursor is a position itself)")
        try:
            after = job_cursor.decode(cursor)
        except job_cursor.BadCursor as exc:
            raise Rejected(422, str(exc)) from None
    jobs, total = store.list_jobs(db, who, status, limit, offset, after)
    more = len(jobs) > limit
    jobs = jobs[:limit]
    names = store.tenant_names(db, {j.tenant_id for j in jobs})
    items = [store.to_out(j, names.get(j.tenant_id, "?")) for j in jobs]
    last = job_cursor.Position(jobs[-1].created_at, jobs[-1].id) if more else None
    return JobList(
        items=items,
        total=total,
        limit=limit,
        offset=offset,
        next_offset=offset + len(items) if more and cursor is None else None,
        next_cursor=job_cursor.encode(last) if last is not None else None,
    )


@router.get("/{job_id}", response_model=JobOut, responses=errors(404))
def get_job(job_id: JobId, db: SessionDep, who: CurrentPrincipal) -> JobOut:
    return _out(db, job_or_404(db, who, job_id), with_spec=True)


@router.post("/{job_id}/cancel", response_model=JobOut, responses=errors(404, 409))
def cancel(job_id: JobId, service: ServiceDep, db: SessionDep, who: CurrentPrincipal) -> JobOut:
    """A queued job is cancelled here; a running one is asked to stop, and its status
    comes from its supervisor through the scheduler."""
    job = job_or_404(db, who, job_id)
    if job.status in TERMINAL:
        raise HTTPException(409, f"job {job_id} is already {job.status}")
    by = f"cancelled by {who.tenant}"
    try:
        if job.status == JobState.QUEUED:
            store.cancel_queued(db, job, by)
        else:
            try:
                service.backend.cancel(job.id, by, CANCEL_WAIT_S)
            except SupervisorSilent:  # the scheduler sends it again until the job ends
                log.warning("job %s: the supervisor did not take the cancel yet", job.id)
            store.record_cancel_request(db, job, who.tenant)
    except store.Conflict as exc:
        raise HTTPException(409, str(exc)) from None
    return _out(db, job)


@router.get("/{job_id}/events", response_model=list[EventOut], responses=errors(404))
def events(
    job_id: JobId,
    db: SessionDep,
    who: CurrentPrincipal,
    after: Cursor = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> list[EventOut]:
    job = job_or_404(db, who, job_id)
    return [
        EventOut(id=e.id, time=e.time, kind=e.kind, reason=e.reason, message=e.message, data=e.data)
        for e in store.events(db, job, after, limit)
    ]


@router.get("/{job_id}/logs", response_model=list[LogLine], responses=errors(404))
def logs(
    job_id: JobId,
    db: SessionDep,
    who: CurrentPrincipal,
    after: Cursor = 0,
    limit: Annotated[int, Query(ge=1, le=5000)] = 500,
) -> list[LogLine]:
    job = job_or_404(db, who, job_id)
    return [LogLine(id=x.id, time=x.time, line=x.line) for x in store.logs(db, job, after, limit)]


@router.get("/{job_id}/metrics", response_model=MetricsOut, responses=errors(404))
def job_metrics(
    job_id: JobId,
    service: ServiceDep,
    db: SessionDep,
    who: CurrentPrincipal,
    history_after: Annotated[int, Query(ge=-1, le=MAX_ID)] = -1,
    history_limit: Annotated[int, Query(ge=0, le=MAX_HISTORY_PAGE)] = MAX_HISTORY_PAGE,
) -> MetricsOut:
    """The per-rank stats (live while the job runs) and one page of the per-step
    history: the points after step ``history_after``, oldest first, at most
    ``history_limit``; ``next_after`` continues."""
    job = job_or_404(db, who, job_id)
    live = False
    stored = job.metrics or {}
    ranks = stored.get("ranks", {})
    rows, total, more = store.history(db, job, history_after, history_limit)
    if job.status in ACTIVE:
        snap = service.live_snapshot(job.id)
        if snap is not None and snap.get("metrics"):
            ranks, live = snap["metrics"], True
    points = [HistoryPoint.model_validate(row, from_attributes=True) for row in rows]
    return MetricsOut(
        job_id=job.id,
        step=job.step,
        ranks=ranks,
        history=points,
        history_stride=int(stored.get("history_stride", 1)),
        history_total=total,
        next_after=points[-1].step if more and points else None,
        live=live,
    )
