"""The scheduler loop: sync running jobs from their supervisors, admit queued jobs
when they fit, and tell the autoscaler what the queue needs.

[Note: scheduling]
Each tick, in one session:

0. Lease: among API replicas sharing a store, only the holder of the ``scheduler``
   lease (api/lease.py) goes on; the others wait for it to lapse (or for its holder
   to shut down and release it; a replica restarted after a crash takes it back).
1. Sync: every job the store thinks active (starting, running, resizing) is polled
   through its supervisor (found by name, so a restarted control plane reattaches to
   the jobs it left running); new events and log lines are copied into the store,
   status, step, dp, restarts and the last per-rank stats are updated, each job in
   a transaction of its own. A starting job without a supervisor is launched again
   (launching is idempotent: the control plane may have stopped between marking it
   starting and launching it). A running or resizing job whose supervisor is gone
   gets a new one (see [Note: supervised supervisor]). A poll that fails (a
   timeout) leaves the job as it is until the next tick.
2. Admit: queued jobs in order of priority, then age. A job beyond its tenant's
   quota (ranks, GPUs) waits without holding anyone up. A job that does not fit the
   free capacity (its smallest size: min_dp replicas) lets smaller ones behind it
   start (backfill) until it has waited ``backfill_grace_s``; from then on it holds
   the queue: nothing behind it starts, so the capacity that frees up is its own.
   An admitted job is first committed as starting (version-checked: a concurrent
   cancel wins), then launched; a launch that fails fails that job alone.
3. Autoscale: the bundles of the jobs still queued are requested from Ray's
   autoscaler (``request_resources``), bounded by the configured cluster maximum; an
   empty queue withdraws the request, so idle nodes can be released.

[Note: a round fenced by its lease]
One replica at a time schedules: the holder of the ``scheduler`` lease (lease.py). A
round can outlive the lease it took (the replica paused, a silent supervisor's poll,
a slow store), and another replica takes the lapsed lease meanwhile; a round that
went on would admit against quota usage it read before, launch beside the other's
launches and reap the ranks of the supervisor the other just started. So every
write of a round is committed together with the lease's renewal (``_commit``:
``lease.hold`` in the same transaction, which on PostgreSQL locks the lease's row
until the commit), and the round acts on the cluster (launch, reap, cancel, the
autoscaler's request) only right after such a commit (``_fence``); where the lease
lapsed, the write is rolled back and the round ends (``LeaseLost``).

[Note: supervised supervisor]
A job's supervisor can die (its process killed, the head restarted). The control
plane notices at its next sync (the poll finds no supervisor) and, as a restart of
the job, starts a new supervisor (``workers.messages.Succession``) with the job's
restart count so far plus one, which is also its term, and the step of the newest
``checkpoint/saved`` event stored. The ranks and their placement group are detached
and named after the job, so they outlive the lost supervisor: the new one begins in
``resizing``, finds them, waits until the call the old one made is over (train or
save, under the watchdog) and from then on has the ranks refuse the old one's calls
still on their way ([Note: supervisor terms] in workers/rank.py), takes the ranks'
reports since their last save and the points that save carried (every point the
control plane had not stored: what the old one may have held unread), reports a
save newer than the stored one (its event was lost with the old supervisor), saves
if the old one did not, and goes on with them.
Without a complete, answering group, or with one whose last call failed on a rank (a
call that reached only some ranks leaves the others' collectives timed out), it
removes what is left and places a new group that loads the newest sound checkpoint.
The job keeps its stored events, logs and history; the positions read from the
supervisor start again at 0. Only a spent restart budget (``max_restarts``) fails
the job, as ``supervisor_lost`` (its leftover ranks removed).

A supervisor can also stop answering without dying: its process stopped (SIGSTOP, a
frozen VM) or hung. Ray still reports it alive, so nothing above would replace it and
the job would wait for ever. A poll that times out (``SupervisorSilent``) leaves the
job as it is; once the supervisor has answered none for ``supervisor_silent_s``, the
control plane kills its process (``Backend.stop_supervisor``: the ranks keep
running) and the next sync replaces it as a lost one, saying how long it was silent.
Only a timeout counts: a cluster out of reach (the Ray link down) stops nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.orm.exc import StaleDataError

from workers.messages import Succession
from workers.spec import JobSpec
from workers.state import ACTIVE, TERMINAL, JobState

from . import lease, quota, store
from .backend import Backend, SupervisorSilent, job_bundles
from .confine import checkpoint_base, checkpoint_path
from .db import Job, utcnow
from .metrics import ApiMetrics
from .settings import Settings
from .text_guard import storable

LEASE = "scheduler"
POLL_THREADS = 8
"""Supervisors polled at once (see [Note: polls at once])."""
log = logging.getLogger("zeroservice.scheduler")


def _history_seen(job: Job) -> int:
    """How many of the supervisor's history points the store has read."""
    return int((job.metrics or {}).get("history_seen", 0))


class LeaseLost(Exception):
    """The scheduler's lease lapsed during a round: another replica may hold it now."""


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
        self.holder, self._holder_file = lease.claim_holder(settings.data_dir)
        """The name this replica holds the lease under, and the file whose lock keeps
        it ours (see [Note: a replica restarted after a crash] in lease.py)."""
        self._held_until = 0.0
        """Until when (monotonic) this replica holds the lease it last took or renewed."""
        self.clock = time.monotonic
        """Seconds for ``supervisor_silent_s`` (tests step it by hand)."""
        self._silent_since: dict[str, float] = {}
        """Per job, when its supervisor's polls began to time out (monotonic)."""
        self._stopped: dict[str, str] = {}
        """Per job whose silent supervisor was stopped, why (for the replacement's
        event)."""

    # -- the loop ---------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=30)
            if thread.is_alive():
                return  # a round still runs: it keeps the lease until it ends or lapses
        if self.leader:
            with self.sessions() as session:
                lease.release(session, LEASE, self.holder)
            self._held_until = 0.0

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
                self.last_error = None
            except Exception as exc:  # keep scheduling; readyz reports its kind, the log all
                self.last_error = type(exc).__name__
                log.exception("scheduler tick failed")
            self._stop.wait(self.settings.scheduler_interval_s)

    def tick(self) -> bool:
        """One round; False, doing nothing (more), while another replica holds the
        lease. See [Note: a round fenced by its lease]."""
        with self._lock, self.sessions() as session:
            ttl = self.settings.scheduler_lease_s
            self._held_until = 0.0
            if not lease.acquire(session, LEASE, self.holder, ttl):
                return False
            self._held_until = time.monotonic() + ttl
            try:
                self.sync(session)
                waiting = self.admit(session)
                self._fence(session)
                self.autoscale(waiting)
            except LeaseLost:
                session.rollback()
                self._held_until = 0.0
                log.warning("scheduler: the lease lapsed during a round; another replica has it")
                return False
            self.ticks += 1
            return True

    @property
    def leader(self) -> bool:
        """Whether this replica holds the scheduler's lease now, as far as it knows: it
        took or renewed it less than the lease's time ago."""
        return time.monotonic() < self._held_until

    def _commit(self, session: Session) -> None:
        """Commit a round's write together with the lease's renewal; LeaseLost (the
        write rolled back) when the lease lapsed. See [Note: a round fenced by its
        lease]."""
        if not lease.hold(session, LEASE, self.holder, self.settings.scheduler_lease_s):
            session.rollback()
            raise LeaseLost()
        session.commit()
        self._held_until = time.monotonic() + self.settings.scheduler_lease_s

    def _fence(self, session: Session) -> None:
        """Before acting on the cluster (launch, reap, cancel, autoscale): the lease is
        still this replica's, renewed (with whatever the session holds)."""
        self._commit(session)

    # -- 1. sync ----------------------------------------------------------------------
    def sync(self, session: Session, only: str | None = None) -> None:
        """Store what every active job's supervisor says.

        [Note: polls at once]
        The supervisors are polled at once (up to ``POLL_THREADS``), and their answers
        stored one job at a time, in this thread and session. A silent supervisor (see
        [Note: supervised supervisor]) then holds one thread for the poll timeout,
        while every other job's answer is stored in the same tick; polled one after
        the other, each silent one held up all the others' for that long."""
        jobs = store.jobs_in(session, ACTIVE)
        if only is None:  # forget what is known of supervisors of jobs now ended
            active = {job.id for job in jobs}
            for known in (self._silent_since, self._stopped):
                for job_id in [j for j in known if j not in active]:
                    del known[job_id]
        jobs = [job for job in jobs if only is None or job.id == only]
        if not jobs:
            return
        timeout_s = self.settings.supervisor_poll_timeout_s
        with ThreadPoolExecutor(min(POLL_THREADS, len(jobs)), "scheduler-poll") as polls:
            asked = {
                job.id: polls.submit(
                    self.backend.poll,
                    job.id,
                    job.events_seen,
                    job.logs_seen,
                    _history_seen(job),
                    timeout_s,
                )
                for job in jobs
            }
            for job in jobs:
                try:
                    self._sync_job(session, job, asked[job.id])
                    self._commit(session)
                except StaleDataError:  # changed meanwhile (a cancel): read again next tick
                    session.rollback()
                except LeaseLost:
                    raise
                except Exception as exc:  # the supervisor did not answer: untouched
                    session.rollback()
                    log.warning("job %s: poll failed: %s", job.id, type(exc).__name__)

    def _sync_job(self, session: Session, job: Job, asked: Future) -> None:
        """Store one job's poll (``asked``: its answer, or the error it raised)."""
        seen_history = _history_seen(job)
        try:
            snap = asked.result()
        except SupervisorSilent:
            self._unanswered(job.id)
            raise
        self._silent_since.pop(job.id, None)
        if snap is not None:  # answering again (a stop that did not take)
            self._stopped.pop(job.id, None)
        cancelled = store.cancel_request(session, job)
        if cancelled is not None and snap is None:
            # [Note: a cancel is kept]
            # A cancel reaches the supervisor that runs when it is made; one that
            # finds none (gone, or not yet launched) is honoured here instead of a
            # relaunch, and one that raced a relaunch is sent again below, every tick,
            # until the job ends: an acknowledged cancel is never lost.
            reap = getattr(self.backend, "reap", None)
            if reap is not None:
                self._fence(session)
                reap(job.id)  # the ranks a lost supervisor left running
            store.set_status(session, job, JobState.CANCELLED, "cancelled", cancelled)
            return
        if snap is None and job.status == JobState.STARTING:
            # [Note: a start launched again]
            # Committed as starting, no supervisor: its launch never happened (the
            # control plane stopped in between), or its supervisor was lost before a
            # poll saw the job run. Then that supervisor may have placed and set up a
            # group: detached, named as the new one's will be, and holding the CPUs it
            # needs. It is removed before the job is launched again.
            reap = getattr(self.backend, "reap", None)
            if reap is not None:
                self._fence(session)
                reap(job.id)
            spec = self._stored_spec(session, job)
            if spec is not None:
                self._launch(session, job, spec)
            return
        if snap is None:
            self._replace_supervisor(session, job)
            return
        snap = storable(snap)
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
        if cancelled is not None and not JobState(st["status"]).is_terminal:
            self._fence(session)
            self.backend.cancel(job.id, cancelled, self.settings.supervisor_poll_timeout_s)
        job.attempts, job.current_dp, job.step = st["restarts"], st["dp"], st["step"]
        job.checkpoint_path = st.get("checkpoint_root", job.checkpoint_path)
        job.updated_at = utcnow()
        store.set_status(session, job, st["status"], st["reason"], st["message"], record=False)
        if job.status in TERMINAL:
            forget = getattr(self.backend, "forget", None)
            if forget is not None:
                forget(job.id)

    def _unanswered(self, job_id: str) -> None:
        """A poll of the job's supervisor timed out: once none has been answered for
        ``supervisor_silent_s``, stop it (see [Note: supervised supervisor])."""
        now = self.clock()
        since = self._silent_since.setdefault(job_id, now)
        if now - since < self.settings.supervisor_silent_s:
            return
        log.warning("job %s: supervisor silent for %.0f s: stopping it", job_id, now - since)
        self.backend.stop_supervisor(job_id)  # raises (kept for the next tick) if it failed
        del self._silent_since[job_id]
        self._stopped[job_id] = (
            f"the job's supervisor answered no poll for {now - since:.0f} s and was stopped"
        )

    def _replace_supervisor(self, session: Session, job: Job) -> None:
        """See [Note: supervised supervisor]."""
        gone = self._stopped.pop(
            job.id, "the job's supervisor is gone (killed, or the cluster restarted)"
        )
        spec = self._stored_spec(session, job)
        if spec is None:
            return
        restarts = job.attempts + 1
        if restarts > spec.max_restarts:
            reap = getattr(self.backend, "reap", None)
            if reap is not None:
                self._fence(session)
                reap(job.id)  # the ranks it left running
            budget = f"restart budget of {spec.max_restarts} spent"
            store.set_status(session, job, JobState.FAILED, "supervisor_lost", f"{gone} ({budget})")
            return
        store.add_event(
            session,
            job,
            "restart",
            "supervisor_lost",
            f"{gone}: starting a new one",
            {"restarts": restarts},
        )
        job.attempts, job.events_seen, job.logs_seen = restarts, 0, 0
        job.metrics = {**(job.metrics or {}), "history_seen": 0}
        message = "a new supervisor goes on from the newest checkpoint"
        store.set_status(session, job, JobState.RESIZING, "supervisor_lost", message, record=False)
        self._commit(session)  # version-checked: a concurrent cancel wins
        succession = Succession(restarts, store.newest_save(session, job))
        self._relaunch(session, job, spec, succession)

    def _relaunch(self, session: Session, job: Job, spec: JobSpec, succession: Succession) -> None:
        try:
            self.backend.launch(job.id, spec, job.checkpoint_path, succession)
        except Exception as exc:
            log.warning("job %s: a new supervisor failed to start", job.id, exc_info=True)
            text = str(exc).splitlines()[0][:300] if str(exc) else ""
            store.set_status(
                session, job, JobState.FAILED, "launch_failed", f"{type(exc).__name__}: {text}"
            )

    # -- 2. admit ---------------------------------------------------------------------
    def admit(self, session: Session) -> list[JobSpec]:
        """Admit what fits, in order, backfilling past jobs that do not fit until one
        has waited ``backfill_grace_s`` (it then holds the queue: see [Note:
        scheduling]); returns the specs still waiting."""
        waiting: list[JobSpec] = []
        usage = quota.active_usage(session)
        reserved = False
        for job in store.jobs_in(session, (JobState.QUEUED,)):
            # A rollback below (a cancel that won) expires every job of this session:
            # the next one is then read again, and a cancel committed since shows here,
            # where its fresh version would pass the version check.
            if job.status != JobState.QUEUED:
                continue
            spec = self._stored_spec(session, job)
            if spec is None or not self._still_admissible(session, job, spec):
                continue
            if not quota.within_quota(session, job.tenant_id, spec, usage):
                continue  # the tenant's own limit: it waits, others go on
            if reserved or not self.backend.fits(spec):
                reserved = reserved or self._overdue(job)
                waiting.append(spec)
                continue
            if self._admit(session, job, spec):
                quota.count_usage(usage, job.tenant_id, spec.resources)
        return waiting

    def _stored_spec(self, session: Session, job: Job) -> JobSpec | None:
        """The job's spec, or None after failing the job when the stored spec no longer
        validates (stored by an older version): it must not stop admission."""
        try:
            return JobSpec.model_validate(job.spec)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            store.set_status(
                session, job, JobState.FAILED, "invalid_spec", f"{where}: {first['msg']}"
            )
            self._commit(session)
            return None

    def _still_admissible(self, session: Session, job: Job, spec: JobSpec) -> bool:
        """False after failing the job when it could never be admitted any more: its
        tenant's quota was lowered below it (or the cluster's maximum) since it was
        queued. It would otherwise wait forever and count against the tenant's queue,
        where the same spec submitted now is refused (422)."""
        try:
            quota.check_admissible(session, job.tenant_id, spec, self.settings)
        except quota.OverLimit as exc:
            store.set_status(
                session, job, JobState.FAILED, "over_quota", f"{exc}; it can never be admitted"
            )
            try:
                self._commit(session)
            except StaleDataError:  # a cancel committed meanwhile wins
                session.rollback()
            return False
        return True

    def _overdue(self, job: Job) -> bool:
        waited = (utcnow() - job.created_at).total_seconds()
        return waited >= self.settings.backfill_grace_s

    def _admit(self, session: Session, job: Job, spec: JobSpec) -> bool:
        """Mark the job starting (committed, version-checked: a concurrent cancel
        wins), then launch it."""
        if not job.checkpoint_path:  # queued before checkpoints were placed at submit
            tenant = store.tenant_names(session, {job.tenant_id})[job.tenant_id]
            base = checkpoint_base(self.settings, tenant)
            job.checkpoint_path = checkpoint_path(base, job.id, spec.checkpoint.dir)
        store.set_status(session, job, JobState.STARTING, "admitted", "placing ranks on Ray")
        try:
            self._commit(session)  # fenced: the launch below follows a write of the lease's
        except StaleDataError:
            session.rollback()
            return False
        if self.metrics is not None:
            self.metrics.queue_wait.observe((utcnow() - job.created_at).total_seconds())
        return self._launch(session, job, spec)

    def _launch(self, session: Session, job: Job, spec: JobSpec) -> bool:
        """Start (or find: launching is idempotent) the job's supervisor; a job that
        cannot launch fails with the reason, and admission goes on."""
        try:
            self.backend.launch(job.id, spec, job.checkpoint_path)
        except Exception as exc:
            log.warning("job %s: launch failed", job.id, exc_info=True)
            text = str(exc).splitlines()[0][:300] if str(exc) else ""
            store.set_status(
                session, job, JobState.FAILED, "launch_failed", f"{type(exc).__name__}: {text}"
            )
            self._commit(session)
            return False
        return True

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
