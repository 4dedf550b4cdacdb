"""The REST contract on SQLite and on a real PostgreSQL: routes, bad input, auth and
tenants, idempotent submission, the scheduler against a fake cluster, restarts."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import pytest
from sqlalchemy import select, text

from api.db import ApiToken, Job
from api.settings import Settings
from tests.api.conftest import Harness, serve
from zeroservice.autoconf import RUNTIME_RESERVE

TINY = {
    "name": "tiny",
    "model": {"vocab_size": 256, "seq_len": 16, "n_layer": 2, "n_head": 4, "dim": 32},
    "engine": {"stage": 3},
    "steps": 10,
    "micro_batch": 2,
    "resources": {"dp": 2, "cpus_per_rank": 1},
}


def _jobs_stored(h: Harness) -> int:
    with h.service.sessions() as s:
        return len(s.execute(select(Job)).scalars().all())


def test_openapi_schema_is_valid(harness):
    from openapi_spec_validator import validate

    schema = harness.client.get("/openapi.json").json()
    validate(schema)
    paths = set(schema["paths"])
    for route in (
        "/v1/jobs",
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/cancel",
        "/v1/jobs/{job_id}/events",
        "/v1/jobs/{job_id}/logs",
        "/v1/jobs/{job_id}/metrics",
        "/v1/plan",
        "/v1/cluster",
        "/v1/targets",
        "/healthz",
        "/readyz",
        "/metrics",
    ):
        assert route in paths


def test_health_and_metrics(harness):
    assert harness.client.get("/healthz").json() == {"status": "ok"}
    ready = harness.client.get("/readyz")
    assert ready.status_code == 200, ready.text
    harness.client.get("/v1/jobs")  # a 401, counted as an error
    text_ = harness.client.get("/metrics").text
    for family in (
        "zeroservice_api_requests_total",
        "zeroservice_api_request_seconds_bucket",
        "zeroservice_api_errors_total",
        'zeroservice_jobs{status="queued"}',
        "zeroservice_cluster_resources",
    ):
        assert family in text_


def test_auth_is_required_and_tokens_are_hashed(harness):
    c = harness.client
    assert c.get("/v1/jobs").status_code == 401
    assert c.get("/v1/jobs", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert c.get("/v1/jobs", headers={"Authorization": "Basic abc"}).status_code == 401
    assert c.post("/v1/jobs", json={"spec": TINY}).status_code == 401
    assert c.get("/v1/cluster").status_code == 401
    token = harness.tenant_token("alice")
    assert c.get("/v1/jobs", headers=harness.headers(token)).status_code == 200
    # Not an admin: cannot create tenants or tokens.
    r = c.post("/v1/tenants", json={"name": "x"}, headers=harness.headers(token))
    assert r.status_code == 403
    with harness.service.sessions() as s:
        stored = [t.token_hash for t in s.execute(select(ApiToken)).scalars()]
        dump = " ".join(str(v) for row in s.execute(text("SELECT * FROM api_tokens")) for v in row)
    assert token not in dump and harness.admin not in dump
    assert all(len(h) == 64 for h in stored)


def test_tenants_see_and_cancel_only_their_own_jobs(harness):
    c = harness.client
    alice, bob = harness.tenant_token("alice"), harness.tenant_token("bob")
    job = c.post("/v1/jobs", json={"spec": TINY}, headers=harness.headers(alice)).json()
    assert job["tenant"] == "alice" and job["status"] == "queued"
    h_bob = harness.headers(bob)
    assert c.get(f"/v1/jobs/{job['id']}", headers=h_bob).status_code == 404
    assert c.post(f"/v1/jobs/{job['id']}/cancel", headers=h_bob).status_code == 404
    assert c.get(f"/v1/jobs/{job['id']}/events", headers=h_bob).status_code == 404
    assert c.get("/v1/jobs", headers=h_bob).json()["total"] == 0
    assert c.get("/v1/jobs", headers=harness.headers(alice)).json()["total"] == 1
    # The admin sees every tenant's jobs.
    assert c.get("/v1/jobs", headers=harness.headers(harness.admin)).json()["total"] == 1
    assert c.get("/v1/jobs/nope", headers=harness.headers(alice)).status_code == 404


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"spec": {**TINY, "stepz": 3}}, "stepz"),
        ({"spec": {**TINY, "steps": -5}}, "steps"),
        ({"spec": {**TINY, "steps": "ten"}}, "steps"),
        ({"spec": {**TINY, "micro_batch": 10**12}}, "micro_batch"),
        ({"spec": {**TINY, "resources": {"dp": 2, "mp": 3}}}, "n_head: 4 is not divisible"),
        ({"spec": {**TINY, "resources": {"dp": 4, "min_dp": 5}}}, "min_dp <= dp <= max_dp"),
        ({"spec": {**TINY, "resources": {"dp": 2, "mp": 128}}}, "mp"),
        ({"spec": {**TINY, "engine": {"stage": 9}}}, "engine.stage"),
        ({"spec": TINY, "priority": 1000}, "priority"),
        ({"spec": TINY, "submission_id": "bad id!"}, "submission_id"),
        ({"spec": TINY, "extra": 1}, "extra"),
        ({}, "spec"),
    ],
)
def test_bad_input_is_refused_naming_the_field_and_nothing_is_stored(harness, body, needle):
    h = harness.headers(harness.tenant_token("alice"))
    r = harness.client.post("/v1/jobs", json=body, headers=h)
    assert r.status_code == 422, r.text
    assert needle in r.text
    assert _jobs_stored(harness) == 0


def test_malformed_json_is_refused(harness):
    h = harness.headers(harness.tenant_token("alice"))
    r = harness.client.post(
        "/v1/jobs", content=b'{"spec": {', headers={**h, "Content-Type": "application/json"}
    )
    assert r.status_code == 422
    assert "JSON" in r.text or "json" in r.text
    assert _jobs_stored(harness) == 0


def test_a_plan_that_does_not_fit_is_refused_with_the_numbers(harness):
    h = harness.headers(harness.tenant_token("alice"))
    big = {
        **TINY,
        "model": {"vocab_size": 50304, "seq_len": 1024, "n_layer": 48, "n_head": 25, "dim": 1600},
        "engine": {"stage": 0, "precision": "fp32"},
    }
    r = harness.client.post("/v1/jobs", json={"spec": big}, headers=h)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert detail["fits"] is False
    assert detail["needed_bytes"] > detail["available_bytes"] == 16 * 2**30
    assert "GiB per rank" in detail["message"]
    assert _jobs_stored(harness) == 0
    plan = harness.client.post("/v1/plan", json={"spec": big}, headers=h).json()
    assert plan["fits"] is False and plan["per_rank"]["model_states"] > 0
    ok = harness.client.post("/v1/plan", json={"spec": TINY}, headers=h).json()
    assert ok["fits"] is True


def test_the_plan_of_a_reference_gpt_is_its_predicted_peak(harness):
    """The reference GPT's need is the peak model's (zeroservice/peak.py), to the byte;
    outside what that model covers (here: host copies) the planner's formula."""
    from workers.spec import JobSpec
    from zeroservice.peak import PeakConfig, predict_peak

    h = harness.headers(harness.tenant_token("alice"))
    spec = {**TINY, "engine": {"stage": 3, "precision": "bf16"}}
    got = harness.client.post("/v1/plan", json={"spec": spec}, headers=h).json()
    job = JobSpec.model_validate(spec)
    want = predict_peak(
        PeakConfig(
            gpt=job.model.gpt_config(),
            stage=3,
            dp=job.resources.lowest_dp,
            precision="bf16",
            micro_batch=job.micro_batch,
        )
    )
    assert got["peak"]["bytes"] == want.peak and got["peak"]["reserve_bytes"] == RUNTIME_RESERVE
    assert got["needed_bytes"] == want.peak + RUNTIME_RESERVE
    assert got["peak"]["phase"] == want.phase and "predicted peak" in got["message"]
    assert got["needed_bytes"] != got["per_rank"]["device_total"]
    spec["engine"] = {"stage": 2, "redundancy": "host-copy"}
    other = harness.client.post("/v1/plan", json={"spec": spec}, headers=h).json()
    assert other["peak"] is None and other["per_rank"]["redundancy_host"] > 0
    per_rank = other["per_rank"]  # a CPU rank: its host memory is the same memory
    assert other["needed_bytes"] == per_rank["device_total"] + per_rank["host_total"]
    spec["engine"] = {"stage": 3, "stage3_leaf_modules": ["MLP"]}  # not modelled either
    leaves = harness.client.post("/v1/plan", json={"spec": spec}, headers=h).json()
    assert leaves["peak"] is None and leaves["per_rank"]["model_states"] > 0
    # ZeRO++: the formula holds hpZ's secondary shards and the quantized rows.
    spec["engine"] = {
        "stage": 3,
        "hierarchical_partition": True,
        "ranks_per_node": 1,
        "quantized_weights": True,
        "quantized_gradients": "int8",
    }
    zpp = harness.client.post("/v1/plan", json={"spec": spec}, headers=h).json()
    per_rank = zpp["per_rank"]
    assert zpp["peak"] is None and "model states, activations" in zpp["message"]
    assert per_rank["secondary_params"] > 0 and per_rank["quantization_scratch"] > 0
    assert zpp["needed_bytes"] == per_rank["device_total"] + per_rank["host_total"]


@pytest.mark.parametrize(
    ("engine", "peak_field"),
    [
        ({"stage": 2, "collectives": "shm"}, {"collectives": "shm"}),
        ({"stage": 3, "stage3_persistence_elements": 10**7}, {"persistence_elements": 10**7}),
    ],
)
def test_the_peak_follows_the_engine_settings_that_hold_memory(harness, engine, peak_field):
    """Shared-memory segments stay mapped; units up to the persistence threshold stay
    gathered: the plan is the peak of the job's own settings, above the default's."""
    from workers.spec import JobSpec
    from zeroservice.peak import PeakConfig, predict_peak

    h = harness.headers(harness.tenant_token("alice"))
    spec = {**TINY, "engine": engine, "resources": {"dp": 4, "cpus_per_rank": 0.5}}
    got = harness.client.post("/v1/plan", json={"spec": spec}, headers=h).json()
    job = JobSpec.model_validate(spec)
    base = {"gpt": job.model.gpt_config(), "stage": engine["stage"], "dp": 4}
    want = predict_peak(PeakConfig(**base, micro_batch=job.micro_batch, **peak_field))
    default = predict_peak(PeakConfig(**base, micro_batch=job.micro_batch))
    assert got["peak"]["bytes"] == want.peak > default.peak


@pytest.mark.parametrize(("optimizer", "per_element"), [({}, 0), ({"momentum": 0.9}, 4)])
def test_the_plan_of_an_sgd_job_counts_sgds_state(harness, optimizer, per_element):
    """SGD holds a momentum buffer (4 bytes per element) or nothing, not Adam's 8."""
    h = harness.headers(harness.tenant_token("alice"))
    spec = {**TINY, "engine": {"stage": 0}, "optimizer": {"type": "sgd", "lr": 0.1, **optimizer}}
    got = harness.client.post("/v1/plan", json={"spec": spec}, headers=h).json()
    psi = got["per_rank"]["psi_local"]
    assert got["per_rank"]["optimizer_states"] == per_element * psi, got["per_rank"]


def test_submission_id_makes_submission_idempotent_under_a_burst(harness):
    h = harness.headers(harness.tenant_token("alice"))
    body = {"spec": TINY, "submission_id": "run-42"}
    codes, ids = [], []
    lock = threading.Lock()

    def post():
        r = harness.client.post("/v1/jobs", json=body, headers=h)
        with lock:
            codes.append(r.status_code)
            ids.append(r.json()["id"])

    threads = [threading.Thread(target=post) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1
    assert sorted(codes) == [200] * 11 + [201]
    assert _jobs_stored(harness) == 1
    # Another tenant may use the same submission id for its own job.
    h2 = harness.headers(harness.tenant_token("bob"))
    assert harness.client.post("/v1/jobs", json=body, headers=h2).status_code == 201


def test_a_submission_id_reused_for_another_request_is_refused(harness):
    """The same id with a different spec or priority is the client's mistake: 409 names
    the first job and nothing is stored. Defaults spelled out are the same request."""
    c, h = harness.client, harness.headers(harness.tenant_token("alice"))
    body = {"spec": TINY, "submission_id": "run-9"}
    first = c.post("/v1/jobs", json=body, headers=h)
    assert first.status_code == 201, first.text
    first_id = first.json()["id"]
    for other in (
        {**body, "spec": {**TINY, "steps": 11}},
        {**body, "spec": {**TINY, "engine": {"stage": 2}}},
        {**body, "priority": 0},
    ):
        r = c.post("/v1/jobs", json=other, headers=h)
        assert r.status_code == 409, r.text
        assert "run-9" in r.json()["detail"] and first_id in r.json()["detail"]
    spelled_out = {**TINY, "checkpoint": first.json()["spec"]["checkpoint"]}
    again = c.post("/v1/jobs", json={**body, "spec": spelled_out}, headers=h)
    assert again.status_code == 200 and again.json()["id"] == first_id, again.text
    assert _jobs_stored(harness) == 1


def test_a_burst_of_two_requests_under_one_submission_id_stores_one(database_url, tmp_path):
    """Twelve submissions at once through a real server, half of them another request
    under the same id: one is stored, its own retries answer 200 and the others 409,
    whichever request came first, on SQLite and PostgreSQL alike."""
    harness = Harness(database_url, tmp_path / "data", rate_per_s=1e9, rate_burst=10**9)
    h = harness.headers(harness.tenant_token("alice"))
    bodies = [{"spec": {**TINY, "steps": 10 + i % 2}, "submission_id": "run-43"} for i in range(12)]
    try:
        with serve(harness) as url, ThreadPoolExecutor(12) as pool:
            post = partial(httpx.post, f"{url}/v1/jobs", headers=h, timeout=60)
            codes = list(pool.map(lambda b: post(json=b).status_code, bodies))
        answers = [(b["spec"]["steps"], code) for b, code in zip(bodies, codes, strict=True)]
        assert _jobs_stored(harness) == 1
        (stored,) = (steps for steps, code in answers if code == 201)
        assert sorted(code for steps, code in answers if steps == stored) == [200] * 5 + [201]
        assert [code for steps, code in answers if steps != stored] == [409] * 6
    finally:
        harness.client.close()
        harness.service.engine.dispose()


def test_a_job_stored_without_a_request_digest_answers_every_retry(harness):
    """Jobs stored before the digest was kept (migration 0006) keep the old answer."""
    c, h = harness.client, harness.headers(harness.tenant_token("alice"))
    body = {"spec": TINY, "submission_id": "run-10"}
    first = c.post("/v1/jobs", json=body, headers=h).json()
    with harness.service.sessions() as s:
        s.get(Job, first["id"]).request_digest = None
        s.commit()
    again = c.post("/v1/jobs", json={**body, "spec": {**TINY, "steps": 12}}, headers=h)
    assert again.status_code == 200 and again.json()["id"] == first["id"], again.text


def test_list_filters_and_paginates(harness):
    h = harness.headers(harness.tenant_token("alice"))
    for i in range(5):
        harness.client.post("/v1/jobs", json={"spec": {**TINY, "name": f"j{i}"}}, headers=h)
    page = harness.client.get("/v1/jobs?limit=2", headers=h).json()
    assert page["total"] == 5 and len(page["items"]) == 2 and page["next_offset"] == 2
    last = harness.client.get("/v1/jobs?limit=2&offset=4", headers=h).json()
    assert len(last["items"]) == 1 and last["next_offset"] is None
    assert harness.client.get("/v1/jobs?status=running", headers=h).json()["total"] == 0
    assert harness.client.get("/v1/jobs?status=bogus", headers=h).status_code == 422
    assert harness.client.get("/v1/jobs?limit=0", headers=h).status_code == 422


def test_a_cursor_pages_through_jobs_submitted_meanwhile_once_each(harness):
    """Jobs submitted between pages: by cursor every job listed at the start is seen
    exactly once, in order; by offset the shifted rows repeat one."""
    c, h = harness.client, harness.headers(harness.tenant_token("alice"))
    limits = {"max_queued_jobs": 100}
    put = c.put("/v1/tenants/alice/limits", json=limits, headers=harness.headers(harness.admin))
    assert put.is_success, put.text
    for i in range(7):
        c.post("/v1/jobs", json={"spec": {**TINY, "name": f"j{i}"}}, headers=h)
    at_start = [j["id"] for j in c.get("/v1/jobs?limit=500", headers=h).json()["items"]]
    seen, cursor, by_offset, offset = [], None, [], 0
    while True:
        params = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        page = c.get("/v1/jobs", params=params, headers=h).json()
        seen += [j["id"] for j in page["items"]]
        assert page["next_offset"] is None or cursor is None
        c.post("/v1/jobs", json={"spec": {**TINY, "name": "meanwhile"}}, headers=h)
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == at_start
    while offset is not None:
        page = c.get("/v1/jobs", params={"limit": 2, "offset": offset}, headers=h).json()
        by_offset += [j["id"] for j in page["items"]]
        c.post("/v1/jobs", json={"spec": {**TINY, "name": "meanwhile"}}, headers=h)
        offset = page["next_offset"] if offset < 20 else None
    assert len(by_offset) > len(set(by_offset))  # what the cursor is for


@pytest.mark.parametrize(
    "params,said",
    [
        ({"cursor": "bm9wZQ"}, "cursor: not a cursor this service gave"),
        ({"cursor": "!!"}, "cursor: not a cursor this service gave"),
        ({"cursor": "WyIyMDI2LTAxLTAxVDAwOjAwOjAwIiwgIngiXQ"}, "cursor: not a cursor"),
        ({"cursor": "WyJ4IiwgIngiXQ", "offset": 2}, "cursor and offset: give one"),
    ],
)
def test_a_cursor_not_given_by_the_service_is_refused(harness, params, said):
    h = harness.headers(harness.tenant_token("alice"))
    r = harness.client.get("/v1/jobs", params=params, headers=h)
    assert r.status_code == 422 and r.json()["detail"].startswith(said), r.text


def test_scheduler_admits_by_priority_syncs_events_and_asks_the_autoscaler(harness):
    c, fake = harness.client, harness.backend
    fake.total["CPU"] = 2.0  # room for one 2-rank job at a time
    h = harness.headers(harness.tenant_token("alice"))
    limits = {"max_priority": 5}
    r = c.put("/v1/tenants/alice/limits", json=limits, headers=harness.headers(harness.admin))
    assert r.status_code == 200, r.text
    low = c.post("/v1/jobs", json={"spec": TINY, "priority": 0}, headers=h).json()
    high = c.post("/v1/jobs", json={"spec": TINY, "priority": 5}, headers=h).json()
    harness.tick()
    assert fake.launched == [high["id"]]
    assert c.get(f"/v1/jobs/{high['id']}", headers=h).json()["status"] == "starting"
    # The queued job's bundles were asked of the autoscaler.
    assert fake.requests[-1] == [{"CPU": 1.0}, {"CPU": 1.0}]
    fake.move(high["id"], "running", "training", step=3)
    harness.tick()
    job = c.get(f"/v1/jobs/{high['id']}", headers=h).json()
    assert job["status"] == "running" and job["step"] == 3 and job["started_at"]
    fake.move(high["id"], "succeeded", "completed", step=10)
    harness.tick()  # sync frees the capacity, then admits the next one
    assert fake.launched == [high["id"], low["id"]]
    assert fake.requests[-1] == []  # queue drained: request withdrawn
    done = c.get(f"/v1/jobs/{high['id']}", headers=h).json()
    assert done["status"] == "succeeded" and done["finished_at"]
    events = c.get(f"/v1/jobs/{high['id']}/events", headers=h).json()
    assert [e["reason"] for e in events][:2] == ["submitted", "admitted"]
    assert {"training", "completed"} <= {e["reason"] for e in events}
    logs = c.get(f"/v1/jobs/{high['id']}/logs", headers=h).json()
    assert logs and "tokens/s" in logs[-1]["line"]
    assert c.get(f"/v1/jobs/{high['id']}/metrics", headers=h).json()["job_id"] == high["id"]
    cluster = c.get("/v1/cluster", headers=h).json()
    assert cluster["total"]["CPU"] == 2.0


def test_a_tenant_held_below_priority_0_submits_without_naming_one(harness):
    """The default priority (0) was above a negative ceiling: every job submitted
    without a priority was refused."""
    c = harness.client
    h = harness.headers(harness.tenant_token("alice"))
    r = c.put(
        "/v1/tenants/alice/limits",
        json={"max_priority": -5},
        headers=harness.headers(harness.admin),
    )
    assert r.status_code == 200, r.text
    job = c.post("/v1/jobs", json={"spec": TINY}, headers=h)
    assert job.status_code == 201, job.text
    assert job.json()["priority"] == -5
    refused = c.post("/v1/jobs", json={"spec": TINY, "priority": 0}, headers=h)
    assert refused.status_code == 422 and "above this tenant's ceiling -5" in refused.text
    other = harness.headers(harness.tenant_token("bob"))
    assert c.post("/v1/jobs", json={"spec": TINY}, headers=other).json()["priority"] == 0


def test_cancels_during_an_admission_tick_are_kept(harness):
    """Two queued jobs cancelled while a tick admits them: the first cancel made the
    tick's write stale, its rollback re-read the second job as cancelled with a fresh
    version, and the tick admitted and launched it over its confirmed cancel."""
    c, fake = harness.client, harness.backend
    h = harness.headers(harness.tenant_token("alice"))
    ids = [
        c.post("/v1/jobs", json={"spec": {**TINY, "name": f"j{i}"}}, headers=h).json()["id"]
        for i in range(2)
    ]
    answers = []
    fits = fake.fits

    def cancel_both_then_fit(spec):
        if not answers:  # between the tick's read of the queue and its write
            answers.extend(c.post(f"/v1/jobs/{j}/cancel", headers=h).json() for j in ids)
        return fits(spec)

    fake.fits = cancel_both_then_fit
    harness.tick()
    fake.fits = fits
    harness.tick()
    assert [a["status"] for a in answers] == ["cancelled", "cancelled"]
    for job in ids:
        assert c.get(f"/v1/jobs/{job}", headers=h).json()["status"] == "cancelled"
        events = [e["reason"] for e in c.get(f"/v1/jobs/{job}/events", headers=h).json()]
        assert "admitted" not in events, events
    assert fake.launched == []


def test_autoscaler_request_is_bounded_by_the_cluster_maximum(harness):
    fake = harness.backend
    fake.total["CPU"] = 0.0
    h = harness.headers(harness.tenant_token("alice"))
    huge = {**TINY, "resources": {"dp": 10, "cpus_per_rank": 2}}  # 20 CPUs > max 16
    harness.client.post("/v1/jobs", json={"spec": huge}, headers=h)
    harness.client.post("/v1/jobs", json={"spec": TINY}, headers=h)
    harness.tick()
    assert fake.requests[-1] == [{"CPU": 1.0}, {"CPU": 1.0}]


def test_cancel_queued_and_running_jobs(harness):
    c, fake = harness.client, harness.backend
    h = harness.headers(harness.tenant_token("alice"))
    fake.total["CPU"] = 2.0
    running = c.post("/v1/jobs", json={"spec": TINY}, headers=h).json()
    queued = c.post("/v1/jobs", json={"spec": TINY}, headers=h).json()
    harness.tick()
    assert c.post(f"/v1/jobs/{queued['id']}/cancel", headers=h).json()["status"] == "cancelled"
    assert c.post(f"/v1/jobs/{queued['id']}/cancel", headers=h).status_code == 409
    c.post(f"/v1/jobs/{running['id']}/cancel", headers=h)
    assert fake.cancelled == [running["id"]]
    harness.tick()
    assert c.get(f"/v1/jobs/{running['id']}", headers=h).json()["status"] == "cancelled"


def test_jobs_and_events_survive_a_restart_and_running_jobs_are_reattached(database_url, tmp_path):
    first = Harness(database_url, tmp_path / "data")
    h = first.headers(first.tenant_token("alice"))
    job = first.client.post("/v1/jobs", json={"spec": TINY}, headers=h).json()
    first.tick()
    first.backend.move(job["id"], "running", "training", step=2)
    first.tick()
    before = first.client.get(f"/v1/jobs/{job['id']}/events", headers=h).json()
    first.service.scheduler.stop()  # a clean shutdown hands the scheduler's lease back
    first.client.close()
    first.service.engine.dispose()
    # A new control plane on the same store and the same cluster (the supervisor lives on).
    second = Harness(database_url, tmp_path / "data", backend=first.backend)
    assert second.admin is None  # the admin token is created once, at the first start
    assert second.client.get(f"/v1/jobs/{job['id']}/events", headers=h).json() == before
    first.backend.move(job["id"], "succeeded", "completed", step=10)
    second.tick()
    after = second.client.get(f"/v1/jobs/{job['id']}", headers=h).json()
    assert after["status"] == "succeeded" and after["step"] == 10
    second.client.close()
    second.service.engine.dispose()


def test_a_job_whose_supervisor_vanished_gets_a_new_one(harness):
    c, fake = harness.client, harness.backend
    h = harness.headers(harness.tenant_token("alice"))
    job = c.post("/v1/jobs", json={"spec": TINY}, headers=h).json()
    harness.tick()
    for _ in range(3):
        fake.move(job["id"], "running", "training", step=4)
        harness.tick()
    fake.saved(job["id"], 4)
    fake.move(job["id"], "running", "training", step=4)
    harness.tick()
    fake.saved(job["id"], 8)  # lost with the supervisor before a poll read it
    fake.lose_supervisor(job["id"])
    harness.tick()
    assert fake.replaced == [(job["id"], 1)]
    # The new supervisor learns the newest save stored: one after it is its to report.
    assert fake.successions[0].reported_save == 4
    got = c.get(f"/v1/jobs/{job['id']}", headers=h).json()
    assert got["status"] == "resizing" and got["attempts"] == 1
    fake.move(job["id"], "running", "training", step=6)
    harness.tick()  # read from the new supervisor's first event on
    fake.move(job["id"], "succeeded", "completed", step=10)
    harness.tick()
    got = c.get(f"/v1/jobs/{job['id']}", headers=h).json()
    assert got["status"] == "succeeded" and got["step"] == 10
    events = c.get(f"/v1/jobs/{job['id']}/events", headers=h).json()
    lost = [e for e in events if e["reason"] == "supervisor_lost"]
    assert [e["kind"] for e in lost] == ["restart"]
    assert [e["reason"] for e in events].count("training") == 5  # 4 before, 1 after


def test_a_supervisor_that_stays_silent_is_stopped_and_replaced(harness):
    """A supervisor whose process is stopped (or hung) is alive to Ray and answers no
    poll. Timed-out polls leave the job alone until none has been answered for
    ``supervisor_silent_s``; then the control plane stops that process and the next
    sync starts a successor (see [Note: supervised supervisor] in api/scheduler.py)."""
    c, fake = harness.client, harness.backend
    now = [1000.0]
    harness.service.scheduler.clock = lambda: now[0]
    silent_s = harness.settings.supervisor_silent_s
    job, h = _running(harness)
    fake.saved(job["id"], 2)
    harness.tick()
    fake.slow.add(job["id"])
    harness.tick()  # the first poll unanswered
    now[0] += silent_s / 2
    fake.slow.discard(job["id"])
    harness.tick()  # an answer: the silence starts again at the next unanswered poll
    fake.slow.add(job["id"])
    harness.tick()
    now[0] += silent_s - 1
    harness.tick()
    assert fake.stopped == [] and fake.replaced == []
    got = c.get(f"/v1/jobs/{job['id']}", headers=h).json()
    assert got["status"] == "running" and got["attempts"] == 0
    now[0] += 1
    harness.tick()  # silent for supervisor_silent_s: stopped
    assert fake.stopped == [job["id"]] and fake.replaced == []
    harness.tick()  # gone: a successor, told the newest stored save
    assert fake.replaced == [(job["id"], 1)] and fake.successions[0].reported_save == 2
    got = c.get(f"/v1/jobs/{job['id']}", headers=h).json()
    assert got["status"] == "resizing" and got["attempts"] == 1
    (lost,) = [
        e
        for e in c.get(f"/v1/jobs/{job['id']}/events", headers=h).json()
        if e["reason"] == "supervisor_lost"
    ]
    assert lost["kind"] == "restart"
    assert f"answered no poll for {silent_s:.0f} s" in lost["message"], lost
    assert set(fake.poll_timeouts) == {harness.settings.supervisor_poll_timeout_s}


def test_every_supervisor_is_polled_at_once(harness):
    """[Note: polls at once] in api/scheduler.py: the fake answers a tick's three polls
    only once all three are in flight; polled one after the other, the first would wait
    at the barrier until it broke."""
    c, fake = harness.client, harness.backend
    jobs = [_running(harness) for _ in range(3)]
    for n, (job, _) in enumerate(jobs):
        fake.move(job["id"], "running", "training", step=10 + n)
    fake.together = threading.Barrier(3, timeout=20)
    harness.tick()
    assert not fake.together.broken
    fake.together = None
    steps = [c.get(f"/v1/jobs/{job['id']}", headers=h).json()["step"] for job, h in jobs]
    assert steps == [10, 11, 12]


def test_the_targets_ask_every_supervisor_at_once_and_skip_a_silent_one(harness):
    """Prometheus' discovery (``/v1/targets``) asks each running job's supervisor for
    its ranks' endpoints: at once, so that a silent one costs the request one short
    wait, and the others' targets are still listed."""
    c, fake = harness.client, harness.backend
    jobs = [_running(harness)[0]["id"] for _ in range(3)]
    for n, job_id in enumerate(jobs):
        fake.jobs[job_id]["targets"] = [{"targets": [f"127.0.0.1:{9000 + n}"], "labels": {}}]
    fake.slow.add(jobs[1])
    fake.together = threading.Barrier(3, timeout=20)
    r = c.get("/v1/targets", headers=harness.headers(harness.admin))
    assert not fake.together.broken
    fake.together = None
    assert r.status_code == 200, r.text
    assert sorted(t["targets"][0] for t in r.json()) == ["127.0.0.1:9000", "127.0.0.1:9002"]
    assert fake.poll_timeouts[-3:] == [5.0] * 3  # LIVE_WAIT_S


def test_a_silent_supervisor_past_the_restart_budget_fails_its_job(database_url, tmp_path):
    harness = Harness(database_url, tmp_path / "data", supervisor_silent_s=5.0)
    c, fake = harness.client, harness.backend
    now = [0.0]
    harness.service.scheduler.clock = lambda: now[0]
    h = harness.headers(harness.tenant_token("alice"))
    spec = {**TINY, "max_restarts": 0}
    job = c.post("/v1/jobs", json={"spec": spec}, headers=h).json()
    harness.tick()
    fake.move(job["id"], "running", "training", step=2)
    harness.tick()
    fake.slow.add(job["id"])
    harness.tick()
    now[0] += 5.0
    harness.tick()
    harness.tick()
    got = c.get(f"/v1/jobs/{job['id']}", headers=h).json()
    assert got["status"] == "failed" and got["reason"] == "supervisor_lost", got
    assert "answered no poll for 5 s" in got["message"] and fake.replaced == []
    harness.client.close()
    harness.service.engine.dispose()


@pytest.mark.parametrize(
    "name, value", [("supervisor_silent_s", 0.0), ("supervisor_poll_timeout_s", -1.0)]
)
def test_supervisor_timeouts_must_be_positive(tmp_path, name, value):
    with pytest.raises(ValueError, match=name):
        Settings(data_dir=tmp_path, **{name: value})


def _running(harness: Harness) -> tuple[dict, dict]:
    """A job of alice's that its (fake) supervisor reports running; alice's headers."""
    h = harness.headers(harness.tenant_token("alice"))
    job = harness.client.post("/v1/jobs", json={"spec": TINY}, headers=h).json()
    harness.tick()
    harness.backend.move(job["id"], "running", "training", step=2)
    harness.tick()
    return job, h


def test_a_cancel_that_finds_no_supervisor_is_honoured_not_relaunched(harness):
    c, fake = harness.client, harness.backend
    job, h = _running(harness)
    fake.lose_supervisor(job["id"])
    assert c.post(f"/v1/jobs/{job['id']}/cancel", headers=h).status_code == 200
    harness.tick()
    got = c.get(f"/v1/jobs/{job['id']}", headers=h).json()
    assert (got["status"], got["reason"], got["message"]) == (
        "cancelled",
        "cancelled",
        "cancelled by alice",
    )
    assert fake.replaced == [] and job["id"] not in fake.jobs


def test_a_cancel_the_supervisor_missed_is_sent_again_until_the_job_ends(harness):
    c, fake = harness.client, harness.backend
    job, h = _running(harness)
    fake.missed.add(job["id"])
    assert c.post(f"/v1/jobs/{job['id']}/cancel", headers=h).status_code == 200
    assert c.get(f"/v1/jobs/{job['id']}", headers=h).json()["status"] == "running"
    harness.tick()  # sent again
    harness.tick()  # the supervisor's status read
    assert c.get(f"/v1/jobs/{job['id']}", headers=h).json()["status"] == "cancelled"
    assert fake.cancelled == [job["id"]] * 2


def test_a_cancel_a_silent_supervisor_does_not_take_is_kept(harness):
    """The supervisor answers neither the cancel nor polls: the request is still
    acknowledged and recorded (not a 500 that loses it), and once the supervisor was
    stopped and replaced, its successor is told to stop."""
    c, fake = harness.client, harness.backend
    now = [0.0]
    harness.service.scheduler.clock = lambda: now[0]
    job, h = _running(harness)
    fake.slow.add(job["id"])
    r = c.post(f"/v1/jobs/{job['id']}/cancel", headers=h)
    assert r.status_code == 200 and r.json()["status"] == "running", r.text
    harness.tick()  # silent from here
    now[0] += harness.settings.supervisor_silent_s
    harness.tick()  # stopped
    assert fake.stopped == [job["id"]]
    harness.tick()  # no supervisor and a cancel recorded: honoured, not replaced
    got = c.get(f"/v1/jobs/{job['id']}", headers=h).json()
    assert got["status"] == "cancelled" and got["message"] == "cancelled by alice", got
    assert fake.replaced == []


def test_a_lost_supervisor_with_the_restart_budget_spent_fails_the_job(harness):
    c, fake = harness.client, harness.backend
    h = harness.headers(harness.tenant_token("alice"))
    job = c.post("/v1/jobs", json={"spec": {**TINY, "max_restarts": 1}}, headers=h).json()
    harness.tick()
    fake.move(job["id"], "running", "training", step=1, restarts=1)
    harness.tick()
    fake.lose_supervisor(job["id"])
    harness.tick()
    got = c.get(f"/v1/jobs/{job['id']}", headers=h).json()
    assert got["status"] == "failed" and got["reason"] == "supervisor_lost"
    assert "restart budget of 1 spent" in got["message"] and fake.replaced == []


def test_provisioned_admin_token_and_revocation(database_url, tmp_path):
    from api.service import Service

    provisioned = "zs_provisioned-token-0123456789abcdef"
    h = Harness(database_url, tmp_path / "data")
    h.client.close()
    h.service.engine.dispose()
    h.settings.admin_token = provisioned
    service = Service(h.settings, h.backend, start_scheduler=False)
    assert service.bootstrap_token is None  # ensured, not generated
    from fastapi.testclient import TestClient

    from api.main import create_app

    client = TestClient(create_app(service))
    admin = {"Authorization": f"Bearer {provisioned}"}
    assert client.get("/v1/jobs", headers=admin).status_code == 200
    r = client.post("/v1/tokens", json={"tenant": "admin", "admin": True}, headers=admin)
    second = r.json()
    other = {"Authorization": f"Bearer {second['token']}"}
    # Listed by its digest's start; a token cannot revoke itself; another admin token
    # can, and it stops working.
    listed = client.get("/v1/tokens", headers=admin).json()
    (label,) = [t["prefix"] for t in listed if t["name"] == "provisioned"]
    revoke = {"prefix": label}
    assert client.post("/v1/tokens/revoke", json=revoke, headers=admin).status_code == 409
    assert client.post("/v1/tokens/revoke", json=revoke, headers=other).json() == {"revoked": 1}
    assert client.get("/v1/jobs", headers=admin).status_code == 401
    assert (
        client.post("/v1/tokens/revoke", json={"prefix": "zs_nothing"}, headers=other).status_code
        == 404
    )
    client.close()
    service.engine.dispose()


def test_a_retry_returns_the_first_job_even_when_that_job_fills_the_quota(harness):
    """The quota is measured before a new job is stored; a retry must not be measured
    against its own first submission."""
    c, admin = harness.client, harness.headers(harness.admin)
    h = harness.headers(harness.tenant_token("alice"))
    assert c.put("/v1/tenants/alice/limits", json={"max_queued_jobs": 1}, headers=admin).is_success
    body = {"spec": TINY, "submission_id": "run-7"}
    first = c.post("/v1/jobs", json=body, headers=h)
    assert first.status_code == 201, first.text
    again = c.post("/v1/jobs", json=body, headers=h)
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"]
    other = c.post("/v1/jobs", json={**body, "submission_id": "run-8"}, headers=h)
    assert other.status_code == 429, other.text
    assert _jobs_stored(harness) == 1


def test_concurrent_submissions_stay_within_the_queued_quota(database_url, tmp_path):
    """Twelve submissions at once against a limit of two queued jobs, through a real
    server: two are queued and ten refused, on SQLite and PostgreSQL alike."""
    harness = Harness(database_url, tmp_path / "data", rate_per_s=1e9, rate_burst=10**9)
    admin = harness.headers(harness.admin)
    h = harness.headers(harness.tenant_token("alice"))
    limits = {"max_queued_jobs": 2}
    assert harness.client.put("/v1/tenants/alice/limits", json=limits, headers=admin).is_success
    try:
        with serve(harness) as url, ThreadPoolExecutor(12) as pool:
            post = partial(httpx.post, f"{url}/v1/jobs", json={"spec": TINY}, headers=h, timeout=60)
            codes = sorted(r.status_code for r in pool.map(lambda _: post(), range(12)))
        assert codes == [201] * 2 + [429] * 10, codes
        assert _jobs_stored(harness) == 2
    finally:
        harness.client.close()
        harness.service.engine.dispose()


@pytest.mark.parametrize(
    ("where", "value", "named"),
    [
        ("engine", {"lr_schedule": "\ud800"}, "spec.engine.lr_schedule"),
        ("engine", {"\udfff": 1}, "spec.engine (a key)"),
        ("name", "a\x00b", "spec.name"),
        ("model", {"factory": "m:f", "kwargs": {"x": ["ok", "\ud83d"]}}, "spec.model.kwargs.x[1]"),
    ],
)
@pytest.mark.parametrize("route", ["/v1/jobs", "/v1/plan"])
def test_text_the_store_cannot_hold_is_refused_naming_where(harness, route, where, value, named):
    """A NUL (PostgreSQL's text refuses it) or an unpaired surrogate (no UTF-8 encodes
    it: a job stored with one answered 500 on every read) is a 422, and nothing is
    stored."""
    h = {**harness.headers(harness.tenant_token("alice")), "content-type": "application/json"}
    body = json.dumps({"spec": {**TINY, where: value}})  # escaped, as \\ud800
    r = harness.client.post(route, content=body, headers=h)
    assert r.status_code == 422, r.text
    assert r.json()["detail"] == (
        f"{named}: text with a NUL character or an unpaired surrogate is refused"
    )
    assert _jobs_stored(harness) == 0


def test_a_surrogate_pair_is_one_character_and_passes():
    from api.text_guard import bad_string_path

    assert bad_string_path(json.loads('{"a": ["\\ud83d\\ude00"]}')) is None
    assert bad_string_path(json.loads('{"a": ["\\ude00\\ud83d"]}')) == "a[0]"


@pytest.mark.parametrize(
    "url",
    ["/v1/jobs/a%00b", "/v1/jobs/x%00/events", "/v1/tokens?tenant=a%00", "/v1/jobs?status=%00"],
)
def test_a_nul_in_the_url_is_refused(harness, url):
    r = harness.client.get(url, headers=harness.headers(harness.admin))
    assert (r.status_code, r.json()) == (422, {"detail": "url: a NUL character is refused"})


def test_a_layout_the_planner_cannot_make_is_a_422_naming_it(harness):
    h = harness.headers(harness.tenant_token("alice"))
    spec = {**TINY, "engine": {"stage": 3, "ranks_per_node": 2}, "resources": {"dp": 1}}
    for route in ("/v1/plan", "/v1/jobs"):
        r = harness.client.post(route, json={"spec": spec}, headers=h)
        assert r.status_code == 422, route
        (error,) = r.json()["detail"]
        assert error["loc"] == ["body", "spec"], route
        assert error["msg"].startswith(
            "Value error, engine.ranks_per_node: 2 does not divide the data-parallel size 1"
        ), route


def test_made_up_methods_share_one_metrics_series(harness):
    """Anyone may send any method without a token; each must not add a series."""
    for i in range(5):
        harness.client.request(f"ZZ{i}", "/v1/jobs")
    text_ = harness.client.get("/metrics").text
    assert 'method="other"' in text_
    assert 'method="ZZ' not in text_


def test_a_cancel_request_outlives_the_events_pruned_after_it(database_url, tmp_path):
    """Events are kept up to a bound, the oldest deleted first; the cancel request is
    not among them: a supervisor's many events after a missed cancel would otherwise
    take it with them, and a supervisor gone then would be replaced, not cancelled."""
    harness = Harness(database_url, tmp_path / "data", max_events_per_job=5)
    try:
        c, fake = harness.client, harness.backend
        job, h = _running(harness)
        fake.missed.add(job["id"])
        assert c.post(f"/v1/jobs/{job['id']}/cancel", headers=h).status_code == 200
        with fake.lock:
            fake.jobs[job["id"]]["events"] += [
                {"kind": "checkpoint", "reason": "saved", "message": f"step {s}", "step": s}
                for s in range(8)
            ]
        fake.missed.add(job["id"])  # the resend misses too
        harness.tick()  # the events stored, the oldest pruned
        fake.jobs.pop(job["id"])  # then its supervisor is gone
        harness.tick()
        got = c.get(f"/v1/jobs/{job['id']}", headers=h).json()
        assert got["status"] == "cancelled" and fake.replaced == [], got
    finally:
        harness.client.close()
        harness.service.engine.dispose()
