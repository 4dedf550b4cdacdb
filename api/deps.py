"""The routes' dependencies, as ``Annotated`` aliases: the service, a store session, the
caller (authenticated, rate-limited) and an admin caller, and a job the caller may see."""

from __future__ import annotations

import hmac
import math
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi import Path as PathParam
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from . import store
from .auth import Principal
from .auth_gate import PRINCIPAL
from .db import Job
from .service import Service


def get_service(request: Request) -> Service:
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(get_service)]


def get_session(service: ServiceDep) -> Iterator[Session]:
    with service.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def get_bearer(
    credentials: Annotated[
        HTTPAuthorizationCredentials | None, Depends(HTTPBearer(auto_error=False))
    ],
) -> str | None:
    """The request's bearer token (None: no ``Authorization: Bearer`` header). Read
    through FastAPI's ``HTTPBearer``, so the OpenAPI schema declares the scheme."""
    if credentials is None:
        return None
    return credentials.credentials.strip() or None


BearerToken = Annotated[str | None, Depends(get_bearer)]


def get_principal(
    request: Request, service: ServiceDep, db: SessionDep, token: BearerToken
) -> Principal:
    """The caller of a bearer token: 401 without a valid one, 429 over its rate. A
    request with a body was authenticated before it was read (api/auth_gate.py)."""
    who = getattr(request.state, PRINCIPAL, None)
    if who is None and token:
        who = store.authenticate(db, token)
    if who is None:
        raise HTTPException(
            401, "missing or invalid bearer token", headers={"WWW-Authenticate": "Bearer"}
        )
    wait = service.rate.wait_s(who.token_id)
    if wait > 0:
        limit = f"{service.settings.rate_per_s:g}/s, burst {service.settings.rate_burst}"
        raise HTTPException(
            429,
            f"rate: this token's limit ({limit}) is reached",
            headers={"Retry-After": str(max(1, math.ceil(wait)))},
        )
    return who


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]


def get_admin(who: CurrentPrincipal) -> Principal:
    if not who.admin:
        raise HTTPException(403, "an admin token is required")
    return who


AdminPrincipal = Annotated[Principal, Depends(get_admin)]


def get_targets_reader(
    request: Request, service: ServiceDep, db: SessionDep, token: BearerToken
) -> Principal | None:
    """The caller of the Prometheus discovery route: the read-only metrics token (None:
    it sees every job's targets and can call nothing else) or any caller."""
    metrics = service.settings.metrics_token
    if token and metrics and hmac.compare_digest(token.encode(), metrics.encode()):
        return None
    return get_principal(request, service, db, token)


TargetsReader = Annotated[Principal | None, Depends(get_targets_reader)]


def check_metrics_reader(
    request: Request, service: ServiceDep, db: SessionDep, token: BearerToken
) -> None:
    """The control plane's own metrics name every tenant's active jobs (their ids and
    ranks): where the service has a metrics token (every deployment in deploy/ sets
    one), only it and an admin token read them; without one (a local stack) anyone
    that reaches the port does."""
    metrics = service.settings.metrics_token
    if metrics is None:
        return
    if token and hmac.compare_digest(token.encode(), metrics.encode()):
        return
    get_admin(get_principal(request, service, db, token))


MetricsReader = Depends(check_metrics_reader)

JobId = Annotated[str, PathParam(min_length=1, max_length=64)]


def job_or_404(db: Session, who: Principal, job_id: str) -> Job:
    """The job, if the caller may see it; another tenant's answers 404 like a missing one."""
    job = store.get_job(db, who, job_id)
    if job is None:
        raise HTTPException(404, f"job {job_id} not found")
    return job
