"""Placement: one placement group per job, one bundle per data-parallel replica.

[Note: placement]
A bundle always lands on one node, so making each bundle a whole model-parallel group
(``mp × cpus_per_rank`` CPUs, ``mp`` GPUs) packs every MP group on one node, where
its per-layer all-reduces stay on the fast links; the bundles use the SPREAD strategy,
so the DP replicas spread over nodes when they can (and share one when they must).
Rank ``d·mp + m`` is scheduled into bundle ``d``. GPU ranks ask for one GPU each and
Ray shows each only its own (CUDA_VISIBLE_DEVICES); CPU ranks ask for CPUs only.

How many replicas fit now is found by asking Ray, not by arithmetic over resources:
a group of ``dp`` bundles is created and given a short time to become ready; if it
does not, a smaller one is tried, down to ``min_dp``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from .spec import ResourcesSpec


def bundle(resources: ResourcesSpec) -> dict[str, float]:
    out = {"CPU": resources.mp * resources.cpus_per_rank}
    if resources.gpus_per_rank:
        out["GPU"] = float(resources.mp * resources.gpus_per_rank)
    return out


@dataclass
class Placement:
    group: PlacementGroup
    dp: int

    def remove(self) -> None:
        with contextlib.suppress(Exception):  # already gone with its cluster
            remove_placement_group(self.group)


def placement_name(job_id: str, dp: int) -> str:
    return f"{job_prefix(job_id)}{dp}"


def grow_placement_name(job_id: str, tag: str) -> str:
    """A placement taken to grow a running group (``RayWorkerPool.reserve``/``extend``)."""
    return f"{job_prefix(job_id)}grow-{tag}"


def job_prefix(job_id: str) -> str:
    """What every name of the job's placements starts with."""
    return f"zeroservice-{job_id}-"


def is_job_placement(job_id: str, name: str) -> bool:
    """The job's own placement or one taken to grow it."""
    prefix = job_prefix(job_id)
    rest = name[len(prefix) :] if name.startswith(prefix) else ""
    return rest.isdigit() or rest.startswith("grow-")


def replicas_available(resources: ResourcesSpec, free: dict[str, float] | None = None) -> int:
    """Upper bound on DP replicas the cluster's free resources (``free``, default Ray's
    now) could hold."""
    free = ray.available_resources() if free is None else free
    need = bundle(resources)
    fits = [int(free.get(k, 0.0) // v) for k, v in need.items() if v > 0]
    return min(fits) if fits else 0


def place(
    job_id: str,
    resources: ResourcesSpec,
    lowest: int,
    highest: int,
    wait_s: float,
    probe_s: float = 5.0,
    settle_s: float = 5.0,
    name: str | None = None,
    cancel: threading.Event | None = None,
) -> Placement | None:
    """The largest group of ``lowest..highest`` replicas Ray can place now (None: none).

    Resources a group just torn down held come back asynchronously, so the free
    resources are watched for up to ``settle_s`` while they allow fewer than
    ``highest`` replicas. Sizes above what they then allow are not tried; each size
    but the smallest gets ``probe_s`` to become ready, the smallest gets ``wait_s``.
    ``name``: the placement group's (default: by job and size). A set ``cancel`` ends
    the waits at once (None: the job was cancelled while it waited for room)."""
    free = replicas_available(resources)
    deadline = time.monotonic() + settle_s
    while free < highest and time.monotonic() < deadline:
        time.sleep(0.2)
        free = max(free, replicas_available(resources))
    start = min(highest, max(lowest, free))
    for dp in range(start, lowest - 1, -1):
        pg = placement_group(
            [bundle(resources)] * dp,
            strategy="SPREAD",
            name=name or placement_name(job_id, dp),
            lifetime="detached",  # outlives its supervisor: see [Note: supervised supervisor]
        )
        timeout = wait_s if dp == lowest else probe_s
        if _ready(pg, timeout, cancel):
            return Placement(pg, dp)
        remove_placement_group(pg)
        if cancel is not None and cancel.is_set():
            return None
        time.sleep(0.1)
    return None


def _ready(pg: Any, timeout: float, cancel: threading.Event | None) -> bool:
    """Whether ``pg`` became ready within ``timeout``, polling ``cancel`` each second."""
    deadline = time.monotonic() + timeout
    ref = pg.ready()
    while True:
        left = deadline - time.monotonic()
        ready, _ = ray.wait([ref], timeout=max(0.0, min(1.0, left)))
        if ready:
            return True
        if left <= 1.0 or (cancel is not None and cancel.is_set()):
            return False
