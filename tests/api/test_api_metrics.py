"""The control plane counts every request it answers, a route's unhandled error (a 500
from the server) among them: the errors panel is where a bug shows first."""

from __future__ import annotations

import types

from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient

from api import errors
from api.main import _measure
from api.metrics import ApiMetrics


def test_a_route_that_raises_is_counted_as_a_500():
    app = FastAPI()
    app.state.service = types.SimpleNamespace(metrics=ApiMetrics(lambda: {}))
    errors.install(app)
    app.middleware("http")(_measure)

    @app.get("/boom")
    def boom():
        raise RuntimeError("a bug")

    @app.get("/missing")
    def missing():
        raise HTTPException(404, "no")

    client = TestClient(app, raise_server_exceptions=False)
    assert [client.get("/boom").status_code for _ in range(3)] == [500] * 3
    assert client.get("/missing").status_code == 404
    registry = app.state.service.metrics.registry

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("zeroservice_api_errors_total", route="/boom", status="500") == 3
    assert value("zeroservice_api_requests_total", method="GET", route="/boom", status="500") == 3
    assert value("zeroservice_api_request_seconds_count", method="GET", route="/boom") == 3
    assert value("zeroservice_api_errors_total", route="/missing", status="404") == 1
