"""The memory plan of a job, without storing anything."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from sqlalchemy.orm import Session

from workers.spec import JobSpec

from .. import quota
from ..deps import CurrentPrincipal, ServiceDep, SessionDep
from ..errors import Rejected
from ..responses import AUTHENTICATED, errors
from ..schemas import PlanRequest
from ..service import Service

router = APIRouter(prefix="/v1/plan", tags=["plan"], responses=errors(*AUTHENTICATED))


@router.post("")
def plan(
    body: PlanRequest, service: ServiceDep, db: SessionDep, who: CurrentPrincipal
) -> dict[str, Any]:
    """The memory plan; 422 where a submission of the spec would be refused for good
    (its model, its memory, the cluster's size, the tenant's quotas)."""
    # The checks that cost nothing come first: a model is built (on the cluster) and
    # auto searched only for a spec that could run; the resolved spec is checked again.
    _admissible(db, who.tenant_id, body.spec, service)
    spec, plan = service.confined_plan(body.spec, who.tenant, body.device_memory_gib, False)
    _admissible(db, who.tenant_id, spec, service)
    return plan


def _admissible(db: Session, tenant_id: int, spec: JobSpec, service: Service) -> None:
    try:
        quota.check_admissible(db, tenant_id, spec, service.settings)
    except quota.OverLimit as over:
        raise Rejected(over.status, str(over)) from None
