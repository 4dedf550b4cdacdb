"""Start a supervised job on Ray, or find one again (from any process of the cluster)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray

from .messages import Succession
from .ray_group import reap as reap_ranks
from .spec import JobSpec
from .supervisor import NAMESPACE, JobSupervisor, supervisor_name


def launch(
    job_id: str,
    spec: JobSpec,
    checkpoint_root: str | Path,
    succession: Succession | None = None,
) -> Any:
    """Create the job's detached supervisor (or find it: launching twice is harmless)
    and start it; returns its actor handle. ``succession``: this supervisor replaces a
    lost one (see [Note: supervised supervisor] in api/scheduler.py).

    The supervisor takes no CPU and lives on the head node, the one node whose loss
    ends the cluster anyway: losing a worker node must never take a job's supervisor
    with it."""
    remote = ray.remote(JobSupervisor)
    handle = remote.options(
        name=supervisor_name(job_id),
        namespace=NAMESPACE,
        lifetime="detached",
        num_cpus=0,
        resources={"node:__internal_head__": 0.001},
        max_concurrency=16,
        max_restarts=0,
        get_if_exists=True,
    ).remote(job_id, spec.model_dump_json(), str(checkpoint_root), succession)
    ray.get(handle.start.remote())
    return handle


def attach(job_id: str) -> Any | None:
    """The running supervisor of ``job_id``, or None if it is gone."""
    try:
        return ray.get_actor(supervisor_name(job_id), namespace=NAMESPACE)
    except ValueError:
        return None


def stop(job_id: str, reason: str = "cancelled by request", timeout: float = 30.0) -> str | None:
    """Cancel the job, wait until its ranks are gone, then remove its supervisor."""
    handle = attach(job_id)
    if handle is None:
        return None
    ray.get(handle.cancel.remote(reason))
    status = ray.get(handle.wait.remote(timeout))
    ray.kill(handle, no_restart=True)
    reap(job_id)  # whatever its teardown did not reach within the timeout
    return status


def reap(job_id: str) -> int:
    """Remove the rank actors and placement groups a lost supervisor left (they are
    detached, so that a new supervisor can adopt them); returns the actors killed."""
    return reap_ranks(job_id)
