"""A cluster stand-in for route and scheduler tests: it records what it is asked and
plays supervisors whose status the test moves along."""

from __future__ import annotations

import threading
from typing import Any

from api.backend import Capacity, SupervisorSilent
from workers.messages import Succession
from workers.placement import bundle
from workers.spec import JobSpec


def point(step: int, loss: float) -> dict[str, Any]:
    """A history point as the supervisor makes it (workers.history.step_points)."""
    return {
        "step": step,
        "steps": 1,
        "loss": loss,
        "grad_norm": 1.0 / step,
        "loss_scale": 1.0,
        "lr": 1e-3 * min(1.0, step / 10),
        "step_seconds": 0.5,
        "tokens_per_second": 100.0 + step,
        "memory_peak_bytes": 2**20 * step,
        "dp": 1,
    }


class FakeBackend:
    def __init__(self, cpus: float = 8.0):
        self.total = {"CPU": cpus, "GPU": 0.0}
        self.used = 0.0
        self.jobs: dict[str, dict[str, Any]] = {}
        self.launched: list[str] = []
        self.replaced: list[tuple[str, int]] = []
        self.successions: list[Succession] = []
        """What each replacing supervisor was told."""
        """(job, restarts) of every supervisor started in place of a lost one."""
        self.cancelled: list[str] = []
        self.requests: list[list[dict[str, float]]] = []
        self.requested: list[dict[str, float]] = []
        self.counted: list[JobSpec] = []
        self.refuse_launch: set[str] = set()
        """Jobs whose launch raises (a supervisor that cannot start)."""
        self.missed: set[str] = set()
        """Jobs whose supervisor misses the next cancel (it was not there yet)."""
        self.slow: set[str] = set()
        """Jobs whose supervisor does not answer a poll in time."""
        self.history_asked: list[int] = []
        """``history_since`` of every poll, in order."""
        self.poll_timeouts: list[float] = []
        self.together: threading.Barrier | None = None
        """When set, every poll waits at it: a tick's polls pass only if they were all
        in flight at once."""
        self.reaped: list[str] = []
        """Jobs whose leftovers were removed, in order."""
        self.stopped: list[str] = []
        """Jobs whose silent supervisor the scheduler stopped, in order."""
        self.lock = threading.Lock()

    def capacity(self) -> Capacity:
        free = {"CPU": self.total["CPU"] - self.used, "GPU": 0.0}
        return Capacity(dict(self.total), free, 1, list(self.requested))

    def fits(self, spec: JobSpec) -> bool:
        need = bundle(spec.resources)["CPU"] * spec.resources.lowest_dp
        return need <= self.total["CPU"] - self.used

    def launch(
        self,
        job_id: str,
        spec: JobSpec,
        checkpoint_root: str,
        succession: Succession | None = None,
    ) -> None:
        if job_id in self.refuse_launch:
            raise PermissionError(f"cannot create {checkpoint_root}")
        with self.lock:
            if job_id in self.jobs:
                return  # launching is idempotent: the job's supervisor exists
            self.launched.append(job_id)
            if succession is not None:
                self.replaced.append((job_id, succession.restarts))
                self.successions.append(succession)
            restarts = None if succession is None else succession.restarts
            cpus = bundle(spec.resources)["CPU"] * spec.resources.lowest_dp
            self.used += cpus
            self.jobs[job_id] = {
                "cpus": cpus,
                "spec": spec,
                "status": {
                    "status": "starting" if restarts is None else "resizing",
                    "reason": "placing" if restarts is None else "supervisor_lost",
                    "message": "placing",
                    "dp": spec.resources.lowest_dp,
                    "step": 0,
                    "restarts": restarts or 0,
                    "checkpoint_root": checkpoint_root,
                },
                "events": [],
                "logs": [],
                "metrics": {},
                "history": [],
                "targets": [],
            }

    def count_parameters(self, spec: JobSpec, timeout_s: float, memory_bytes: int) -> int:
        """What a worker would do (this process stands for the cluster here)."""
        from workers.model_size import count_parameters

        self.counted.append(spec)
        return count_parameters(spec)

    def reap(self, job_id: str) -> None:
        """Remove what a lost supervisor left running (no ranks are modelled here)."""
        self.reaped.append(job_id)

    def stop_supervisor(self, job_id: str) -> None:
        """Kill a silent supervisor's process: it answers no more polls (None), and its
        ranks would go on running."""
        with self.lock:
            self.stopped.append(job_id)
            self.slow.discard(job_id)
            if job_id in self.jobs:
                self.used -= self.jobs.pop(job_id)["cpus"]

    def lose_supervisor(self, job_id: str) -> None:
        """The supervisor's process dies (its ranks with it)."""
        with self.lock:
            self.used -= self.jobs.pop(job_id)["cpus"]

    def move(self, job_id: str, status: str, reason: str = "", step: int = 0, **extra) -> None:
        """What the job's supervisor would do: a status change, its event and a log line."""
        with self.lock:
            job = self.jobs[job_id]
            job["status"].update(status=status, reason=reason or status, message=status, step=step)
            job["status"].update(extra)
            job["events"].append(
                {"kind": "status", "reason": reason or status, "message": f"{status}", "step": step}
            )
            job["logs"].append(f"step {step}/10 loss 1.0000 100 tokens/s dp 1")
            if status in ("succeeded", "failed", "cancelled"):
                self.used -= job["cpus"]

    def saved(self, job_id: str, step: int) -> None:
        """A checkpoint committed, as the supervisor reports it."""
        with self.lock:
            self.jobs[job_id]["events"].append(
                {
                    "kind": "checkpoint",
                    "reason": "saved",
                    "message": f"step {step}: /ckpt/step-{step:08d}",
                    "step": step,
                    "path": f"/ckpt/step-{step:08d}",
                }
            )

    def chunk(self, job_id: str, step: int, loss: float) -> None:
        """One step done, as the supervisor appends its point to the job's history."""
        self.steps(job_id, [(step, loss)])

    def steps(self, job_id: str, losses: list[tuple[int, float]]) -> None:
        """Steps done (step, loss), as the supervisor appends their points (workers/
        history.py) to the job's history; the other values follow from the step."""
        with self.lock:
            for step, loss in losses:
                self.jobs[job_id]["history"].append(point(step, loss))

    def poll(
        self,
        job_id: str,
        events_since: int,
        logs_since: int,
        history_since: int = 0,
        timeout_s: float = 30.0,
    ) -> dict[str, Any] | None:
        self.poll_timeouts.append(timeout_s)
        together = self.together
        if together is not None:  # answered only once all are asked (or it breaks)
            together.wait()
        if job_id in self.slow:
            raise SupervisorSilent(f"the supervisor did not answer within {timeout_s:g} s")
        with self.lock:
            self.history_asked.append(history_since)
            job = self.jobs.get(job_id)
            if job is None:
                return None
            return {
                "status": dict(job["status"]),
                "events": job["events"][events_since:],
                "logs": job["logs"][logs_since:],
                "metrics": job["metrics"],
                "history": job["history"][history_since:],
                "history_total": len(job["history"]),
                "targets": job["targets"],
            }

    def cancel(self, job_id: str, reason: str, timeout_s: float = 30.0) -> None:
        """As RayBackend's: nothing when the job has no supervisor; one in ``missed``
        lets this cancel pass (it raced a relaunch) and hears the next; one in ``slow``
        does not answer."""
        self.cancelled.append(job_id)
        if job_id not in self.jobs:
            return
        if job_id in self.slow:
            raise SupervisorSilent(f"the supervisor did not take the cancel in {timeout_s:g} s")
        if job_id in self.missed:
            self.missed.discard(job_id)
            return
        self.move(job_id, "cancelled", "cancelled")

    def request_resources(self, bundles: list[dict[str, float]]) -> None:
        self.requests.append(list(bundles))
        self.requested = list(bundles)
