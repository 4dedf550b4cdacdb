"""Tenants, their limits and their tokens: admin tokens only."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query
from fastapi import Path as PathParam
from sqlalchemy.orm import Session

from .. import store
from ..auth import Principal
from ..db import ApiToken, utcnow
from ..deps import AdminPrincipal, ServiceDep, SessionDep
from ..responses import AUTHENTICATED, errors
from ..schemas import TenantCreate, TenantLimits, TokenCreate, TokenInfo, TokenOut, TokenRevoke
from ..service import MAX_ID

router = APIRouter(prefix="/v1", tags=["admin"], responses=errors(*AUTHENTICATED, 403))


def token_info(row: ApiToken, tenant: str) -> TokenInfo:
    return TokenInfo(
        id=row.id,
        tenant=tenant,
        admin=row.admin,
        name=row.name,
        prefix=row.prefix,
        created_at=row.created_at,
        expires_at=row.expires_at,
        revoked_at=row.revoked_at,
    )


@router.post("/tenants", status_code=201, responses=errors(409))
def create_tenant(body: TenantCreate, db: SessionDep, who: AdminPrincipal) -> dict[str, Any]:
    try:
        tenant = store.create_tenant(db, body.name)
    except store.Conflict as exc:
        raise HTTPException(409, str(exc)) from None
    return {"id": tenant.id, "name": tenant.name}


@router.put("/tenants/{name}/limits", response_model=TenantLimits, responses=errors(404))
def set_limits(
    name: Annotated[str, PathParam(max_length=128)],
    body: TenantLimits,
    db: SessionDep,
    who: AdminPrincipal,
) -> TenantLimits:
    tenant = store.tenant_by_name(db, name)
    if tenant is None:
        raise HTTPException(404, f"tenant {name!r} not found")
    store.set_limits(db, tenant, **body.model_dump())
    return body


@router.post("/tokens", status_code=201, response_model=TokenOut, responses=errors(404))
def create_token(
    body: TokenCreate, service: ServiceDep, db: SessionDep, who: AdminPrincipal
) -> TokenOut:
    tenant = store.tenant_by_name(db, body.tenant)
    if tenant is None:
        raise HTTPException(404, f"tenant {body.tenant!r} not found")
    days = body.expires_in_days or service.settings.token_ttl_days
    expires = utcnow() + timedelta(days=days)
    token, row = store.create_token(db, tenant, body.admin, body.name, expires)
    return TokenOut(token=token, **token_info(row, tenant.name).model_dump())


@router.get("/tokens", response_model=list[TokenInfo])
def list_tokens(
    db: SessionDep,
    who: AdminPrincipal,
    tenant: Annotated[str | None, Query(max_length=128)] = None,
) -> list[TokenInfo]:
    return [token_info(row, name) for row, name in store.list_tokens(db, tenant)]


# ``:int``: only a number is a token id, so DELETE /v1/tokens/revoke is a method the
# revoke route does not allow (405), not a malformed id.
@router.delete("/tokens/{token_id:int}", responses=errors(404, 409))
def revoke_token_by_id(
    token_id: Annotated[int, PathParam(ge=1, le=MAX_ID)], db: SessionDep, who: AdminPrincipal
) -> dict[str, int]:
    return {"revoked": _revoked_or_404(store.revoke_token_by_id, token_id, db, who)}


@router.post("/tokens/revoke", responses=errors(404, 409))
def revoke_token(body: TokenRevoke, db: SessionDep, who: AdminPrincipal) -> dict[str, int]:
    return {"revoked": _revoked_or_404(store.revoke_token, body.prefix, db, who)}


def _revoked_or_404(
    revoke: Callable[[Session, Any, Principal], int], key: Any, db: Session, who: Principal
) -> int:
    try:
        revoked = revoke(db, key, who)
    except store.Conflict as exc:
        raise HTTPException(409, str(exc)) from None
    if not revoked:
        raise HTTPException(404, f"no live token {key!r}")
    return revoked
