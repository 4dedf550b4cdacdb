"""How failures are answered: bad input 422 naming the field (never echoing the value:
it may be NaN, which JSON cannot carry), an unavailable store or cluster 503 with
Retry-After, so that clients retry instead of giving up."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

log = logging.getLogger("zeroservice.api")
RETRY_AFTER_S = 5


class Unavailable(Exception):
    """A dependency (the store, the Ray cluster) does not answer now."""

    def __init__(self, what: str, cause: BaseException | None = None):
        detail = f": {type(cause).__name__}" if cause is not None else ""
        super().__init__(f"{what} unavailable{detail}; retry later")


class Rejected(Exception):
    """A request refused for what it asks (not for its form): answered ``status`` with
    ``detail`` (a message naming the field, or the numbers)."""

    def __init__(self, status: int, detail: Any, headers: dict[str, str] | None = None):
        super().__init__(str(detail))
        self.status, self.detail, self.headers = status, detail, headers


def _rejected(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Rejected)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status, headers=exc.headers)


def _invalid(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = [
        {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": e.get("type", "")}
        for e in exc.errors()
    ]
    return JSONResponse({"detail": errors}, status_code=422)


UNAVAILABLE = (Unavailable, OperationalError, InterfaceError, PoolTimeout)
"""What answers 503 with Retry-After: the store or the cluster not answering now."""


def unavailable_detail(exc: Exception) -> str:
    """The 503's detail for one of ``UNAVAILABLE``."""
    if not isinstance(exc, Unavailable):
        log.warning("store unavailable: %s", exc.__class__.__name__)
        exc = Unavailable("the job store", exc)
    return str(exc)


def _unavailable(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(
        {"detail": unavailable_detail(exc)},
        status_code=503,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


_METHODS = ("DELETE", "GET", "HEAD", "PATCH", "POST", "PUT")


def _http(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's errors, as its own handler answers them, except that a 405 lists in
    ``Allow`` every method the path takes: Starlette names those of the first route
    whose path matched, and ``/v1/jobs`` (GET and POST) is two routes."""
    assert isinstance(exc, StarletteHTTPException)
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        routes = request.app.router.routes
        methods = [
            method
            for method in _METHODS
            if any(r.matches({**request.scope, "method": method})[0] == Match.FULL for r in routes)
        ]
        if methods:
            headers["Allow"] = ", ".join(methods)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=headers)


def install(app: FastAPI) -> None:
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(Rejected, _rejected)
    for kind in UNAVAILABLE:
        app.add_exception_handler(kind, _unavailable)
