"""Tokens expire, are listed (never shown again) and are revoked by id or by an exact
prefix (``%`` and ``_`` are not wildcards)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from functools import partial

import httpx
from sqlalchemy import update

from api.db import ApiToken
from tests.api.conftest import Harness, serve
from tests.api.test_routes import TINY as _TINY


def _make(harness, tenant: str, **body) -> dict:
    h = harness.headers(harness.admin)
    harness.client.post("/v1/tenants", json={"name": tenant}, headers=h)
    r = harness.client.post("/v1/tokens", json={"tenant": tenant, **body}, headers=h)
    assert r.status_code == 201, r.text
    return r.json()


def _works(harness, token: str) -> bool:
    return harness.client.get("/v1/jobs", headers=harness.headers(token)).status_code == 200


def test_tokens_expire(harness):
    made = _make(harness, "alice", expires_in_days=7)
    lifetime = datetime.fromisoformat(made["expires_at"]) - datetime.fromisoformat(
        made["created_at"]
    )
    assert round(lifetime / timedelta(days=1)) == 7
    default = _make(harness, "alice")
    lifetime = datetime.fromisoformat(default["expires_at"]) - datetime.fromisoformat(
        default["created_at"]
    )
    assert round(lifetime / timedelta(days=1)) == harness.settings.token_ttl_days == 90
    assert _works(harness, made["token"])
    with harness.service.sessions() as s:
        past = datetime.now(timezone.utc) - timedelta(seconds=1)
        s.execute(update(ApiToken).where(ApiToken.id == made["id"]).values(expires_at=past))
        s.commit()
    assert not _works(harness, made["token"])
    assert _works(harness, default["token"])
    # Expired, it is no longer live: revoking it finds nothing (404), as documented.
    admin = harness.headers(harness.admin)
    assert harness.client.delete(f"/v1/tokens/{made['id']}", headers=admin).status_code == 404
    by_prefix = {"prefix": made["token"][:10]}
    revoked = harness.client.post("/v1/tokens/revoke", json=by_prefix, headers=admin)
    assert revoked.status_code == 404, revoked.text
    r = harness.client.post(
        "/v1/tokens",
        json={"tenant": "alice", "expires_in_days": 0},
        headers=harness.headers(harness.admin),
    )
    assert r.status_code == 422 and "expires_in_days" in r.text


def test_tokens_are_listed_without_the_token(harness):
    a, b = _make(harness, "alice", name="ci"), _make(harness, "bob")
    admin = harness.headers(harness.admin)
    listed = harness.client.get("/v1/tokens", headers=admin).json()
    by_id = {t["id"]: t for t in listed}
    assert by_id[a["id"]]["name"] == "ci" and by_id[a["id"]]["tenant"] == "alice"
    assert by_id[b["id"]]["prefix"] == b["token"][:10]
    assert a["token"] not in str(listed) and b["token"] not in str(listed)
    assert "token_hash" not in str(listed)
    only_bob = harness.client.get("/v1/tokens?tenant=bob", headers=admin).json()
    assert [t["id"] for t in only_bob] == [b["id"]]
    assert harness.client.get("/v1/tokens", headers=harness.headers(a["token"])).status_code == 403


def test_revocation_by_id(harness):
    a, b = _make(harness, "alice"), _make(harness, "alice")
    admin = harness.headers(harness.admin)
    r = harness.client.delete(f"/v1/tokens/{a['id']}", headers=admin)
    assert r.status_code == 200 and r.json() == {"revoked": 1}
    assert not _works(harness, a["token"]) and _works(harness, b["token"])
    assert harness.client.delete(f"/v1/tokens/{a['id']}", headers=admin).status_code == 404
    assert harness.client.delete("/v1/tokens/999999", headers=admin).status_code == 404
    listed = {t["id"]: t for t in harness.client.get("/v1/tokens", headers=admin).json()}
    assert listed[a["id"]]["revoked_at"] is not None and listed[b["id"]]["revoked_at"] is None
    own = next(t["id"] for t in listed.values() if t["name"] == "bootstrap")
    assert harness.client.delete(f"/v1/tokens/{own}", headers=admin).status_code == 409


def test_a_prefix_with_wildcards_revokes_only_literally(harness):
    made = [_make(harness, "alice") for _ in range(3)]
    admin = harness.headers(harness.admin)
    for prefix in ("zs_%%%%%", "zs______", "%%%%%%%%", "zs_" + "_" * 7):
        r = harness.client.post("/v1/tokens/revoke", json={"prefix": prefix}, headers=admin)
        assert r.status_code == 404, (prefix, r.text)
    assert all(_works(harness, m["token"]) for m in made)
    r = harness.client.post(
        "/v1/tokens/revoke", json={"prefix": made[0]["token"][:10]}, headers=admin
    )
    assert r.json() == {"revoked": 1}
    assert [_works(harness, m["token"]) for m in made] == [False, True, True]


def test_the_metrics_token_reads_the_targets_and_nothing_else(database_url, tmp_path):
    metrics = "zs_metrics-read-only-0123456789abcdef"
    h = Harness(database_url, tmp_path / "data", metrics_token=metrics)
    try:
        alice = h.headers(h.tenant_token("alice"))
        job = h.client.post("/v1/jobs", json={"spec": _TINY}, headers=alice).json()["id"]
        h.tick()
        h.backend.jobs[job]["targets"] = [{"targets": ["10.0.0.7:9000"], "labels": {}}]
        reader = h.headers(metrics)
        r = h.client.get("/v1/targets", headers=reader)
        assert r.status_code == 200 and r.json()[0]["targets"] == ["10.0.0.7:9000"]
        for method, path in [
            ("GET", "/v1/jobs"),
            ("GET", f"/v1/jobs/{job}"),
            ("POST", f"/v1/jobs/{job}/cancel"),
            ("GET", "/v1/cluster"),
            ("GET", "/v1/tokens"),
        ]:
            assert h.client.request(method, path, headers=reader).status_code == 401, path
        assert h.client.get("/v1/targets", headers=h.headers("zs_wrong")).status_code == 401
    finally:
        h.client.close()
        h.service.engine.dispose()


def test_the_control_planes_metrics_are_read_with_the_metrics_or_an_admin_token(
    database_url, tmp_path
):
    """They name every tenant's jobs: with a metrics token set, a tenant's token is 403
    and none 401; without one (a local stack) they stay open."""
    metrics = "zs_metrics-read-only-0123456789abcdef"
    h = Harness(database_url, tmp_path / "data", metrics_token=metrics)
    try:
        alice = h.headers(h.tenant_token("alice"))
        h.client.post("/v1/jobs", json={"spec": _TINY}, headers=alice)
        assert h.client.get("/metrics", headers=h.headers(metrics)).status_code == 200
        assert h.client.get("/metrics", headers=h.headers(h.admin)).status_code == 200
        assert h.client.get("/metrics", headers=alice).status_code == 403
        assert h.client.get("/metrics").status_code == 401
        assert h.client.get("/metrics", headers=h.headers("zs_wrong")).status_code == 401
    finally:
        h.client.close()
        h.service.engine.dispose()
    open_stack = Harness(database_url, tmp_path / "data2")
    try:
        assert open_stack.client.get("/metrics").status_code == 200
    finally:
        open_stack.client.close()
        open_stack.service.engine.dispose()


def test_revocations_sent_at_once_count_the_token_once(database_url, tmp_path):
    """Eight revocations of one token through a real server: one answers that it
    revoked it, the others that no live token has that id."""
    harness = Harness(database_url, tmp_path / "data", rate_per_s=1e9, rate_burst=10**9)
    try:
        made = _make(harness, "alice")
        admin = harness.headers(harness.admin)
        with serve(harness) as url, ThreadPoolExecutor(8) as pool:
            delete = partial(httpx.delete, f"{url}/v1/tokens/{made['id']}", headers=admin)
            answers = list(pool.map(lambda _: delete(timeout=60), range(8)))
        ok = [r.json() for r in answers if r.status_code == 200]
        assert ok == [{"revoked": 1}], [(r.status_code, r.text) for r in answers]
        assert sorted(r.status_code for r in answers) == [200] + [404] * 7
        assert not _works(harness, made["token"])
    finally:
        harness.client.close()
        harness.service.engine.dispose()


def test_a_longer_prefix_revokes_by_the_characters_the_store_keeps(harness):
    """8 to 16 characters are taken: the store keeps 10, so pasting more of the token
    still finds it (and a different 11th character does not)."""
    made = [_make(harness, "alice") for _ in range(2)]
    admin = harness.headers(harness.admin)
    token = made[0]["token"]
    other = "A" if token[10] != "A" else "B"
    r = harness.client.post("/v1/tokens/revoke", json={"prefix": token[:10] + other}, headers=admin)
    assert r.status_code == 200, r.text  # the 11th character is not kept: it matches
    assert not _works(harness, token) and _works(harness, made[1]["token"])
    r = harness.client.post(
        "/v1/tokens/revoke", json={"prefix": made[1]["token"][:16]}, headers=admin
    )
    assert r.json() == {"revoked": 1} and not _works(harness, made[1]["token"])


def test_a_provisioned_admin_token_is_listed_by_its_digest_not_its_characters(
    database_url, tmp_path
):
    secret = "Abcdefghij0123456789-operator"
    h = Harness(database_url, tmp_path / "data", admin_token=secret)
    try:
        listed = h.client.get("/v1/tokens", headers=h.headers(secret)).json()
        (row,) = [t for t in listed if t["name"] == "provisioned"]
        assert row["prefix"].startswith("sha256:") and secret[:4] not in row["prefix"]
        h.client.post("/v1/tenants", json={"name": "ops"}, headers=h.headers(secret))
        made = h.client.post(
            "/v1/tokens", json={"tenant": "ops", "admin": True}, headers=h.headers(secret)
        )
        creator = made.json()["token"]
        r = h.client.post(
            "/v1/tokens/revoke", json={"prefix": row["prefix"]}, headers=h.headers(creator)
        )
        assert r.json() == {"revoked": 1} and not _works(h, secret)
    finally:
        h.client.close()
        h.service.engine.dispose()
