"""The store goes away and comes back: routes answer 503 with Retry-After meanwhile
(never 500, never a hang), and serve again once it returns, on a real PostgreSQL
stopped and started with pg_ctl."""

from __future__ import annotations

import pytest
from sqlalchemy import event, text
from sqlalchemy.exc import OperationalError

from tests.api.conftest import Harness, PostgresServer
from tests.api.test_routes import TINY


@pytest.fixture
def own_postgres():
    server = PostgresServer()
    yield server
    server.remove()


def test_a_stopped_store_answers_503_and_recovers(own_postgres, tmp_path):
    h = Harness(own_postgres.database("outage"), tmp_path / "data")
    try:
        alice = h.headers(h.tenant_token("alice"))
        job = h.client.post("/v1/jobs", json={"spec": TINY}, headers=alice).json()
        h.client.get("/metrics")  # a reading to fall back on
        own_postgres.stop()
        for method, path, body in [
            ("GET", "/v1/jobs", None),
            ("GET", f"/v1/jobs/{job['id']}", None),
            ("POST", "/v1/jobs", {"spec": TINY}),
            ("GET", f"/v1/jobs/{job['id']}/events", None),
            ("POST", "/v1/tenants", {"name": "carol"}),
        ]:
            headers = h.headers(h.admin) if path == "/v1/tenants" else alice
            r = h.client.request(method, path, json=body, headers=headers)
            assert r.status_code == 503, (path, r.text)
            assert r.headers["Retry-After"] == "5"
            assert "the job store unavailable" in r.json()["detail"]
        assert h.client.get("/readyz").status_code == 503
        assert h.client.get("/healthz").status_code == 200
        assert h.client.get("/metrics").status_code == 200  # the last reading
        with pytest.raises(OperationalError):
            h.tick()  # the scheduler's tick fails; its loop reports and retries
        own_postgres.start()
        r = h.client.get("/v1/jobs", headers=alice)
        assert r.status_code == 200 and [j["id"] for j in r.json()["items"]] == [job["id"]]
        assert h.client.get("/readyz").status_code == 200
        h.tick()
    finally:
        h.client.close()
        h.service.engine.dispose()


def test_statements_and_connections_are_time_bounded(postgres_server, tmp_path):
    h = Harness(postgres_server.database("bounded"), tmp_path / "data")
    try:
        with h.service.sessions() as s:
            assert s.execute(text("SHOW statement_timeout")).scalar_one() == "30s"
        assert h.service.engine.pool.timeout() == 5
    finally:
        h.client.close()
        h.service.engine.dispose()


def test_metrics_scrapes_reuse_one_reading_of_the_store(harness):
    statements: list[str] = []
    event.listen(
        harness.service.engine, "before_cursor_execute", lambda *a: statements.append(a[2])
    )
    for _ in range(5):
        assert harness.client.get("/metrics").status_code == 200
    reads = [s for s in statements if "FROM jobs" in s]
    assert len(reads) == 2  # the counts by status and the active jobs, once


def test_text_the_store_cannot_hold_in_a_supervisors_report_is_stored_replaced(harness):
    """A rank's exception text (chosen by a tenant's model) carries a NUL: PostgreSQL
    refuses it, and a refused write would roll back every sync of the job."""
    alice = harness.headers(harness.tenant_token("alice"))
    job = harness.client.post("/v1/jobs", json={"spec": TINY}, headers=alice).json()["id"]
    harness.tick()
    harness.backend.move(job, "running", step=1)
    harness.tick()
    bad = "rank 0: RuntimeError: bad\x00token \ud800"
    with harness.backend.lock:
        state = harness.backend.jobs[job]
        state["events"].append({"kind": "restart", "reason": "x\x00", "message": bad, "step": 1})
        state["logs"].append(bad)
    harness.backend.move(job, "failed", "training_error", step=2, message=bad)
    harness.tick()
    got = harness.client.get(f"/v1/jobs/{job}", headers=alice).json()
    assert (
        got["status"] == "failed"
        and got["message"] == "rank 0: RuntimeError: bad\ufffdtoken \ufffd"
    )
    events = harness.client.get(f"/v1/jobs/{job}/events", headers=alice).json()
    assert any(e["message"] == got["message"] for e in events), events
