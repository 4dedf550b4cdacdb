"""The memory plan of a job, without storing anything."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from .. import quota
from ..deps import CurrentPrincipal, ServiceDep, SessionDep
from ..errors import Rejected
from ..responses import AUTHENTICATED, errors
from ..schemas import PlanRequest

router = APIRouter(prefix="/v1/plan", tags=["plan"], responses=errors(*AUTHENTICATED))


@router.post("")
def plan(
    body: PlanRequest, service: ServiceDep, db: SessionDep, who: CurrentPrincipal
) -> dict[str, Any]:
    """The memory plan; 422 where a submission of the spec would be refused for good
    (its model, its memory, the cluster's size, the tenant's quotas)."""
    spec, plan = service.confined_plan(body.spec, who.tenant, body.device_memory_gib, False)
    try:
        quota.check_admissible(db, who.tenant_id, spec, service.settings)
    except quota.OverLimit as over:
        raise Rejected(over.status, str(over)) from None
    return plan
