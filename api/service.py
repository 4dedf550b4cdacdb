"""What the routes share: settings, the store, the cluster backend, the scheduler, the
control plane's metrics and the per-token rate limiter."""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from workers.model_size import ModelNotBuildable
from workers.spec import JobSpec
from workers.state import ACTIVE
from zeroservice.planner import PlanError

from . import store
from .auto_config import AutoRefused, is_auto, resolve
from .backend import Backend
from .build_slots import BuildSlots
from .confine import Refused, confine
from .db import make_engine, session_factory
from .errors import Rejected
from .metrics import ApiMetrics
from .migrate import upgrade
from .plan import GIB, PlanRefused, memory_limit, plan_job
from .rate_limit import RateLimiter
from .scheduler import POLL_THREADS, Scheduler
from .settings import Settings

log = logging.getLogger("zeroservice.api")
MAX_ID = 2**31 - 1
"""The largest row id the store holds (its id columns are 32-bit integers)."""
METRICS_TTL_S = 5.0
"""How long /metrics reuses its reading of the store and the cluster."""
LIVE_WAIT_S = 5.0
"""How long a request waits for a supervisor's live figures before it answers with the
stored ones (a silent supervisor: see [Note: supervised supervisor] in scheduler.py)."""


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
        self.builds = BuildSlots(settings.plan_builds_per_tenant)
        self.metrics = ApiMetrics(self._live_metrics)
        self.scheduler = Scheduler(self.sessions, backend, settings, self.metrics)
        self.start_scheduler = start_scheduler
        with self.sessions() as session:
            self.bootstrap_token = store.bootstrap_admin(session, settings.admin_token)

    def count_parameters(self, spec: JobSpec, tenant: str) -> int:
        """A non-GPT model's size, measured on a worker within the configured bounds, in
        one of the tenant's build slots (see api/build_slots.py)."""
        s = self.settings
        memory = int(s.plan_memory_gib * GIB)
        return self.builds.run(
            tenant, lambda: self.backend.count_parameters(spec, s.plan_timeout_s, memory)
        )

    def confined_plan(
        self, spec: JobSpec, tenant: str, device_memory_gib: float | None, refuse: bool
    ) -> tuple[JobSpec, dict[str, Any]]:
        """The spec confined to what the tenant may name, and its memory plan; 422
        naming the field when it names something else or its model cannot be built."""
        try:
            spec = confine(spec, tenant, self.settings)
            auto = None
            if is_auto(spec):  # see api/auto_config.py
                _, limit = memory_limit(spec, self.settings, device_memory_gib)
                spec, auto = resolve(spec, limit)
            count = functools.partial(self.count_parameters, tenant=tenant)
            plan = plan_job(spec, self.settings, count, device_memory_gib, refuse)
        except (Refused, ModelNotBuildable) as exc:
            raise Rejected(422, str(exc)) from None
        except PlanError as exc:  # a combination of fields the planner cannot lay out
            raise Rejected(422, f"plan: {exc}") from None
        except PlanRefused as refused:
            raise Rejected(422, refused.detail) from None
        except AutoRefused as refused:
            if refuse or not refused.nothing_fits:
                raise Rejected(422, refused.detail) from None
            return spec, refused.detail
        return spec, plan if auto is None else {**plan, "auto": auto}

    def live_snapshot(self, job_id: str) -> dict[str, Any] | None:
        """The supervisor's current metrics and targets (no events, logs or history);
        None when it is gone or does not answer within ``LIVE_WAIT_S``."""
        timeout_s = min(LIVE_WAIT_S, self.settings.supervisor_poll_timeout_s)
        try:
            return self.backend.poll(job_id, MAX_ID, MAX_ID, MAX_ID, timeout_s)
        except Exception as exc:
            log.warning("job %s: no live snapshot: %s", job_id, type(exc).__name__)
            return None

    def live_snapshots(self, job_ids: list[str]) -> list[dict[str, Any] | None]:
        """``live_snapshot`` of each job, asked at once (``POLL_THREADS`` at a time): a
        silent supervisor costs a request one wait, not one per job."""
        if not job_ids:
            return []
        with ThreadPoolExecutor(min(POLL_THREADS, len(job_ids)), "live-snapshot") as asks:
            return list(asks.map(self.live_snapshot, job_ids))

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
