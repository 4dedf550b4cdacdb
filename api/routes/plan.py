"""The memory plan of a job, without storing anything."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from ..deps import CurrentPrincipal, ServiceDep
from ..schemas import PlanRequest

router = APIRouter(prefix="/v1/plan", tags=["plan"])


@router.post("")
def plan(body: PlanRequest, service: ServiceDep, who: CurrentPrincipal) -> dict[str, Any]:
    return service.confined_plan(body.spec, who.tenant, body.device_memory_gib, False)[1]
