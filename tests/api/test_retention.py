"""Retention: a job keeps its newest events and log lines up to the service's limits,
its per-step history downsampled within its limit, pages through them, and the
supervisor's history is fetched once."""

from __future__ import annotations

from tests.api.conftest import Harness
from tests.api.test_routes import TINY


def test_events_logs_and_history_are_kept_up_to_the_limits(database_url, tmp_path):
    h = Harness(
        database_url,
        tmp_path / "data",
        max_events_per_job=5,
        max_log_lines_per_job=4,
        max_history_per_job=3,
    )
    try:
        auth = h.headers(h.tenant_token("alice"))
        job = h.client.post("/v1/jobs", json={"spec": TINY}, headers=auth).json()["id"]
        h.tick()
        for step in range(1, 11):
            h.backend.move(job, "running", "training", step=step)
            h.backend.chunk(job, step, 10.0 - step)
            h.tick()
        # Each tick asked the supervisor only for the chunks after those it had.
        assert h.backend.history_asked == list(range(0, 10))
        events = h.client.get(f"/v1/jobs/{job}/events?limit=1000", headers=auth).json()
        assert len(events) == 5
        assert [e["data"]["step"] for e in events] == [6, 7, 8, 9, 10]
        logs = h.client.get(f"/v1/jobs/{job}/logs", headers=auth).json()
        assert len(logs) == 4
        page = h.client.get(f"/v1/jobs/{job}/logs?after={logs[1]['id']}", headers=auth).json()
        assert [x["id"] for x in page] == [logs[2]["id"], logs[3]["id"]]
        # 10 steps within 3 points: windows of 4 steps (1-4, 5-8, 9-10).
        metrics = h.client.get(f"/v1/jobs/{job}/metrics", headers=auth).json()
        assert [c["step"] for c in metrics["history"]] == [4, 8, 10]
        assert [c["steps"] for c in metrics["history"]] == [4, 4, 2]
        assert metrics["history_stride"] == 4 and metrics["next_after"] is None
        later = h.client.get(
            f"/v1/jobs/{job}/metrics?history_after=4&history_limit=1", headers=auth
        ).json()
        assert [c["step"] for c in later["history"]] == [8]
        assert later["next_after"] == 8 and later["history_total"] == 3
    finally:
        h.client.close()
        h.service.engine.dispose()
