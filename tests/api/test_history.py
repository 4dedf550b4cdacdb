"""The per-step history: every step up to the service's limit, then downsampled (never
more points than the limit), served in pages by ``GET /v1/jobs/{id}/metrics`` to the
job's tenant only, on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from tests.api.conftest import Harness
from tests.api.fakes import point
from tests.api.test_routes import TINY
from workers.history import StepHistory, downsample, merge, step_points
from workers.messages import RankChunk


@pytest.fixture
def small(database_url, tmp_path):
    h = Harness(database_url, tmp_path / "data", max_history_per_job=8)
    yield h
    h.client.close()
    h.service.engine.dispose()


def _run(h: Harness, auth: dict, steps: int, per_tick: int) -> str:
    job = h.client.post("/v1/jobs", json={"spec": TINY}, headers=auth).json()["id"]
    h.tick()
    for first in range(1, steps + 1, per_tick):
        last = min(steps, first + per_tick - 1)
        h.backend.move(job, "running", "training", step=last)
        h.backend.steps(job, [(s, 10.0 - s / 100) for s in range(first, last + 1)])
        h.tick()
    return job


def _all(h: Harness, auth: dict, job: str, limit: int) -> list[dict]:
    points, after = [], -1
    while True:
        url = f"/v1/jobs/{job}/metrics?history_after={after}&history_limit={limit}"
        page = h.client.get(url, headers=auth).json()
        assert len(page["history"]) <= limit
        points += page["history"]
        if page["next_after"] is None:
            return points
        after = page["next_after"]


def test_every_step_is_kept_up_to_the_limit(small):
    auth = small.headers(small.tenant_token("alice"))
    job = _run(small, auth, steps=8, per_tick=3)
    metrics = small.client.get(f"/v1/jobs/{job}/metrics", headers=auth).json()
    assert [p["step"] for p in metrics["history"]] == list(range(1, 9))
    assert metrics["history_stride"] == 1 and metrics["history_total"] == 8
    assert metrics["history"][4] == point(5, 10.0 - 5 / 100)


def test_a_long_job_is_downsampled_within_the_limit(small):
    auth = small.headers(small.tenant_token("alice"))
    job = _run(small, auth, steps=100, per_tick=7)
    points = _all(small, auth, job, limit=3)
    # 100 steps in at most 8 points: windows of 16 steps, evenly spaced.
    assert [p["step"] for p in points] == [16, 32, 48, 64, 80, 96, 100]
    assert [p["steps"] for p in points] == [16] * 6 + [4]
    assert sum(p["steps"] for p in points) == 100
    # The same points as the in-memory model of the history, field by field.
    model = StepHistory(8)
    for s in range(1, 101):
        model.add(point(s, 10.0 - s / 100))
    assert model.stride == 16
    assert len(points) == len(model.points)
    for got, want in zip(points, model.points, strict=True):
        assert got == pytest.approx(want)
    # Means over the window, last schedule values, the largest memory peak.
    first = points[0]
    assert first["loss"] == pytest.approx(10.0 - sum(range(1, 17)) / 16 / 100)
    assert first["lr"] == point(16, 0)["lr"] and first["memory_peak_bytes"] == 2**20 * 16


def test_steps_redone_after_a_restart_are_kept_once(small):
    auth = small.headers(small.tenant_token("alice"))
    job = _run(small, auth, steps=6, per_tick=6)
    small.backend.steps(job, [(5, 99.0), (6, 99.0), (7, 3.0)])  # resumed from step 4
    small.tick()
    history = small.client.get(f"/v1/jobs/{job}/metrics", headers=auth).json()["history"]
    assert [p["step"] for p in history] == list(range(1, 8))
    assert [p["loss"] for p in history][4:] == [10.0 - 5 / 100, 10.0 - 6 / 100, 3.0]


def test_history_pages_are_bounded_and_tenant_scoped(small):
    alice = small.headers(small.tenant_token("alice"))
    bob = small.headers(small.tenant_token("bob"))
    job = _run(small, alice, steps=5, per_tick=5)
    url = f"/v1/jobs/{job}/metrics"
    assert [p["step"] for p in _all(small, alice, job, limit=2)] == [1, 2, 3, 4, 5]
    page = small.client.get(f"{url}?history_after=2&history_limit=2", headers=alice).json()
    assert [p["step"] for p in page["history"]] == [3, 4] and page["next_after"] == 4
    assert small.client.get(url, headers=bob).status_code == 404
    for bad in ("history_limit=1001", "history_limit=-1", "history_after=-2", "history_after=x"):
        response = small.client.get(f"{url}?{bad}", headers=alice)
        assert response.status_code == 422, bad
        assert bad.split("=")[0] in response.text


def test_step_points_combine_the_ranks_reports():
    def report(step, loss, seconds, peak):
        return {
            "step": step,
            "loss": loss,
            "grad_norm": 2.0,
            "loss_scale": 1024.0,
            "lr": 1e-3,
            "seconds": seconds,
            "tokens": 64,
            "peak_bytes": peak,
        }

    # dp 2 × mp 2: ranks 0 and 2 are MP rank 0 of their replicas.
    results = [
        RankChunk(0, 1, {}, steps=[report(1, 4.0, 0.5, 100)]),
        RankChunk(1, 1, {}, steps=[report(1, 4.0, 0.6, 300)]),
        RankChunk(2, 1, {}, steps=[report(1, 2.0, 0.4, 200)]),
        RankChunk(3, 1, {}, steps=[report(1, float("inf"), 0.8, 100)]),
    ]
    (p,) = step_points(results, mp=2, dp=2)
    assert p["loss"] == 3.0 and p["step_seconds"] == 0.8 and p["memory_peak_bytes"] == 300
    assert p["tokens_per_second"] == 64 * 2 / 0.8 and p["grad_norm"] == 2.0
    overflow = step_points([RankChunk(0, 1, {}, steps=[report(1, float("nan"), 0.5, 1)])], 1, 1)
    assert overflow[0]["loss"] is None


def test_merge_and_downsample_cover_every_step_once():
    points = [point(s, float(s)) for s in range(1, 10)]
    merged = downsample(points, 4)
    assert [(p["step"], p["steps"]) for p in merged] == [(4, 4), (8, 4), (9, 1)]
    assert merged[0]["loss"] == 2.5
    assert merge(merged[0], merged[1])["loss"] == 4.5


def test_a_merged_throughput_is_the_tokens_over_the_seconds():
    fast = {"step": 1, "steps": 1, "step_seconds": 1.0, "tokens_per_second": 1000.0}
    slow = {"step": 2, "steps": 1, "step_seconds": 3.0, "tokens_per_second": 1000.0 / 3}
    both = merge(fast, slow)
    assert both["tokens_per_second"] == 500.0 and both["step_seconds"] == 2.0
    rest = {"step": 4, "steps": 2, "step_seconds": 1.0, "tokens_per_second": 1000.0}
    assert merge(both, rest)["tokens_per_second"] == 4000.0 / 6  # 4,000 tokens in 6 s
    unknown = merge(fast, {**slow, "step_seconds": None})
    assert unknown["tokens_per_second"] == (1000.0 + 1000.0 / 3) / 2  # no times: the mean


def test_the_migration_turns_stored_chunks_into_points(database_url):
    import sqlalchemy as sa

    from api.db import make_engine, utcnow
    from api.migrate import upgrade

    engine = make_engine(database_url)
    chunks = [
        {"step": 20, "loss": 5.0, "tokens_per_second": 900.0, "dp": 2},
        {"step": 40, "loss": None, "tokens_per_second": 950.0, "dp": 2},
    ]
    text_columns = ("name", "status", "reason", "message", "checkpoint_path")
    int_columns = ("tenant_id", "priority", "attempts", "current_dp", "step", "events_seen")
    jobs = sa.table(
        "jobs",
        sa.column("id", sa.String),
        *(sa.column(c, sa.String) for c in text_columns),
        *(sa.column(c, sa.Integer) for c in (*int_columns, "logs_seen", "version")),
        sa.column("spec", sa.JSON),
        sa.column("metrics", sa.JSON),
        sa.column("created_at", sa.DateTime(timezone=True)),
        sa.column("updated_at", sa.DateTime(timezone=True)),
    )
    tenants = sa.table(
        "tenants",
        sa.column("id", sa.Integer),
        sa.column("name", sa.String),
        sa.column("created_at", sa.DateTime(timezone=True)),
    )
    try:
        upgrade(engine, "0003")
        with engine.begin() as conn:
            conn.execute(sa.insert(tenants).values(id=1, name="t", created_at=utcnow()))
            conn.execute(
                sa.insert(jobs).values(
                    id="j",
                    **dict.fromkeys(text_columns, "j"),
                    **dict.fromkeys(int_columns, 1),
                    logs_seen=0,
                    version=1,
                    spec={},
                    metrics={"history": chunks},
                    created_at=utcnow(),
                    updated_at=utcnow(),
                )
            )
        upgrade(engine)
        query = "SELECT step, steps, loss, tokens_per_second, dp FROM job_steps ORDER BY step"
        with engine.connect() as conn:
            rows = [tuple(r) for r in conn.execute(sa.text(query))]
        assert rows == [(20, 20, 5.0, 900.0, 2), (40, 20, None, 950.0, 2)]
    finally:
        engine.dispose()
