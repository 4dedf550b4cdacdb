"""What the control plane asks of the cluster: capacity, launch, poll, cancel, and the
autoscaler's requests. ``RayBackend`` is the real one; tests also use a fake."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from workers.messages import Succession
from workers.spec import JobSpec
from zeroservice.checkpoint.storage import is_uri

from .claims import Claims
from .cluster_link import ClusterLink


@dataclass
class Capacity:
    total: dict[str, float]
    free: dict[str, float]
    nodes: int
    requested: list[dict[str, float]] = field(default_factory=list)


class SupervisorSilent(TimeoutError):
    """A job's supervisor exists but did not answer a poll in time (its process stopped,
    hung, or slow): not the same as gone, nor as the cluster being out of reach."""


class Backend(Protocol):
    def capacity(self) -> Capacity: ...

    def fits(self, spec: JobSpec) -> bool:
        """Whether the job's smallest size (min_dp replicas) fits the free resources."""
        ...

    def launch(
        self,
        job_id: str,
        spec: JobSpec,
        checkpoint_root: str,
        succession: Succession | None = None,
    ) -> None:
        """Start the job's supervisor (or find it). ``succession``: a new supervisor
        for a job whose supervisor was lost (see [Note: supervised supervisor] in
        api/scheduler.py)."""
        ...

    def count_parameters(self, spec: JobSpec, timeout_s: float, memory_bytes: int) -> int:
        """The model's trainable parameters, counted on a worker (never in this process);
        workers.model_size.ModelNotBuildable when it cannot be built within the bounds."""
        ...

    def poll(
        self,
        job_id: str,
        events_since: int,
        logs_since: int,
        history_since: int,
        timeout_s: float = 30.0,
    ) -> dict[str, Any] | None:
        """The supervisor's status, new events, log lines and history chunks (after the
        positions given), metrics; None if it is gone; SupervisorSilent if it did not
        answer within ``timeout_s``."""
        ...

    def stop_supervisor(self, job_id: str) -> None:
        """End the job's supervisor process, leaving its ranks running (a successor
        adopts them)."""
        ...

    def cancel(self, job_id: str, reason: str, timeout_s: float = 30.0) -> None:
        """Ask the job's supervisor to stop (nothing when there is none);
        SupervisorSilent if it did not take the request within ``timeout_s``."""
        ...

    def request_resources(self, bundles: list[dict[str, float]]) -> None:
        """Tell the autoscaler what the queue needs ([] withdraws the request)."""
        ...


def _answer(ref: Any, timeout_s: float, who: str, what: str) -> Any:
    """A supervisor's answer to a call (``ray.get``); SupervisorSilent after
    ``timeout_s``."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        raise SupervisorSilent(f"{who} did not {what} within {timeout_s:g} s") from None


def job_bundles(spec: JobSpec) -> list[dict[str, float]]:
    """The bundles of the job's smallest size: min_dp replicas of one MP group."""
    from workers.placement import bundle

    return [bundle(spec.resources)] * spec.resources.lowest_dp


def _placed(jobs: list[str]) -> set[str]:
    """The jobs among ``jobs`` whose own placement group (not one taken to grow) is
    created."""
    from ray.util import placement_group_table

    from workers.placement import job_prefix

    out = set()
    for info in placement_group_table().values():
        if info.get("state") != "CREATED":
            continue
        name = info.get("name", "")
        for job_id in jobs:
            prefix = job_prefix(job_id)
            if name.startswith(prefix) and name[len(prefix) :].isdigit():
                out.add(job_id)
    return out


class RayBackend:
    """Drives workers.jobs on the Ray cluster this process is connected to; with a
    ``link``, every call first makes sure the cluster answers (api/cluster_link.py)."""

    def __init__(self, link: ClusterLink | None = None) -> None:
        self.requested: list[dict[str, float]] = []
        self.link = link
        self.claims = Claims()
        """What launched jobs not yet placed will take (see [Note: claims of admitted
        jobs] in api/claims.py)."""

    def _ensure(self) -> None:
        if self.link is not None:
            self.link.ensure()

    def capacity(self) -> Capacity:
        self._ensure()
        import ray

        nodes = [n for n in ray.nodes() if n.get("Alive")]
        return Capacity(
            dict(ray.cluster_resources()),
            dict(ray.available_resources()),
            len(nodes),
            list(self.requested),
        )

    def fits(self, spec: JobSpec) -> bool:
        self._ensure()
        import ray

        from workers.placement import replicas_available

        free = dict(ray.available_resources())
        if self.claims.jobs:
            free = self.claims.unclaimed(free, _placed(self.claims.jobs))
        return replicas_available(spec.resources, free) >= spec.resources.lowest_dp

    def launch(
        self,
        job_id: str,
        spec: JobSpec,
        checkpoint_root: str,
        succession: Succession | None = None,
    ) -> None:
        self._ensure()
        from workers.jobs import launch

        if not is_uri(checkpoint_root):  # an s3:// prefix needs no directory
            Path(checkpoint_root).mkdir(parents=True, exist_ok=True)
        launch(job_id, spec, checkpoint_root, succession)
        self.claims.claim(job_id, job_bundles(spec))

    def count_parameters(self, spec: JobSpec, timeout_s: float, memory_bytes: int) -> int:
        self._ensure()
        from workers.model_size import count_on_worker

        return count_on_worker(spec, timeout_s, memory_bytes)

    def poll(
        self,
        job_id: str,
        events_since: int,
        logs_since: int,
        history_since: int,
        timeout_s: float = 30.0,
    ) -> dict[str, Any] | None:
        self._ensure()
        from workers.jobs import attach

        handle = attach(job_id)
        if handle is None:
            return None
        # A timeout raises: the supervisor is slow or stopped, not gone (the scheduler
        # replaces one that stays silent). So does RayActorError: it died, but while its
        # name is still registered a new supervisor could not take it; the next poll
        # finds the name free (None).
        ref = handle.poll.remote(events_since, logs_since, history_since)
        snap = _answer(ref, timeout_s, f"the supervisor of job {job_id}", "answer a poll")
        return snap.as_dict()  # a workers.messages.JobSnapshot

    def stop_supervisor(self, job_id: str) -> None:
        self._ensure()
        import ray

        from workers.jobs import attach

        handle = attach(job_id)
        if handle is not None:  # its process is killed: a stopped one too
            ray.kill(handle, no_restart=True)

    def cancel(self, job_id: str, reason: str, timeout_s: float = 30.0) -> None:
        self._ensure()
        from workers.jobs import attach

        handle = attach(job_id)
        if handle is not None:
            ref = handle.cancel.remote(reason)
            _answer(ref, timeout_s, f"the supervisor of job {job_id}", "take the cancel")

    def forget(self, job_id: str) -> None:
        """Remove a finished job's supervisor (its state is in the store by now)."""
        self._ensure()
        import ray

        from workers.jobs import attach

        handle = attach(job_id)
        if handle is not None:
            ray.kill(handle, no_restart=True)
        self.reap(job_id)

    def reap(self, job_id: str) -> None:
        """Remove what a lost supervisor left running (its ranks are detached)."""
        self.claims.release(job_id)
        self._ensure()
        from workers.jobs import reap

        reap(job_id)

    def request_resources(self, bundles: list[dict[str, float]]) -> None:
        self._ensure()
        from ray.autoscaler.sdk import request_resources

        if bundles == self.requested:
            return
        request_resources(bundles=bundles)
        self.requested = list(bundles)
