"""The supervisor: one Ray actor per job that keeps it alive through failures and
changes of capacity.

The actor is the shell: it runs the job's state machine (workers/controller.py, see
[Note: supervised job]) in a thread of its own, so that its methods stay answerable,
and serves what the job's record holds (workers/job_record.py). It is detached and
named, so it outlives the process that started it and can be found again after that
process restarts.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from .controller import JobController
from .job_record import JobRecord

__all__ = ["NAMESPACE", "JobSupervisor", "supervisor_name"]
from .messages import JobSnapshot, Succession
from .ray_group import NAMESPACE, RayWorkerPool
from .spec import JobSpec
from .state import JobState
from .tracking import Tracker
from .worker_group import rank_rows


def supervisor_name(job_id: str) -> str:
    return f"zeroservice-supervisor-{job_id}"


class JobSupervisor:
    """See the module docstring."""

    def __init__(
        self,
        job_id: str,
        spec_json: str,
        checkpoint_root: str,
        succession: Succession | None = None,
    ):
        """``succession``: this supervisor replaces a lost one (see [Note: supervised
        supervisor] in api/scheduler.py)."""
        self.job_id = job_id
        self.spec = JobSpec.model_validate_json(spec_json)
        self.root = checkpoint_root
        res = self.spec.resources
        self.record = JobRecord(job_id, res.mp, self.spec.steps, checkpoint_root)
        pool = RayWorkerPool(job_id, self.spec, spec_json, checkpoint_root)
        tracker = Tracker(job_id, self.spec, checkpoint_root, self._tracking_failed)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if succession is None:
            self.record.event("status", "submitted", "job accepted by its supervisor")
        self.controller = JobController(
            self.spec, pool, self.record, succession=succession, tracker=tracker
        )

    def _tracking_failed(self, sink: str, message: str) -> None:
        self.record.event("tracking", "failed", f"{sink} switched off: {message}", sink=sink)

    # -- what the control plane calls ----------------------------------------------------
    def start(self) -> str:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self.controller.run, name="supervisor", daemon=True
                )
                self._thread.start()
        return self.record.status

    def status(self) -> dict[str, Any]:
        return self.record.snapshot_status().as_dict()

    def events(self, since: int = 0) -> list[dict[str, Any]]:
        return self.record.events_since(since)

    def logs(self, since: int = 0) -> list[str]:
        """Progress lines (one per chunk of steps) and every event, time-stamped."""
        return self.record.logs_since(since)

    def poll(
        self, events_since: int = 0, logs_since: int = 0, history_since: int = 0
    ) -> JobSnapshot:
        """Everything the control plane syncs, in one call: what is new since the
        positions it has seen."""
        self.record.mark_stored(history_since)
        with self.record.lock:  # one moment: the status's step comes with its events
            status = self.record.snapshot_status()
            events = self.events(events_since)
            logs = self.logs(logs_since)
            history, total = self.record.history_since(history_since)
        return JobSnapshot(
            status=status,
            events=events,
            logs=logs,
            metrics=self.metrics(),
            history=history,
            history_total=total,
            targets=self.targets(),
        )

    def history(self, since: int = 0) -> list[dict[str, Any]]:
        return self.record.history_since(since)[0]

    def losses(self) -> dict[int, float]:
        with self.record.lock:
            return dict(self.record.losses)

    def ranks(self) -> list[dict[str, Any]]:
        """Each rank of the current group: address, pid, node, metrics endpoint."""
        group = self.controller.group
        return [] if group is None else rank_rows(group)

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
        return self.record.metrics()

    def cancel(self, reason: str = "cancelled by request") -> None:
        self.controller.request_cancel(reason)

    def process_id(self) -> int:
        return os.getpid()

    def wait(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if JobState(self.record.status).is_terminal:
                break
            time.sleep(0.2)
        return self.record.status
