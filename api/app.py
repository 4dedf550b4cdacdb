"""The REST control plane (FastAPI): jobs, events, logs, metrics, plans, cluster, tenants.

Every /v1 route needs a bearer token; a tenant sees and cancels only its own jobs
(another tenant's job answers 404, as a job that does not exist); admin tokens see
every tenant's jobs and create tenants and tokens.
"""

import logging
import math
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session
from sqlalchemy.orm.exc import StaleDataError

from workers.model_size import ModelNotBuildable
from workers.spec import JobSpec

from . import errors, quota, store
from .auth import Principal, bearer
from .backend import Backend
from .body_limit import BodyLimit
from .confine import Refused, checkpoint_base, confine
from .db import ApiToken, make_engine, session_factory, utcnow
from .metrics import ApiMetrics
from .migrate import upgrade
from .plan import GIB, PlanRefused, plan_job
from .rate_limit import RateLimiter
from .scheduler import ACTIVE, Scheduler
from .schemas import (
    STATUSES,
    TERMINAL,
    ClusterOut,
    EventOut,
    JobList,
    JobOut,
    JobSubmit,
    LogLine,
    MetricsOut,
    PlanRequest,
    TenantCreate,
    TenantLimits,
    TokenCreate,
    TokenInfo,
    TokenOut,
    TokenRevoke,
)
from .settings import Settings

log = logging.getLogger("zeroservice.api")
API_VERSION = "v1"
MAX_ID = 2**31 - 1
"""The largest row id the store holds (its id columns are 32-bit integers)."""
METRICS_TTL_S = 5.0
"""How long /metrics reuses its reading of the store and the cluster."""
JobId = Annotated[str, PathParam(min_length=1, max_length=64)]


class Service:
    """What the routes share: settings, the store, the backend, the scheduler."""

    def __init__(self, settings: Settings, backend: Backend, start_scheduler: bool = True):
        self.settings, self.backend = settings, backend
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        self.engine = make_engine(settings.database_url)
        upgrade(self.engine)
        self.sessions = session_factory(self.engine)
        self._metrics_read: tuple[float, dict[str, Any]] | None = None
        self.rate = RateLimiter(settings.rate_per_s, settings.rate_burst)
        self.metrics = ApiMetrics(self._live_metrics)
        self.scheduler = Scheduler(self.sessions, backend, settings, self.metrics)
        self.start_scheduler = start_scheduler
        with self.sessions() as session:
            self.bootstrap_token = store.bootstrap_admin(session, settings.admin_token)

    def count_parameters(self, spec: JobSpec) -> int:
        """A non-GPT model's size, measured on a worker within the configured bounds."""
        s = self.settings
        return self.backend.count_parameters(spec, s.plan_timeout_s, int(s.plan_memory_gib * GIB))

    def confined_plan(
        self, spec: JobSpec, tenant: str, device_memory_gib: float | None, refuse: bool
    ) -> tuple[JobSpec, dict[str, Any]]:
        """The spec confined to what the tenant may name, and its memory plan; 422
        naming the field when it names something else or its model cannot be built."""
        try:
            spec = confine(spec, tenant, self.settings)
            return spec, plan_job(
                spec, self.settings, self.count_parameters, device_memory_gib, refuse
            )
        except (Refused, ModelNotBuildable) as exc:
            raise HTTPException(422, str(exc)) from None
        except PlanRefused as refused:
            raise HTTPException(422, refused.detail) from None

    def live_snapshot(self, job_id: str) -> dict[str, Any] | None:
        """The supervisor's current metrics and targets (no events, logs or history);
        None when it is gone or does not answer now."""
        try:
            return self.backend.poll(job_id, MAX_ID, MAX_ID, MAX_ID)
        except Exception as exc:
            log.warning("job %s: no live snapshot: %s", job_id, type(exc).__name__)
            return None

    def _live_metrics(self) -> dict[str, Any]:
        """What /metrics reports of the store and the cluster, read at most once per
        METRICS_TTL_S (scrapes do not load the store); the last reading while the
        store does not answer."""
        now = time.monotonic()
        if self._metrics_read is None or now - self._metrics_read[0] >= METRICS_TTL_S:
            try:
                self._metrics_read = (now, self._read_metrics())
            except (OperationalError, InterfaceError, PoolTimeout):
                if self._metrics_read is None:
                    raise
        return self._metrics_read[1]

    def _read_metrics(self) -> dict[str, Any]:
        with self.sessions() as session:
            jobs = store.count_by_status(session)
            workers = {
                j.id: j.current_dp * int(j.spec.get("resources", {}).get("mp", 1))
                for j in store.jobs_in(session, ACTIVE)
            }
        try:
            cap = self.backend.capacity()
            total, free = cap.total, cap.free
        except Exception:
            total, free = {}, {}
        return {"jobs": jobs, "workers": workers, "total": total, "free": free}


def token_info(row: ApiToken, tenant: str) -> TokenInfo:
    return TokenInfo(
        id=row.id,
        tenant=tenant,
        admin=row.admin,
        name=row.name,
        prefix=row.prefix,
        created_at=row.created_at,
        expires_at=row.expires_at,
        revoked_at=row.revoked_at,
    )


def create_app(service: Service) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if service.start_scheduler:
            service.scheduler.start()
        yield
        service.scheduler.stop()

    app = FastAPI(
        title="zeroservice",
        version="0.1.0",
        description="Train PyTorch models with ZeRO on Ray: jobs, events, metrics, plans.",
        lifespan=lifespan,
    )
    app.state.service = service
    errors.install(app)
    app.add_middleware(BodyLimit, max_bytes=service.settings.max_body_bytes)

    @app.middleware("http")
    async def measure(request: Request, call_next):
        t0 = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        service.metrics.requests.labels(request.method, path, str(response.status_code)).inc()
        service.metrics.latency.labels(request.method, path).observe(time.perf_counter() - t0)
        if response.status_code >= 400:
            service.metrics.errors.labels(path, str(response.status_code)).inc()
        return response

    def session() -> Iterator[Session]:
        with service.sessions() as s:
            yield s

    Db = Annotated[Session, Depends(session)]

    def principal(request: Request, db: Db) -> Principal:
        token = bearer(request.headers.get("authorization"))
        who = store.authenticate(db, token) if token else None
        if who is None:
            raise HTTPException(
                401,
                "missing or invalid bearer token",
                headers={"WWW-Authenticate": "Bearer"},
            )
        wait = service.rate.wait_s(who.token_id)
        if wait > 0:
            limit = f"{service.settings.rate_per_s:g}/s, burst {service.settings.rate_burst}"
            raise HTTPException(
                429,
                f"rate: this token's limit ({limit}) is reached",
                headers={"Retry-After": str(max(1, math.ceil(wait)))},
            )
        return who

    Who = Annotated[Principal, Depends(principal)]

    def admin(who: Who) -> Principal:
        if not who.admin:
            raise HTTPException(403, "an admin token is required")
        return who

    Admin = Annotated[Principal, Depends(admin)]

    def job_or_404(db: Session, who: Principal, job_id: str):
        job = store.get_job(db, who, job_id)
        if job is None:
            raise HTTPException(404, f"job {job_id} not found")
        return job

    def out(db: Session, job, with_spec: bool = False) -> JobOut:
        names = store.tenant_names(db, {job.tenant_id})
        return store.to_out(job, names.get(job.tenant_id, "?"), with_spec)

    # -- health --------------------------------------------------------------------------
    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"])
    def readyz(db: Db) -> JSONResponse:
        problems = []
        try:
            db.execute(text("SELECT 1"))
        except Exception as exc:
            problems.append(f"database: {exc}")
        if service.start_scheduler and not service.scheduler.alive:
            problems.append("scheduler: not running")
        if service.scheduler.last_error:
            problems.append(f"scheduler: {service.scheduler.last_error}")
        try:
            service.backend.capacity()
        except Exception as exc:
            problems.append(f"cluster: {exc}")
        body = {
            "status": "ready" if not problems else "not ready",
            "problems": problems,
            "scheduler": "leader" if service.scheduler.leader else "standby",
        }
        return JSONResponse(body, status_code=200 if not problems else 503)

    @app.get("/metrics", tags=["health"])
    def metrics() -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- jobs ----------------------------------------------------------------------------
    @app.post("/v1/jobs", status_code=201, response_model=JobOut, tags=["jobs"])
    def submit(body: JobSubmit, db: Db, who: Who, response: Response) -> JobOut:
        spec, _ = service.confined_plan(body.spec, who.tenant, None, refuse=True)
        try:
            quota.check_submission(db, who, spec, body.priority, service.settings)
        except quota.OverLimit as over:
            raise HTTPException(over.status, str(over)) from None
        created = store.submit(
            db,
            who,
            spec.model_dump(mode="json"),
            spec.name,
            body.submission_id,
            body.priority,
            checkpoint_base(service.settings, who.tenant),
            spec.checkpoint.dir,
        )
        if not created.created:
            response.status_code = 200
        return out(db, created.job, with_spec=True)

    @app.get("/v1/jobs", response_model=JobList, tags=["jobs"])
    def list_jobs(
        db: Db,
        who: Who,
        status: Annotated[str | None, Query(description="one of " + ", ".join(STATUSES))] = None,
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
        offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
    ) -> JobList:
        if status is not None and status not in STATUSES:
            raise HTTPException(422, f"status: {status!r} is not one of {', '.join(STATUSES)}")
        jobs, total = store.list_jobs(db, who, status, limit, offset)
        names = store.tenant_names(db, {j.tenant_id for j in jobs})
        items = [store.to_out(j, names.get(j.tenant_id, "?")) for j in jobs]
        more = offset + len(items) < total
        return JobList(
            items=items,
            total=total,
            limit=limit,
            offset=offset,
            next_offset=offset + len(items) if more else None,
        )

    @app.get("/v1/jobs/{job_id}", response_model=JobOut, tags=["jobs"])
    def get_job(job_id: JobId, db: Db, who: Who) -> JobOut:
        return out(db, job_or_404(db, who, job_id), with_spec=True)

    @app.post("/v1/jobs/{job_id}/cancel", response_model=JobOut, tags=["jobs"])
    def cancel(job_id: JobId, db: Db, who: Who) -> JobOut:
        job = job_or_404(db, who, job_id)
        if job.status in TERMINAL:
            raise HTTPException(409, f"job {job_id} is already {job.status}")
        if job.status == "queued":
            store.set_status(db, job, "cancelled", "cancelled", f"cancelled by {who.tenant}")
            try:
                db.commit()  # version-checked: admission may have taken it meanwhile
            except StaleDataError:
                raise HTTPException(409, f"job {job_id} changed meanwhile; retry") from None
        else:
            service.backend.cancel(job.id, f"cancelled by {who.tenant}")
            store.add_event(db, job, "request", "cancel", f"cancel requested by {who.tenant}")
            db.commit()
        return out(db, job)

    @app.get("/v1/jobs/{job_id}/events", response_model=list[EventOut], tags=["jobs"])
    def events(
        job_id: JobId,
        db: Db,
        who: Who,
        after: Annotated[int, Query(ge=0, le=MAX_ID)] = 0,
        limit: Annotated[int, Query(ge=1, le=1000)] = 200,
    ) -> list[EventOut]:
        job = job_or_404(db, who, job_id)
        return [
            EventOut(
                id=e.id, time=e.time, kind=e.kind, reason=e.reason, message=e.message, data=e.data
            )
            for e in store.events(db, job, after, limit)
        ]

    @app.get("/v1/jobs/{job_id}/logs", response_model=list[LogLine], tags=["jobs"])
    def logs(
        job_id: JobId,
        db: Db,
        who: Who,
        after: Annotated[int, Query(ge=0, le=MAX_ID)] = 0,
        limit: Annotated[int, Query(ge=1, le=5000)] = 500,
    ) -> list[LogLine]:
        job = job_or_404(db, who, job_id)
        return [
            LogLine(id=x.id, time=x.time, line=x.line) for x in store.logs(db, job, after, limit)
        ]

    @app.get("/v1/jobs/{job_id}/metrics", response_model=MetricsOut, tags=["jobs"])
    def job_metrics(
        job_id: JobId,
        db: Db,
        who: Who,
        history_after: Annotated[int, Query(ge=-1, le=MAX_ID)] = -1,
        history_limit: Annotated[int, Query(ge=0, le=1000)] = 1000,
    ) -> MetricsOut:
        """The per-rank stats (live while the job runs) and the chunks of its history
        after step ``history_after``, oldest first, at most ``history_limit``."""
        job = job_or_404(db, who, job_id)
        live = False
        stored = job.metrics or {}
        ranks = stored.get("ranks", {})
        later = [h for h in stored.get("history", []) if h.get("step", 0) > history_after]
        history = later[:history_limit]
        if job.status in ACTIVE:
            snap = service.live_snapshot(job.id)
            if snap is not None and snap.get("metrics"):
                ranks, live = snap["metrics"], True
        return MetricsOut(job_id=job.id, step=job.step, ranks=ranks, history=history, live=live)

    # -- planning and the cluster ----------------------------------------------------------
    @app.post("/v1/plan", tags=["plan"])
    def plan(body: PlanRequest, who: Who) -> dict[str, Any]:
        return service.confined_plan(body.spec, who.tenant, body.device_memory_gib, False)[1]

    @app.get("/v1/cluster", response_model=ClusterOut, tags=["cluster"])
    def cluster(who: Who) -> ClusterOut:
        cap = service.backend.capacity()
        return ClusterOut(total=cap.total, free=cap.free, nodes=cap.nodes, requested=cap.requested)

    @app.get("/v1/targets", tags=["cluster"])
    def targets(db: Db, who: Who) -> list[dict[str, Any]]:
        """Prometheus HTTP service discovery: every active rank's metrics endpoint."""
        found: list[dict[str, Any]] = []
        for job in store.jobs_in(db, ACTIVE):
            if not who.admin and job.tenant_id != who.tenant_id:
                continue
            snap = service.live_snapshot(job.id)
            for target in (snap or {}).get("targets", []):
                found.append(target)
        return found

    # -- tenants and tokens (admin) ------------------------------------------------------
    @app.post("/v1/tenants", status_code=201, tags=["admin"])
    def create_tenant(body: TenantCreate, db: Db, who: Admin):
        try:
            tenant = store.create_tenant(db, body.name)
        except store.Conflict as exc:
            raise HTTPException(409, str(exc)) from None
        return {"id": tenant.id, "name": tenant.name}

    @app.put("/v1/tenants/{name}/limits", response_model=TenantLimits, tags=["admin"])
    def set_limits(
        name: Annotated[str, PathParam(max_length=128)], body: TenantLimits, db: Db, who: Admin
    ) -> TenantLimits:
        tenant = store.tenant_by_name(db, name)
        if tenant is None:
            raise HTTPException(404, f"tenant {name!r} not found")
        store.set_limits(db, tenant, **body.model_dump())
        return body

    @app.post("/v1/tokens", status_code=201, response_model=TokenOut, tags=["admin"])
    def create_token(body: TokenCreate, db: Db, who: Admin) -> TokenOut:
        tenant = store.tenant_by_name(db, body.tenant)
        if tenant is None:
            raise HTTPException(404, f"tenant {body.tenant!r} not found")
        days = body.expires_in_days or service.settings.token_ttl_days
        expires = utcnow() + timedelta(days=days)
        token, row = store.create_token(db, tenant, body.admin, body.name, expires)
        return TokenOut(token=token, **token_info(row, tenant.name).model_dump())

    @app.get("/v1/tokens", response_model=list[TokenInfo], tags=["admin"])
    def list_tokens(
        db: Db, who: Admin, tenant: Annotated[str | None, Query(max_length=128)] = None
    ) -> list[TokenInfo]:
        return [token_info(row, name) for row, name in store.list_tokens(db, tenant)]

    @app.delete("/v1/tokens/{token_id}", tags=["admin"])
    def revoke_token_by_id(
        token_id: Annotated[int, PathParam(ge=1, le=MAX_ID)], db: Db, who: Admin
    ) -> dict[str, int]:
        return {"revoked": revoked_or_404(store.revoke_token_by_id, token_id, db, who)}

    @app.post("/v1/tokens/revoke", tags=["admin"])
    def revoke_token(body: TokenRevoke, db: Db, who: Admin) -> dict[str, int]:
        return {"revoked": revoked_or_404(store.revoke_token, body.prefix, db, who)}

    def revoked_or_404(revoke, key, db: Session, who: Principal) -> int:
        try:
            revoked = revoke(db, key, who)
        except store.Conflict as exc:
            raise HTTPException(409, str(exc)) from None
        if not revoked:
            raise HTTPException(404, f"no live token {key!r}")
        return revoked

    return app
