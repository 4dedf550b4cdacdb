"""One tenant cannot stall the others: jobs that can never fit are refused, jobs that
cannot launch fail alone, smaller jobs backfill past a waiting large one until it has
waited long enough to hold the queue, priorities and quotas are per tenant, tokens are
rate-limited, status changes are version-checked and launching is idempotent."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm.exc import StaleDataError

from api import store
from api.db import Job
from tests.api.conftest import Harness
from tests.api.test_routes import TINY

FOUR = {**TINY, "resources": {"dp": 4, "cpus_per_rank": 1}}


def _status(h: Harness, job_id: str, headers: dict) -> dict:
    return h.client.get(f"/v1/jobs/{job_id}", headers=headers).json()


def _submit(h: Harness, headers: dict, spec: dict = TINY, **body) -> str:
    r = h.client.post("/v1/jobs", json={"spec": spec, **body}, headers=headers)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_a_job_larger_than_the_cluster_can_be_is_refused_with_the_numbers(harness):
    h = harness.headers(harness.admin)  # an admin may ask any priority
    huge = {**TINY, "resources": {"dp": 4096, "cpus_per_rank": 1}}
    r = harness.client.post("/v1/jobs", json={"spec": huge, "priority": 100}, headers=h)
    assert r.status_code == 422
    assert "needs 4096 CPU at min_dp 4096 × mp 1; the cluster has at most 16" in r.text
    plan = harness.client.post("/v1/plan", json={"spec": huge}, headers=h)
    assert plan.status_code == 422 and plan.json() == r.json()  # the plan agrees
    ok = harness.client.post("/v1/jobs", json={"spec": TINY, "priority": 100}, headers=h)
    assert ok.status_code == 201


def test_a_job_that_cannot_launch_fails_alone(harness):
    h = harness.headers(harness.tenant_token("alice"))
    broken, fine = _submit(harness, h), _submit(harness, h)
    harness.backend.refuse_launch.add(broken)
    harness.tick()
    got = _status(harness, broken, h)
    assert got["status"] == "failed" and got["reason"] == "launch_failed"
    assert "PermissionError: cannot create" in got["message"]
    assert _status(harness, fine, h)["status"] == "starting"
    harness.tick()  # nothing raises on later ticks
    assert harness.client.get("/readyz").status_code == 200


def test_smaller_jobs_backfill_until_the_waiting_one_holds_the_queue(database_url, tmp_path):
    h = Harness(database_url, tmp_path / "data")
    try:
        h.backend.total["CPU"] = 4.0
        auth = h.headers(h.tenant_token("alice"))
        first = _submit(h, auth)
        h.tick()  # 2 of 4 CPUs taken
        big, small = _submit(h, auth, FOUR), _submit(h, auth)
        h.tick()
        assert _status(h, big, auth)["status"] == "queued"
        assert _status(h, small, auth)["status"] == "starting"  # backfilled
        h.backend.move(small, "succeeded", "completed")
        with h.service.sessions() as s:  # the big job has now waited past the grace
            past = store.utcnow() - timedelta(seconds=h.settings.backfill_grace_s + 1)
            s.execute(update(Job).where(Job.id == big).values(created_at=past))
            s.commit()
        late = _submit(h, auth)
        h.tick()
        assert _status(h, big, auth)["status"] == "queued"
        assert _status(h, late, auth)["status"] == "queued"  # it would fit: held for big
        h.backend.move(first, "succeeded", "completed")
        h.tick()
        assert _status(h, big, auth)["status"] == "starting"
        assert _status(h, late, auth)["status"] == "queued"
    finally:
        h.client.close()
        h.service.engine.dispose()


def test_priority_ceilings_and_quotas_are_per_tenant(harness):
    c, admin = harness.client, harness.headers(harness.admin)
    alice = harness.headers(harness.tenant_token("alice"))
    bob = harness.headers(harness.tenant_token("bob"))
    r = c.post("/v1/jobs", json={"spec": TINY, "priority": 1}, headers=alice)
    assert r.status_code == 422 and "priority: 1 is above this tenant's ceiling 0" in r.text
    limits = {"max_priority": 50, "max_ranks": 2, "max_queued_jobs": 2}
    assert c.put("/v1/tenants/alice/limits", json=limits, headers=alice).status_code == 403
    assert c.put("/v1/tenants/alice/limits", json=limits, headers=admin).status_code == 200
    assert c.put("/v1/tenants/nobody/limits", json=limits, headers=admin).status_code == 404
    r = c.post("/v1/jobs", json={"spec": TINY, "priority": 51}, headers=alice)
    assert r.status_code == 422
    r = c.post("/v1/jobs", json={"spec": FOUR}, headers=alice)
    assert r.status_code == 422 and "needs 4 ranks; this tenant's quota is 2" in r.text
    plan = c.post("/v1/plan", json={"spec": FOUR}, headers=alice)
    assert plan.status_code == 422 and plan.json() == r.json()  # the plan agrees
    assert c.post("/v1/plan", json={"spec": FOUR}, headers=bob).json()["fits"]  # not bob's quota
    one = _submit(harness, alice, priority=50)
    two = _submit(harness, alice, priority=50)
    r = c.post("/v1/jobs", json={"spec": TINY}, headers=alice)
    assert r.status_code == 429 and "2 jobs queued, this tenant's limit is 2" in r.text
    theirs = _submit(harness, bob)
    harness.tick()
    assert _status(harness, one, alice)["status"] == "starting"
    assert _status(harness, two, alice)["status"] == "queued"  # alice's 2 ranks are held
    assert _status(harness, theirs, bob)["status"] == "starting"  # bob is not held up


def test_an_elastic_job_counts_at_its_largest_size_against_the_quota(harness):
    """It grows to max_dp whenever capacity returns, without asking again: counted at
    min_dp, one tenant's elastic jobs could take the whole cluster."""
    c, admin = harness.client, harness.headers(harness.admin)
    alice = harness.headers(harness.tenant_token("alice"))
    assert c.put("/v1/tenants/alice/limits", json={"max_ranks": 4}, headers=admin).is_success
    wide = {**TINY, "resources": {"dp": 2, "min_dp": 1, "max_dp": 8, "cpus_per_rank": 1}}
    r = c.post("/v1/jobs", json={"spec": wide}, headers=alice)
    assert r.status_code == 422, r.text
    assert "needs 8 ranks at max_dp; this tenant's quota is 4" in r.text
    elastic = {**TINY, "resources": {"dp": 2, "min_dp": 1, "max_dp": 3, "cpus_per_rank": 1}}
    first = _submit(harness, alice, elastic)
    second = _submit(harness, alice, elastic)
    harness.tick()
    assert _status(harness, first, alice)["status"] == "starting"
    assert _status(harness, second, alice)["status"] == "queued"  # 3 + 3 > 4


def test_a_queued_job_a_lowered_quota_can_never_admit_fails_with_the_numbers(harness):
    """Waiting would be for ever, and it would go on counting against the tenant's
    queue, where the same spec submitted now is refused."""
    c, admin = harness.client, harness.headers(harness.admin)
    alice = harness.headers(harness.tenant_token("alice"))
    harness.backend.total["CPU"] = 2.0  # the 4-rank job waits for capacity
    waiting, small = _submit(harness, alice, FOUR), _submit(harness, alice)
    harness.tick()
    assert _status(harness, waiting, alice)["status"] == "queued"
    assert c.put("/v1/tenants/alice/limits", json={"max_ranks": 2}, headers=admin).is_success
    harness.tick()
    got = _status(harness, waiting, alice)
    assert (got["status"], got["reason"]) == ("failed", "over_quota")
    assert "needs 4 ranks; this tenant's quota is 2; it can never be admitted" in got["message"]
    assert _status(harness, small, alice)["status"] == "starting"  # admission went on
    events = c.get(f"/v1/jobs/{waiting}/events", headers=alice).json()
    assert any(e["reason"] == "over_quota" for e in events)


def test_tokens_are_rate_limited(database_url, tmp_path):
    h = Harness(database_url, tmp_path / "data", rate_per_s=0.001, rate_burst=4)
    try:
        alice, bob = h.headers(h.tenant_token("alice")), h.headers(h.tenant_token("bob"))
        # (the admin token made its 4 requests creating both tenants' tokens)
        codes = [h.client.get("/v1/jobs", headers=alice).status_code for _ in range(5)]
        assert codes == [200, 200, 200, 200, 429]
        r = h.client.get("/v1/jobs", headers=alice)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert "rate: this token's limit" in r.text
        assert h.client.get("/v1/jobs", headers=bob).status_code == 200
    finally:
        h.client.close()
        h.service.engine.dispose()


def test_a_status_change_from_a_stale_read_is_refused(harness):
    h = harness.headers(harness.tenant_token("alice"))
    job_id = _submit(harness, h)
    with harness.service.sessions() as s:
        job = s.execute(select(Job).where(Job.id == job_id)).scalar_one()
        store.set_status(s, job, "cancelled", "cancelled", "cancelled by alice")
        harness.tick()  # admission changed the row meanwhile
        with pytest.raises(StaleDataError):
            s.commit()
    assert _status(harness, job_id, h)["status"] == "starting"


def test_launching_is_idempotent_and_a_lost_launch_is_redone(harness):
    h = harness.headers(harness.tenant_token("alice"))
    job_id = _submit(harness, h)
    harness.tick()
    del harness.backend.jobs[job_id]  # marked starting, but its launch never happened
    harness.tick()
    assert harness.backend.launched == [job_id, job_id]
    # Whatever a supervisor lost before a poll saw it run left is removed first (see
    # [Note: a start launched again] in api/scheduler.py).
    assert harness.backend.reaped == [job_id]
    assert _status(harness, job_id, h)["status"] == "starting"
    harness.tick()  # found this time: not launched again
    assert harness.backend.launched == [job_id, job_id]


def test_a_poll_that_times_out_leaves_the_job_alone(harness):
    h = harness.headers(harness.tenant_token("alice"))
    job_id = _submit(harness, h)
    harness.tick()
    harness.backend.move(job_id, "running", "training", step=2)
    harness.tick()
    harness.backend.slow.add(job_id)
    harness.tick()
    assert _status(harness, job_id, h)["status"] == "running"
    assert harness.client.get(f"/v1/jobs/{job_id}/metrics", headers=h).status_code == 200
    harness.backend.slow.clear()
    harness.backend.move(job_id, "running", "training", step=5)
    harness.tick()
    assert _status(harness, job_id, h)["step"] == 5


def test_a_stored_spec_that_no_longer_validates_fails_its_job_alone(harness):
    h = harness.headers(harness.tenant_token("alice"))
    old, fine = _submit(harness, h), _submit(harness, h)
    with harness.service.sessions() as s:  # as an older version stored it
        job = s.get(Job, old)
        job.spec = {**job.spec, "checkpoint": {"dir": "/etc/passwd/x"}}
        s.commit()
    harness.tick()
    got = _status(harness, old, h)
    assert got["status"] == "failed" and got["reason"] == "invalid_spec"
    assert got["message"].startswith("checkpoint.dir:")
    assert _status(harness, fine, h)["status"] == "starting"


def test_a_start_launched_again_with_a_spec_that_no_longer_validates_fails_its_job_alone(
    harness,
):
    """A job left starting without a supervisor is launched again from its stored spec:
    one an older version stored that no longer validates (a bootstrap_s below today's
    floor) fails that job, and the tick goes on to the others."""
    h = harness.headers(harness.tenant_token("alice"))
    old, fine = _submit(harness, h), _submit(harness, h)
    harness.tick()
    assert _status(harness, old, h)["status"] == "starting"
    harness.backend.jobs.pop(old)  # its supervisor never came up
    with harness.service.sessions() as s:
        job = s.get(Job, old)
        job.spec = {**job.spec, "timeouts": {"bootstrap_s": 1, "step_s": 60}}
        s.commit()
    harness.tick()
    got = _status(harness, old, h)
    assert got["status"] == "failed" and got["reason"] == "invalid_spec", got
    assert got["message"].startswith("timeouts.bootstrap_s:")
    assert _status(harness, fine, h)["status"] == "starting"


def test_an_active_jobs_resources_that_no_longer_validate_still_count_and_stop_nothing(
    harness,
):
    """A running job stored by an older version with resources today's spec refuses
    (a cpus_per_rank above today's bound) is counted with its numbers as stored; the
    other tenants' jobs are admitted (it raised out of every admission before)."""
    h = harness.headers(harness.tenant_token("alice"))
    bob = harness.headers(harness.tenant_token("bob"))
    old = _submit(harness, h)
    harness.tick()
    harness.backend.move(old, "running", "training", step=1)
    harness.tick()
    with harness.service.sessions() as s:
        job = s.get(Job, old)
        job.spec = {**job.spec, "resources": {**job.spec["resources"], "cpus_per_rank": 300}}
        s.commit()
    later = _submit(harness, bob)
    harness.tick()
    assert _status(harness, later, bob)["status"] == "starting"
    assert harness.service.scheduler.last_error is None
