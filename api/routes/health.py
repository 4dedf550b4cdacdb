"""Liveness and readiness (no token), and the control plane's Prometheus metrics (the
metrics token or an admin's, where the service has a metrics token)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from ..deps import MetricsReader, ServiceDep, SessionDep
from ..responses import ANY_REQUEST, errors

log = logging.getLogger(__name__)
router = APIRouter(tags=["health"], responses=errors(*ANY_REQUEST))


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """On the event loop itself: it answers while every request thread is busy."""
    return {"status": "ok"}


@router.get("/readyz")
def readyz(service: ServiceDep, db: SessionDep) -> JSONResponse:
    """200 when the store and the cluster answer and the scheduler runs; 503 with the
    problems otherwise. Also this replica's scheduling role. Anyone may ask, so a
    problem is named by its kind only (an error's text can carry addresses, users and
    SQL); the service's log has the whole error."""
    problems = []
    try:
        db.execute(text("SELECT 1"))
    except Exception as exc:
        problems.append(f"database: {type(exc).__name__}")
    scheduler = service.scheduler
    if service.start_scheduler and not scheduler.alive:
        problems.append("scheduler: not running")
    if scheduler.last_error:
        problems.append(f"scheduler: {scheduler.last_error}")
    try:
        service.backend.capacity()
    except Exception as exc:
        log.warning("readiness: the cluster does not answer: %s", exc)
        problems.append(f"cluster: {type(exc).__name__}")
    body = {
        "status": "ready" if not problems else "not ready",
        "problems": problems,
        "scheduler": "leader" if scheduler.leader else "standby",
    }
    return JSONResponse(body, status_code=200 if not problems else 503)


@router.get(
    "/metrics",
    response_class=Response,
    dependencies=[MetricsReader],
    # The token is asked for only where the service has a metrics token: optional here.
    openapi_extra={"security": [{}]},
    responses={
        200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text"},
        **errors(401, 403, 429),
    },
)
def metrics(service: ServiceDep) -> Response:
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)
