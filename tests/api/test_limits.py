"""Every input bounded: non-finite numbers, ids beyond the store's integers, long
strings and large bodies are refused with a 4xx that names the field."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.api.test_routes import TINY, _jobs_stored
from tests.workers.jobs import TINY_GPT2


def _raw(spec_json: str) -> bytes:
    return b'{"spec": ' + spec_json.encode() + b"}"


def _with(path: str, literal: str) -> str:
    """TINY as JSON with the value at ``path`` (dotted) replaced by a raw literal."""
    marker = "__VALUE__"
    body = json.loads(json.dumps(TINY))
    node = body
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = marker
    return json.dumps(body).replace(f'"{marker}"', literal)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize(
    "path,field",
    [
        ("optimizer.lr", '"lr"'),
        ("optimizer.eps", '"eps"'),
        ("resources.cpus_per_rank", '"cpus_per_rank"'),
        ("peak_tflops", '"peak_tflops"'),
        ("engine.max_grad_norm", "engine.max_grad_norm"),
        ("model.dropout", '"dropout"'),
    ],
)
def test_non_finite_numbers_are_refused_naming_the_field(harness, literal, path, field):
    h = {**harness.headers(harness.tenant_token("alice")), "Content-Type": "application/json"}
    for route in ("/v1/jobs", "/v1/plan"):
        r = harness.client.post(route, content=_raw(_with(path, literal)), headers=h)
        assert r.status_code == 422, (route, r.text)
        assert field in r.text
    assert _jobs_stored(harness) == 0


@pytest.mark.parametrize(
    "path,literal",
    [
        ("resources.dp", '"2"'),
        ("resources.dp", "true"),
        ("resources.dp", "2.0"),
        ("steps", '"10"'),
        ("model.n_layer", "false"),
        ("model.tie_weights", "1"),
        ("optimizer.lr", '"0.001"'),
        ("resources.cpus_per_rank", "5e-324"),
        ("resources.cpus_per_rank", "0.00009"),
    ],
)
def test_values_of_another_type_are_refused_naming_the_field(harness, path, literal):
    """A count given as a string, a boolean or a float is not coerced (``true`` is not
    1 replica), and CPUs finer than Ray's precision would fail only at placement."""
    h = {**harness.headers(harness.tenant_token("alice")), "Content-Type": "application/json"}
    for route in ("/v1/jobs", "/v1/plan"):
        r = harness.client.post(route, content=_raw(_with(path, literal)), headers=h)
        assert r.status_code == 422, (route, r.text)
        assert path.split(".")[-1] in r.text
    assert _jobs_stored(harness) == 0


@pytest.mark.parametrize("priority", ['"1"', "true", "1.5"])
def test_a_priority_of_another_type_is_refused(harness, priority):
    h = {**harness.headers(harness.tenant_token("alice")), "Content-Type": "application/json"}
    body = b'{"spec": ' + json.dumps(TINY).encode() + b', "priority": ' + priority.encode() + b"}"
    r = harness.client.post("/v1/jobs", content=body, headers=h)
    assert r.status_code == 422 and "priority" in r.text, r.text
    assert _jobs_stored(harness) == 0


def test_non_finite_numbers_in_free_form_json_are_refused(harness):
    h = {**harness.headers(harness.tenant_token("alice")), "Content-Type": "application/json"}
    spec = (
        '{"model": {"kind": "factory", "factory": "m:f", "vocab_size": 8, '
        '"kwargs": {"a": [1, {"b": NaN}]}}}'
    )
    r = harness.client.post("/v1/jobs", content=_raw(spec), headers=h)
    assert r.status_code == 422 and "model.kwargs.a[1].b: nan is not a finite number" in r.text
    r = harness.client.post(
        "/v1/plan",
        content=b'{"spec": {}, "device_memory_gib": Infinity}',
        headers=h,
    )
    assert r.status_code == 422 and "device_memory_gib" in r.text


@pytest.mark.parametrize("resource", ["events", "logs"])
@pytest.mark.parametrize(
    "query,field",
    [
        ("after=30255952116560945152", "after"),
        ("after=2147483648", "after"),
        ("after=-1", "after"),
        ("limit=0", "limit"),
        ("limit=100000", "limit"),
    ],
)
def test_query_ranges_are_bounded(harness, resource, query, field):
    h = harness.headers(harness.tenant_token("alice"))
    job = harness.client.post("/v1/jobs", json={"spec": TINY}, headers=h).json()
    r = harness.client.get(f"/v1/jobs/{job['id']}/{resource}?{query}", headers=h)
    assert r.status_code == 422, r.text
    assert field in r.text
    top = 2**31 - 1
    r = harness.client.get(f"/v1/jobs/{job['id']}/{resource}?after={top}", headers=h)
    assert r.status_code == 200 and r.json() == []


def test_long_ids_and_names_are_refused(harness):
    h = harness.headers(harness.tenant_token("alice"))
    r = harness.client.get("/v1/jobs/" + "x" * 65, headers=h)
    assert r.status_code == 422 and "job_id" in r.text
    r = harness.client.post("/v1/jobs", json={"spec": {**TINY, "name": "n" * 129}}, headers=h)
    assert r.status_code == 422 and "name" in r.text
    r = harness.client.post(
        "/v1/tenants", json={"name": "t" * 129}, headers=harness.headers(harness.admin)
    )
    assert r.status_code == 422 and "name" in r.text


def test_a_body_over_the_limit_is_refused_before_it_is_read(harness):
    h = {**harness.headers(harness.tenant_token("alice")), "Content-Type": "application/json"}
    limit = harness.settings.max_body_bytes
    assert limit == 2**20
    padding = " " * (limit - len(json.dumps({"spec": TINY})) + 1)
    body = json.dumps({"spec": TINY}) + padding
    assert len(body) == limit + 1
    r = harness.client.post("/v1/jobs", content=body.encode(), headers=h)
    assert r.status_code == 413 and "ZEROSERVICE_MAX_BODY_BYTES" in r.text

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(3):
            yield b" " * (limit // 2)

    r = harness.client.post("/v1/jobs", content=chunks(), headers=h)
    assert r.status_code == 413
    ok = json.dumps({"spec": TINY}) + " " * (limit - len(json.dumps({"spec": TINY})))
    assert harness.client.post("/v1/jobs", content=ok.encode(), headers=h).status_code == 201
    assert _jobs_stored(harness) == 1


@pytest.mark.parametrize("declared", [b"ten", b"-1", b"1e3", b" 12"])
def test_a_content_length_that_is_not_a_number_is_a_bad_request(declared):
    """Answered by the middleware itself (a client cannot send such a header through
    httpx), before any body is read or any route runs."""
    from api.body_limit import BodyLimit

    scope = {"type": "http", "method": "POST", "headers": [(b"content-length", declared)]}
    sent = _answered_unread(lambda app: BodyLimit(app, 2**20), scope)
    assert sent[0]["status"] == 400
    assert b"Content-Length: not a whole number of bytes" in sent[1]["body"]


def _answered_unread(middleware, scope: dict) -> list[dict]:
    """What ``middleware`` (wrapping an app that must not run) sends for ``scope``,
    without reading any of the body."""
    import asyncio

    async def app(scope, receive, send):
        raise AssertionError("the route ran")

    async def receive():
        raise AssertionError("the body was read")

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    asyncio.run(middleware(app)(scope, receive, send))
    return sent


@pytest.mark.parametrize(
    "body,detail",
    [
        (b'{"spec": {"steps": ' + b"9" * 5000 + b"}}", "body: a number has more than 4300 digits"),
        (b"[" * 3000 + b"]" * 3000, "body: nested too deep"),
        *[  # deep enough to fail the route's own parse, further down the stack
            (
                b'{"spec": {"engine": {"x": ' + b"[" * d + b"1" + b"]" * d + b"}}}",
                "body: nested deeper than 512 levels",
            )
            for d in (520, 700, 963, 970)
        ],
        (b'{"spec": {"model": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5002, "body: nested too deep"),
        (b'{"spec": {"name": "\xff"}}', "body: not UTF-8 text (byte 0xff at offset 19)"),
        (
            '{"spec": {"name": "x"}}'.encode("utf-16"),
            "body: JSON must be UTF-8 text (RFC 8259); this body is UTF-16 (little-endian, "
            "with a byte order mark)",
        ),
        (
            '{"spec": {"name": "x"}}'.encode("utf-16-be"),
            "body: JSON must be UTF-8 text (RFC 8259); this body is UTF-16 or UTF-32",
        ),
        (
            '{"spec": {"name": "x"}}'.encode("utf-32-le"),
            "body: JSON must be UTF-8 text (RFC 8259); this body is UTF-16 or UTF-32",
        ),
        (
            b'{"spec": {"steps": -1, "steps": 5}}',
            "body: the key 'steps' appears twice in one object",
        ),
        (b'{"spec": {}, "spec": {}}', "body: the key 'spec' appears twice in one object"),
        (
            b"\xef\xbb\xbf" + b'{"spec": {"name": "x"}}',
            "body: JSON must be UTF-8 text (RFC 8259); this body is UTF-8 with a byte order mark",
        ),
    ],
)
def test_json_past_the_parsers_limits_is_refused_as_bad_input(harness, body, detail):
    """A 422 naming the body, like any bad input: not a 400 'error parsing the body'."""
    h = {**harness.headers(harness.tenant_token("alice")), "Content-Type": "application/json"}
    r = harness.client.post("/v1/jobs", content=body, headers=h)
    assert r.status_code == 422 and r.json()["detail"] == detail, r.text
    assert _jobs_stored(harness) == 0


@pytest.mark.parametrize(
    "resources,route,status",
    [
        ({}, "/v1/jobs", 429),  # the queue is full
        ({"cpus_per_rank": 256}, "/v1/jobs", 422),  # larger than the cluster
        ({"cpus_per_rank": 256}, "/v1/plan", 422),
        ({"dp": 4}, "/v1/jobs", 422),  # beyond the rank quota
        ({"dp": 4}, "/v1/plan", 422),
    ],
)
def test_a_job_that_could_not_be_queued_builds_no_model(harness, resources, route, status):
    """A model other than the reference GPT is built on the cluster to be planned: a
    spec the cluster, the quotas or the queue refuse is refused before that."""
    alice = harness.headers(harness.tenant_token("alice"))
    admin = harness.headers(harness.admin)
    limits = {"max_queued_jobs": 0, "max_ranks": 2}
    assert harness.client.put("/v1/tenants/alice/limits", json=limits, headers=admin).is_success
    spec = {**TINY, "model": TINY_GPT2, "resources": {**TINY["resources"], **resources}}
    r = harness.client.post(route, json={"spec": spec}, headers=alice)
    assert r.status_code == status, r.text
    assert harness.backend.counted == []
    r = harness.client.post("/v1/plan", json={"spec": {**spec, "resources": {}}}, headers=alice)
    assert r.status_code == 200 and len(harness.backend.counted) == 1  # a plan that may run


def test_a_tenants_model_builds_in_flight_are_bounded(harness):
    """Two builds of one tenant wait on the cluster; its third plan is a 429 at once,
    while another tenant's plan and the health probe are answered."""
    started, release = threading.Semaphore(0), threading.Event()

    def slow(spec, timeout_s, memory_bytes):  # a build waiting on the cluster
        started.release()
        release.wait(30)
        return 4464

    harness.backend.count_parameters = slow
    alice = harness.headers(harness.tenant_token("alice"))
    bob = harness.headers(harness.tenant_token("bob"))
    body = {"spec": {**TINY, "model": TINY_GPT2}}
    with ThreadPoolExecutor(3) as pool:
        waiting = [pool.submit(harness.client.post, "/v1/plan", json=body, headers=alice)]
        waiting.append(pool.submit(harness.client.post, "/v1/plan", json=body, headers=alice))
        assert started.acquire(timeout=30) and started.acquire(timeout=30)
        third = harness.client.post("/v1/plan", json=body, headers=alice)
        assert third.status_code == 429 and third.headers["Retry-After"], third.text
        assert "2 model builds of this tenant are running" in third.json()["detail"]
        assert harness.client.get("/healthz").status_code == 200
        other = pool.submit(harness.client.post, "/v1/plan", json=body, headers=bob)
        assert started.acquire(timeout=30)  # bob's build started beside alice's two
        release.set()
        assert [w.result().status_code for w in waiting] == [200, 200]
        assert other.result().status_code == 200
    again = harness.client.post("/v1/plan", json=body, headers=alice)
    assert again.status_code == 200  # the slots came back


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer zs_wrong"}, {"Authorization": "Basic abc"}],
)
def test_a_body_without_a_valid_token_is_refused_before_it_is_read(harness, headers):
    """401, not the 413 or 422 its body would get: nothing of it is read or parsed
    (see [Note: the body after the token] in api/auth_gate.py)."""
    limit = harness.settings.max_body_bytes
    h = {**headers, "Content-Type": "application/json"}
    for body in (b" " * (limit + 1), b'{"spec": {"name": "\x00"}}', b"[" * 3000):
        r = harness.client.post("/v1/jobs", content=body, headers=h)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
    alice = harness.headers(harness.tenant_token("alice"))
    r = harness.client.post("/v1/jobs", content=b"[" * 3000, headers={**h, **alice})
    assert r.status_code == 422  # with a token the body is read and checked as before
    assert harness.client.post("/v1/jobs", json={"spec": TINY}, headers=alice).status_code == 201
    assert _jobs_stored(harness) == 1


def test_the_gate_reads_no_body_of_a_request_without_a_token():
    import types

    from api.auth_gate import AuthGate

    service = types.SimpleNamespace(sessions=None)  # never asked: there is no token
    for headers in ([(b"content-length", b"12")], [(b"transfer-encoding", b"chunked")]):
        scope = {"type": "http", "method": "POST", "path": "/v1/plan", "headers": headers}
        sent = _answered_unread(lambda app: AuthGate(app, service), scope)
        assert sent[0]["status"] == 401
