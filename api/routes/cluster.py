"""The cluster's capacity, and the ranks' metrics endpoints for Prometheus."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from workers.state import ACTIVE

from .. import store
from ..deps import CurrentPrincipal, ServiceDep, SessionDep, TargetsReader
from ..responses import AUTHENTICATED, errors
from ..schemas import ClusterOut

router = APIRouter(prefix="/v1", tags=["cluster"], responses=errors(*AUTHENTICATED))


@router.get("/cluster", response_model=ClusterOut)
def cluster(service: ServiceDep, who: CurrentPrincipal) -> ClusterOut:
    cap = service.backend.capacity()
    return ClusterOut(total=cap.total, free=cap.free, nodes=cap.nodes, requested=cap.requested)


@router.get("/targets")
def targets(service: ServiceDep, db: SessionDep, who: TargetsReader) -> list[dict[str, Any]]:
    """Prometheus HTTP service discovery: every active rank's metrics endpoint (of the
    caller's jobs; the metrics token's and an admin's: all)."""
    jobs = [
        job.id
        for job in store.jobs_in(db, ACTIVE)
        if who is None or who.admin or job.tenant_id == who.tenant_id
    ]
    found: list[dict[str, Any]] = []
    for snap in service.live_snapshots(jobs):
        found += (snap or {}).get("targets", [])
    return found
