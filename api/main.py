"""The REST control plane (FastAPI): the app, its middleware, error handlers and
routers (api/routes/). Every /v1 route needs a bearer token; a tenant sees and cancels
only its own jobs (another tenant's job answers 404, as a job that does not exist);
admin tokens see every tenant's jobs and manage tenants and tokens."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request

from workers.spec import warm_up_checks

from . import errors
from .auth_gate import AuthGate
from .body_limit import BodyLimit
from .routes import cluster, health, jobs, plan, tenants
from .service import Service
from .text_guard import TextGuard

HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE"})
"""Methods counted under their own name in the request metrics."""


def create_app(service: Service) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        warm_up_checks()
        if service.start_scheduler:
            service.scheduler.start()
        yield
        service.scheduler.stop()

    app = FastAPI(
        title="zeroservice",
        version="0.1.0",
        description="Train PyTorch models with ZeRO on Ray: jobs, events, metrics, plans.",
        lifespan=lifespan,
    )
    app.state.service = service
    errors.install(app)
    app.add_middleware(TextGuard)  # inside BodyLimit: the body it reads is bounded
    app.add_middleware(BodyLimit, max_bytes=service.settings.max_body_bytes)
    app.add_middleware(AuthGate, service=service)  # before any body is read
    app.middleware("http")(_measure)
    for module in (health, jobs, plan, cluster, tenants):
        app.include_router(module.router)
    return app


async def _measure(request: Request, call_next):
    """Requests, latency and errors by route, for the control plane's metrics."""
    metrics = request.app.state.service.metrics
    t0 = time.perf_counter()
    status = 500  # a route that raises is answered 500 by the server: counted as such
    try:
        response = await call_next(request)
        status = response.status_code
        return response
    finally:
        path = getattr(request.scope.get("route"), "path", "unmatched")
        # A made-up method would be a new series per request, for anyone without a token.
        method = request.method if request.method in HTTP_METHODS else "other"
        metrics.requests.labels(method, path, str(status)).inc()
        metrics.latency.labels(method, path).observe(time.perf_counter() - t0)
        if status >= 400:
            metrics.errors.labels(path, str(status)).inc()
