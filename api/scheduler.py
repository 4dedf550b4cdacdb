"""The scheduler loop: sync running jobs from their supervisors, admit queued jobs
when they fit, and tell the autoscaler what the queue needs.

[Note: scheduling]
Each tick, in one session:

0. Lease: among API replicas sharing a store, only the holder of the ``scheduler``
   lease (api/lease.py) goes on; the others wait for it to lapse.
1. Sync: every job the store thinks active (starting, running, resizing) is polled
   through its supervisor (found by name, so a restarted control plane reattaches to
   the jobs it left running); new events and log lines are copied into the store,
   status, step, dp, restarts and the last per-rank stats are updated. A job whose
   supervisor is gone is failed with that reason.
2. Admit: queued jobs in order of priority, then age. The first that does not fit
   the free capacity (its smallest size: min_dp replicas) stops admission, so a large
   job is not starved by smaller ones behind it.
3. Autoscale: the bundles of the jobs still queued are requested from Ray's
   autoscaler (``request_resources``), bounded by the configured cluster maximum; an
   empty queue withdraws the request, so idle nodes can be released.
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy.orm import Session, sessionmaker

from workers.spec import JobSpec

from . import lease, store
from .backend import Backend, job_bundles
from .confine import checkpoint_base, checkpoint_path
from .db import Job, utcnow
from .metrics import ApiMetrics
from .schemas import TERMINAL
from .settings import Settings

ACTIVE = ("starting", "running", "resizing")
LEASE = "scheduler"
log = logging.getLogger("zeroservice.scheduler")


class Scheduler:
    """See [Note: scheduling]."""

    def __init__(
        self,
        sessions: sessionmaker,
        backend: Backend,
        settings: Settings,
        metrics: ApiMetrics | None = None,
    ):
        self.sessions, self.backend, self.settings = sessions, backend, settings
        self.metrics = metrics
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.ticks = 0
        self.last_error: str | None = None
        self.holder = lease.new_holder()
        self.leader = False
        """Whether this replica held the scheduler's lease at its last tick."""

    # -- the loop ---------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self.leader:
            with self.sessions() as session:
                lease.release(session, LEASE, self.holder)
            self.leader = False

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
                self.last_error = None
            except Exception as exc:  # keep scheduling; readyz reports it
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("scheduler tick failed")
            self._stop.wait(self.settings.scheduler_interval_s)

    def tick(self) -> bool:
        """One round; False, doing nothing, while another replica holds the lease."""
        with self._lock, self.sessions() as session:
            ttl = self.settings.scheduler_lease_s
            self.leader = lease.acquire(session, LEASE, self.holder, ttl)
            if not self.leader:
                return False
            self.sync(session)
            waiting = self.admit(session)
            self.autoscale(waiting)
            self.ticks += 1
            return True

    # -- 1. sync ----------------------------------------------------------------------
    def sync(self, session: Session, only: str | None = None) -> None:
        for job in store.jobs_in(session, ACTIVE):
            if only is not None and job.id != only:
                continue
            self._sync_job(session, job)
        session.commit()

    def _sync_job(self, session: Session, job: Job) -> None:
        seen_history = int((job.metrics or {}).get("history_seen", 0))
        snap = self.backend.poll(job.id, job.events_seen, job.logs_seen, seen_history)
        if snap is None:
            store.set_status(
                session,
                job,
                "failed",
                "supervisor_lost",
                "the job's supervisor is gone (the cluster restarted or lost its node)",
            )
            return
        limits = self.settings
        store.add_events(session, job, snap["events"], limits.max_events_per_job)
        store.add_log_lines(session, job, snap["logs"], limits.max_log_lines_per_job)
        store.add_metrics(
            session,
            job,
            snap.get("metrics") or {},
            snap.get("history", []),
            int(snap.get("history_total", seen_history + len(snap.get("history", [])))),
            limits.max_history_per_job,
        )
        st = snap["status"]
        job.attempts, job.current_dp, job.step = st["restarts"], st["dp"], st["step"]
        job.checkpoint_path = st.get("checkpoint_root", job.checkpoint_path)
        job.updated_at = utcnow()
        store.set_status(session, job, st["status"], st["reason"], st["message"], record=False)
        if job.status in TERMINAL:
            forget = getattr(self.backend, "forget", None)
            if forget is not None:
                forget(job.id)

    # -- 2. admit ---------------------------------------------------------------------
    def admit(self, session: Session) -> list[JobSpec]:
        """Admit what fits, in order; returns the specs still waiting."""
        waiting: list[JobSpec] = []
        blocked = False
        for job in store.jobs_in(session, ("queued",)):
            spec = JobSpec.model_validate(job.spec)
            if blocked or not self.backend.fits(spec):
                blocked = True
                waiting.append(spec)
                continue
            if not job.checkpoint_path:  # queued before checkpoints were placed at submit
                tenant = store.tenant_names(session, {job.tenant_id})[job.tenant_id]
                base = checkpoint_base(self.settings, tenant)
                job.checkpoint_path = checkpoint_path(base, job.id, spec.checkpoint.dir)
            self.backend.launch(job.id, spec, job.checkpoint_path)
            store.set_status(session, job, "starting", "admitted", "placing ranks on Ray")
            if self.metrics is not None:
                self.metrics.queue_wait.observe((utcnow() - job.created_at).total_seconds())
            session.commit()
        return waiting

    # -- 3. autoscale -----------------------------------------------------------------
    def autoscale(self, waiting: list[JobSpec]) -> None:
        bundles: list[dict[str, float]] = []
        totals: dict[str, float] = {}
        for spec in waiting:
            want = job_bundles(spec)
            after = dict(totals)
            for b in want:
                for k, v in b.items():
                    after[k] = after.get(k, 0.0) + v
            if any(after[k] > self.settings.max_cluster.get(k, float("inf")) for k in after):
                continue  # beyond the cluster's maximum: asking would not help
            bundles += want
            totals = after
        self.backend.request_resources(bundles)
