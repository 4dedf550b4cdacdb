"""The supervisor: one Ray actor per job that keeps it alive through failures and
changes of capacity.

[Note: supervised job]
The supervisor runs a loop in a thread of its own (its methods stay answerable):

    place    the largest group of min_dp..max_dp replicas Ray can place now
    start    one rank actor per rank; rank 0 picks address and port; all join the
             process group within the bootstrap timeout; each loads the newest valid
             checkpoint (resharded to the new N_d by the engine)
    train    in chunks up to the next checkpoint boundary, watching every rank's
             progress (workers/watchdog.py); then every rank saves
    grow     at a checkpoint boundary, if more replicas fit now (up to max_dp), tear
             down and start again larger from the checkpoint just written
    recover  a lost worker (actor died, node removed) or a stall: tear the group
             down and start again from the newest checkpoint on what can be placed
             now (down to min_dp); each such restart counts against max_restarts

Every transition is an event with a reason and a message; the control plane polls
``events()`` and stores them. The actor is detached and named, so it outlives the
process that started it and can be found again after that process restarts.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .cluster import actor_env
from .history import step_points
from .placement import Placement, bundle, place, replicas_available
from .rank import RankWorker
from .ring import Ring
from .spec import JobSpec
from .state import TERMINAL, JobState
from .tracking import Tracker
from .watchdog import diagnose

MAX_EVENTS = 10_000
MAX_LOG_LINES = 10_000
MAX_HISTORY = 10_000
MAX_LOSSES = 10_000
"""What a supervisor keeps in memory (the newest); the control plane keeps its own
copies under its own retention limits (docs/operations.md, "Retention")."""
NAMESPACE = "zeroservice"


def supervisor_name(job_id: str) -> str:
    return f"zeroservice-supervisor-{job_id}"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class _Outcome:
    kind: str
    """done, grow, lost, stalled, error, cancelled"""
    message: str = ""
    ranks: list[int] = field(default_factory=list)


@dataclass
class _Group:
    placement: Placement
    actors: list[Any]
    info: list[dict[str, Any]]
    addresses: list[dict[str, Any]]


class JobSupervisor:
    """See [Note: supervised job]."""

    def __init__(self, job_id: str, spec_json: str, checkpoint_root: str):
        self.job_id = job_id
        self.spec = JobSpec.model_validate_json(spec_json)
        self.spec_json = spec_json
        self.root = checkpoint_root
        self._lock = threading.RLock()
        self._status, self._reason, self._message = JobState.QUEUED, "submitted", ""
        self._events: Ring[dict[str, Any]] = Ring(MAX_EVENTS)
        self._log: Ring[str] = Ring(MAX_LOG_LINES)
        self._history: Ring[dict[str, Any]] = Ring(MAX_HISTORY)
        """One point per step (workers/history.py, [Note: step history])."""
        self._tracker = Tracker(job_id, self.spec, checkpoint_root, self._tracking_failed)
        self._losses: dict[int, float] = {}
        self._restarts = 0
        self._dp = 0
        self._step = 0
        self._started_at: str | None = None
        self._finished_at: str | None = None
        self._group: _Group | None = None
        self._rank_stats: dict[int, dict[str, Any]] = {}
        self._cancel = threading.Event()
        self._cancel_reason = "cancelled by request"
        self._thread: threading.Thread | None = None
        self._event("status", "submitted", "job accepted by its supervisor")

    # -- what the control plane calls ----------------------------------------------------
    def start(self) -> str:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
                self._thread.start()
        return self._status

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "job_id": self.job_id,
                "status": self._status,
                "reason": self._reason,
                "message": self._message,
                "dp": self._dp,
                "mp": self.spec.resources.mp,
                "workers": self._dp * self.spec.resources.mp,
                "step": self._step,
                "steps": self.spec.steps,
                "restarts": self._restarts,
                "events": self._events.total,
                "started_at": self._started_at,
                "finished_at": self._finished_at,
                "checkpoint_root": self.root,
            }

    def events(self, since: int = 0) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(e) for e in self._events.since(since)]

    def logs(self, since: int = 0) -> list[str]:
        """Progress lines (one per chunk of steps) and every event, time-stamped."""
        with self._lock:
            return self._log.since(since)

    def poll(
        self, events_since: int = 0, logs_since: int = 0, history_since: int = 0
    ) -> dict[str, Any]:
        """Everything the control plane syncs, in one call: what is new since the
        positions it has seen (``history_total``: the next history position)."""
        with self._lock:
            history_total = self._history.total
        return {
            "status": self.status(),
            "events": self.events(events_since),
            "logs": self.logs(logs_since),
            "metrics": self.metrics(),
            "history": self.history(history_since),
            "history_total": history_total,
            "targets": self.targets(),
        }

    def history(self, since: int = 0) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(h) for h in self._history.since(since)]

    def losses(self) -> dict[int, float]:
        with self._lock:
            return dict(self._losses)

    def ranks(self) -> list[dict[str, Any]]:
        """Each rank of the current group: address, pid, node, metrics endpoint."""
        with self._lock:
            group = self._group
            if group is None or not all(group.info):
                return []  # not started yet
            return [
                {**addr, **info, "rank": r}
                for r, (addr, info) in enumerate(zip(group.addresses, group.info, strict=True))
            ]

    def targets(self) -> list[dict[str, Any]]:
        """The current ranks' metrics endpoints in Prometheus' HTTP service-discovery
        format (labels identify the job; each rank's series carry their own labels)."""
        return [
            {"targets": [r["metrics"]], "labels": {"job_id": self.job_id}}
            for r in self.ranks()
            if r.get("metrics")
        ]

    def metrics(self) -> dict[str, Any]:
        """Recent per-rank stats (memory by kind, loss, step seconds, TFLOPS)."""
        with self._lock:
            return {str(r): dict(s) for r, s in self._rank_stats.items()}

    def cancel(self, reason: str = "cancelled by request") -> None:
        self._cancel_reason = reason
        self._cancel.set()

    def wait(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._status in TERMINAL:
                break
            time.sleep(0.2)
        return self._status

    # -- bookkeeping -----------------------------------------------------------------------
    def _line(self, text: str) -> None:
        with self._lock:
            self._log.append(f"{_now()} {text}")

    def _event(self, kind: str, reason: str, message: str, **extra: Any) -> None:
        self._line(f"[{kind}/{reason}] {message}")
        with self._lock:
            self._events.append(
                {
                    "seq": self._events.total,
                    "time": _now(),
                    "kind": kind,
                    "reason": reason,
                    "message": message,
                    "dp": self._dp,
                    "step": self._step,
                    **extra,
                }
            )

    def _set(self, status: JobState, reason: str, message: str) -> None:
        with self._lock:
            changed = status != self._status
            self._status, self._reason, self._message = status, reason, message
            if status == JobState.RUNNING and self._started_at is None:
                self._started_at = _now()
            if status in TERMINAL:
                self._finished_at = _now()
        if changed:
            self._event("status", reason, f"{status}: {message}", status=status)

    # -- the loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except Exception:
            self._teardown(clean=False)
            self._set(JobState.FAILED, "internal_error", traceback.format_exc(limit=8))
        finally:
            self._tracker.close(self._status)

    def _tracking_failed(self, sink: str, message: str) -> None:
        self._event("tracking", "failed", f"{sink} switched off: {message}", sink=sink)

    def _loop(self) -> None:
        spec, res = self.spec, self.spec.resources
        self._set(
            JobState.STARTING,
            "placing",
            f"asking Ray for {res.lowest_dp}-{res.highest_dp} replicas",
        )
        while True:
            if self._cancel.is_set():
                return self._finish_cancelled()
            placement = place(
                self.job_id, res, res.lowest_dp, res.highest_dp, spec.timeouts.bootstrap_s
            )
            if placement is None:
                self._set(
                    JobState.FAILED,
                    "insufficient_resources",
                    f"no room for {res.lowest_dp} replica(s) of {bundle(res)} each within "
                    f"{spec.timeouts.bootstrap_s:g} s (free now: {ray.available_resources()})",
                )
                return
            previous = self._dp
            with self._lock:
                self._dp = placement.dp
            if previous and previous != placement.dp:
                self._event(
                    "resize",
                    "shrunk" if placement.dp < previous else "grown",
                    f"data-parallel degree {previous} -> {placement.dp}",
                    dp_from=previous,
                )
            try:
                group = self._start_group(placement)
            except _Failed as failure:
                placement.remove()
                if self._count_restart("bootstrap_failed", failure.message):
                    continue
                return
            outcome = self._train(group)
            if outcome.kind == "done":
                self._teardown(clean=True)
                self._set(JobState.SUCCEEDED, "completed", f"{spec.steps} steps")
                return
            self._teardown(clean=False)
            if outcome.kind == "cancelled":
                return self._finish_cancelled()
            if outcome.kind == "error":
                self._set(JobState.FAILED, "training_error", outcome.message)
                return
            if outcome.kind == "grow":
                self._set(JobState.RESIZING, "capacity_returned", outcome.message)
                continue
            reason = "worker_lost" if outcome.kind == "lost" else "stalled"
            if not self._count_restart(reason, outcome.message, ranks=outcome.ranks):
                return

    def _count_restart(self, reason: str, message: str, ranks: list[int] | None = None) -> bool:
        """Record a restart; False (and the job failed) when the budget is spent."""
        with self._lock:
            self._restarts += 1
            restarts = self._restarts
        self._event("restart", reason, message, ranks=ranks or [], restarts=restarts)
        if restarts > self.spec.max_restarts:
            self._set(
                JobState.FAILED,
                reason,
                f"{message} (restart budget of {self.spec.max_restarts} spent)",
            )
            return False
        self._set(JobState.RESIZING, reason, f"restarting from the newest checkpoint: {message}")
        return True

    def _finish_cancelled(self) -> None:
        self._teardown(clean=False)
        self._set(JobState.CANCELLED, "cancelled", self._cancel_reason)

    # -- groups -----------------------------------------------------------------------------
    def _start_group(self, placement: Placement) -> _Group:
        spec, res = self.spec, self.spec.resources
        world = placement.dp * res.mp
        remote = ray.remote(RankWorker)
        actors = [
            remote.options(
                num_cpus=res.cpus_per_rank,
                num_gpus=res.gpus_per_rank,
                max_concurrency=4,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=placement.group,
                    placement_group_bundle_index=r // res.mp,
                ),
                runtime_env={"env_vars": actor_env()},
            ).remote(self.job_id, r, self.spec_json)
            for r in range(world)
        ]
        self._group = _Group(placement, actors, [{} for _ in actors], [{} for _ in actors])
        timeout = spec.timeouts.bootstrap_s
        try:
            addresses = ray.get([a.address.remote() for a in actors], timeout=timeout)
            port = ray.get(actors[0].free_port.remote(), timeout=timeout)
            master = addresses[0]["ip"]
            Path(self.root).mkdir(parents=True, exist_ok=True)
            info = ray.get(
                [
                    a.setup.remote(
                        master,
                        port,
                        world,
                        self.root,
                        self._restarts,
                        f"{addr['ip']}/{addr['node_id'][:8]}",
                    )
                    for a, addr in zip(actors, addresses, strict=True)
                ],
                timeout=timeout,
            )
        except (GetTimeoutError, RayActorError, RayTaskError) as exc:
            self._teardown(clean=False)
            raise _Failed(f"starting {world} ranks failed: {_short(exc)}") from None
        with self._lock:
            self._group = _Group(placement, actors, info, addresses)
            self._step = info[0]["start_step"]
        loaded = info[0]["loaded"]
        self._event(
            "placed",
            "started",
            f"{world} ranks (dp {placement.dp} × mp {res.mp}) from "
            + (f"checkpoint {loaded} at step {self._step}" if loaded else "scratch"),
            from_checkpoint=loaded,
            ranks=[
                {"rank": r, "node": f"{a['ip']}/{a['node_id'][:8]}", "gpus": a["gpus"]}
                for r, a in enumerate(addresses)
            ],
        )
        self._set(JobState.RUNNING, "training", f"dp {placement.dp} × mp {res.mp}")
        return self._group

    def _teardown(self, clean: bool) -> None:
        group, self._group = self._group, None
        if group is None:
            return
        if clean:
            with contextlib.suppress(Exception):
                ray.get([a.close.remote() for a in group.actors], timeout=30)
        for actor in group.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        group.placement.remove()

    # -- training and watching ------------------------------------------------------------
    def _train(self, group: _Group) -> _Outcome:
        spec = self.spec
        interval = spec.checkpoint.interval_steps
        step = self._step
        while step < spec.steps:
            target = min(spec.steps, (step // interval + 1) * interval)
            t0 = time.monotonic()
            outcome, results = self._watch(group, [a.train.remote(target) for a in group.actors])
            if outcome is not None:
                return outcome
            self._record(group, results)
            seconds = time.monotonic() - t0
            accum = spec.zero_config().gradient_accumulation_steps
            tokens = (target - step) * spec.micro_batch * accum * spec.model.seq_len * self._dp
            loss = self._losses.get(target, float("nan"))
            points = step_points(results, spec.resources.mp, self._dp)
            with self._lock:
                for point in points:
                    self._history.append(point)
            self._tracker.steps(points)
            self._line(
                f"step {target}/{spec.steps} loss {loss:.4f} "
                f"{tokens / seconds:,.0f} tokens/s dp {self._dp}"
            )
            step = target
            outcome, paths = self._watch(
                group, [a.save.remote(spec.checkpoint.keep) for a in group.actors]
            )
            if outcome is not None:
                return outcome
            with self._lock:
                self._step = step
            self._event("checkpoint", "saved", f"step {step}: {paths[0]}", path=paths[0])
            self._tracker.checkpoint(step, paths[0])
            if step < spec.steps and self._dp < spec.resources.highest_dp:
                more = min(spec.resources.highest_dp - self._dp, replicas_available(spec.resources))
                if more > 0:
                    return _Outcome(
                        "grow", f"room for {more} more replica(s): growing from the checkpoint"
                    )
        return _Outcome("done")

    def _record(self, group: _Group, results: list[dict[str, Any]]) -> None:
        mp = self.spec.resources.mp
        per_step: dict[int, list[float]] = {}
        for r, res in enumerate(results):
            if r % mp == 0:
                for s, loss in res["losses"].items():
                    per_step.setdefault(int(s), []).append(loss)
        with self._lock:
            for s, values in per_step.items():
                self._losses[s] = sum(values) / len(values)
            for s in sorted(self._losses)[: max(0, len(self._losses) - MAX_LOSSES)]:
                del self._losses[s]
            for r, res in enumerate(results):
                self._rank_stats[r] = {
                    k: res[k]
                    for k in ("step", "ledger", "comm_volume_per_step", "tokens_per_second")
                    if k in res
                }
        try:
            stats = ray.get([a.stats.remote() for a in group.actors], timeout=10)
            with self._lock:
                for r, s in enumerate(stats):
                    self._rank_stats[r].update(s)
        except Exception:
            pass

    def _watch(self, group: _Group, refs: list[Any]) -> tuple[_Outcome | None, list[Any]]:
        """Wait for one call on every rank, polling progress. See workers/watchdog.py."""
        timeout = self.spec.timeouts.step_s
        poll = max(0.2, min(2.0, timeout / 4))
        pending = {ref: r for r, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        now = time.monotonic()
        last_change = dict.fromkeys(range(len(refs)), now)
        previous: dict[int, tuple] = {}
        last_seen: dict[int, dict] = {}
        while pending:
            if self._cancel.is_set():
                return _Outcome("cancelled"), results
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=poll)
            for ref in done:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except RayActorError as exc:
                    return self._lost(group, [rank], exc), results
                except RayTaskError as exc:
                    dead = self._dead(group)
                    if dead:
                        return self._lost(group, dead, exc), results
                    return _Outcome("error", f"rank {rank}: {_short(exc)}", [rank]), results
            if not pending:
                break
            waiting = sorted(pending.values())
            answers = self._progress(group, waiting)
            now = time.monotonic()
            for r, p in answers.items():
                if p is None:
                    continue
                last_seen[r] = p
                key = (p["step"], p["phase"], p["collectives"])
                if previous.get(r) != key:
                    previous[r], last_change[r] = key, now
            if any(now - last_change[r] > timeout for r in waiting):
                dead = self._dead(group)
                if dead:
                    return self._lost(group, dead, None), results
                stall = diagnose(answers, last_seen, timeout, describe=self._describe)
                return _Outcome("stalled", stall.message, stall.stalled), results
        return None, results

    def _progress(self, group: _Group, ranks: list[int]) -> dict[int, dict | None]:
        refs = {r: group.actors[r].progress.remote() for r in ranks}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=2.0)
        out: dict[int, dict | None] = {}
        for r, ref in refs.items():
            try:
                out[r] = ray.get(ref) if ref in ready else None
            except Exception:
                out[r] = None
        return out

    def _dead(self, group: _Group) -> list[int]:
        """Ranks whose actor is gone (a killed process, a removed node)."""
        refs = {r: a.progress.remote() for r, a in enumerate(group.actors)}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=2.0)
        dead = []
        for r, ref in refs.items():
            try:
                ray.get(ref, timeout=0.01)
            except RayActorError:
                dead.append(r)
            except Exception:
                pass
        return dead

    def _lost(self, group: _Group, ranks: list[int], exc: Exception | None) -> _Outcome:
        names = ", ".join(self._describe(r) for r in ranks)
        detail = f": {_short(exc)}" if exc is not None else ""
        return _Outcome("lost", f"lost {names}{detail}", ranks)

    def _describe(self, rank: int) -> str:
        mp = self.spec.resources.mp
        addr = self._group.addresses[rank] if self._group else {}
        node = f", node {addr.get('ip')}/{str(addr.get('node_id', ''))[:8]}" if addr else ""
        return f"rank {rank} (dp {rank // mp}, mp {rank % mp}{node})"


class _Failed(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def _short(exc: BaseException | None, limit: int = 600) -> str:
    if exc is None:
        return ""
    text = str(exc).strip().splitlines()
    tail = [line for line in text if line.strip()][-3:] if text else []
    out = " | ".join(tail) or type(exc).__name__
    return out[-limit:]
