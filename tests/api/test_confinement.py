"""What a tenant may name, probed as an unfriendly tenant would: code for the control
plane to run, files outside its data roots, checkpoint directories outside its own."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import Harness, serve
from tests.api.test_routes import TINY, _jobs_stored

SYSTEM = {
    "kind": "factory",
    "factory": "os:system",
    "kwargs": {"command": "touch {marker}"},
    "vocab_size": 64,
}


@pytest.fixture
def allowing(database_url, tmp_path):
    h = Harness(database_url, tmp_path / "data", model_factories=("tests.workers.factories",))
    yield h
    h.client.close()
    h.service.engine.dispose()


def _spec(**fields) -> dict:
    return {**TINY, **fields}


@pytest.mark.parametrize("route", ["/v1/jobs", "/v1/plan"])
def test_a_factory_outside_the_allowed_modules_is_refused_by_name_and_never_run(
    allowing, tmp_path, route
):
    marker = tmp_path / "x"
    model = {**SYSTEM, "kwargs": {"command": f"touch {marker}"}}
    h = allowing.headers(allowing.tenant_token("mallory"))
    r = allowing.client.post(route, json={"spec": _spec(model=model)}, headers=h)
    assert r.status_code == 422, r.text
    assert "model.factory: 'os:system' is not in a module this service allows" in r.text
    assert "tests.workers.factories" in r.text
    assert not marker.exists() and allowing.backend.counted == []
    assert _jobs_stored(allowing) == 0


def test_factories_are_refused_when_none_are_allowed(harness, tmp_path):
    h = harness.headers(harness.tenant_token("alice"))
    model = {"kind": "factory", "factory": "tests.workers.jobs:tiny_model", "vocab_size": 256}
    r = harness.client.post("/v1/plan", json={"spec": _spec(model=model)}, headers=h)
    assert r.status_code == 422
    assert "ZEROSERVICE_MODEL_FACTORIES: none are enabled" in r.text


def test_an_allowed_factory_is_planned_by_the_cluster_not_by_the_api(allowing, tmp_path):
    """The control plane hands the spec to the backend (a Ray task on a worker); a
    model that cannot be built is refused naming the field."""
    h = allowing.headers(allowing.tenant_token("alice"))
    marker = tmp_path / "pid"
    model = {
        "kind": "factory",
        "factory": "tests.workers.factories:recorded",
        "kwargs": {"path": str(marker)},
        "vocab_size": 256,
        "seq_len": 16,
    }
    r = allowing.client.post("/v1/plan", json={"spec": _spec(model=model)}, headers=h)
    assert r.status_code == 200, r.text
    assert r.json()["fits"] is True
    assert [s.model.factory for s in allowing.backend.counted] == [model["factory"]]
    missing = {**model, "factory": "tests.workers.factories:nope"}
    r = allowing.client.post("/v1/jobs", json={"spec": _spec(model=missing)}, headers=h)
    assert r.status_code == 422 and "model.factory: cannot import" in r.text


def test_an_unknown_transformers_architecture_is_refused_at_submit(harness):
    pytest.importorskip("transformers")
    h = harness.headers(harness.tenant_token("alice"))
    model = {"kind": "transformers", "architecture": "NopeForCausalLM", "vocab_size": 256}
    r = harness.client.post("/v1/jobs", json={"spec": _spec(model=model)}, headers=h)
    assert r.status_code == 422, r.text
    assert "model.architecture: transformers has no NopeForCausalLM" in r.text
    assert _jobs_stored(harness) == 0


def _data(path: str) -> dict:
    return _spec(data={"kind": "text", "path": path})


def test_data_paths_outside_the_tenants_roots_are_refused_by_name(harness):
    h = harness.headers(harness.tenant_token("alice"))
    harness.tenant_token("bob")
    data_dir = harness.settings.data_dir
    alice_root = data_dir / "data" / "alice"
    alice_root.mkdir(parents=True)
    bob_file = data_dir / "data" / "bob" / "corpus.txt"
    bob_file.parent.mkdir(parents=True)
    bob_file.write_text("bob's words " * 100)
    (alice_root / "escape").symlink_to("/etc/passwd")
    (alice_root / "dir-escape").symlink_to(data_dir)
    probes = [
        "/etc/shadow",
        "../../../etc/passwd",
        str(data_dir / "admin-token"),
        str(data_dir / "zeroservice.db"),
        "../admin-token",
        "../../zeroservice.db",
        str(bob_file),
        "../bob/corpus.txt",
        "escape",
        "dir-escape/zeroservice.db",
        str(alice_root) + "/../bob/corpus.txt",
    ]
    for path in probes:
        for route in ("/v1/jobs", "/v1/plan"):
            r = harness.client.post(route, json={"spec": _data(path)}, headers=h)
            assert r.status_code == 422, (path, r.text)
            assert f"data.path: {path!r} is not under this tenant's data roots" in r.text
            assert "bob's words" not in r.text and "root:" not in r.text
    assert _jobs_stored(harness) == 0


@pytest.mark.parametrize(
    "path,message",
    [
        (".", "'.' is a data root itself (a directory): name a file"),
        ("texts/..", "'texts/..' is a data root itself"),
        ("x" * 256, "the name 'xxxxxxxxxxxxxxxxxxxxxxxx'... is over 255 bytes"),
        ("a\nb", "a control character (a NUL, a newline, ...) is refused"),
        ("a\tb", "a control character"),
    ],
)
def test_a_data_path_no_job_could_read_is_refused_by_name(harness, path, message):
    h = harness.headers(harness.tenant_token("alice"))
    (harness.settings.data_dir / "data" / "alice" / "texts").mkdir(parents=True)
    for route in ("/v1/jobs", "/v1/plan"):
        r = harness.client.post(route, json={"spec": _data(path)}, headers=h)
        assert r.status_code == 422 and f"data.path: {message}" in r.text, r.text
    assert _jobs_stored(harness) == 0


def test_a_data_path_under_the_tenants_root_is_stored_resolved(harness):
    h = harness.headers(harness.tenant_token("alice"))
    root = harness.settings.data_dir / "data" / "alice"
    (root / "texts").mkdir(parents=True)
    (root / "texts" / "a.txt").write_text("words " * 100)
    (root / "latest").symlink_to(root / "texts")
    for path, resolved in [
        ("texts/a.txt", root / "texts" / "a.txt"),
        ("latest/a.txt", root / "texts" / "a.txt"),
        (str(root / "texts" / "a.txt"), root / "texts" / "a.txt"),
    ]:
        r = harness.client.post("/v1/jobs", json={"spec": _data(path)}, headers=h)
        assert r.status_code == 201, r.text
        assert r.json()["spec"]["data"]["path"] == os.path.realpath(resolved)


def test_operator_data_roots_are_per_tenant(database_url, tmp_path):
    shared, per_tenant = tmp_path / "shared", tmp_path / "tenants"
    (shared).mkdir()
    (per_tenant / "alice").mkdir(parents=True)
    (shared / "open.txt").write_text("x" * 300)
    (per_tenant / "alice" / "own.txt").write_text("x" * 300)
    h = Harness(
        database_url,
        tmp_path / "data",
        data_roots=(str(per_tenant / "{tenant}"), str(shared)),
    )
    try:
        alice, bob = h.tenant_token("alice"), h.tenant_token("bob")
        for token, path, status in [
            (alice, "own.txt", 201),
            (alice, str(shared / "open.txt"), 201),
            (bob, str(shared / "open.txt"), 201),
            (bob, str(per_tenant / "alice" / "own.txt"), 422),
            (bob, "../alice/own.txt", 422),
        ]:
            r = h.client.post("/v1/jobs", json={"spec": _data(path)}, headers=h.headers(token))
            assert r.status_code == status, (path, r.text)
    finally:
        h.client.close()
        h.service.engine.dispose()


def test_checkpoints_live_under_the_tenants_own_directory(harness):
    c = harness.client
    alice = harness.headers(harness.tenant_token("alice"))
    bob = harness.headers(harness.tenant_token("bob"))
    root = Path(harness.settings.checkpoint_root)
    victim = c.post("/v1/jobs", json={"spec": TINY}, headers=alice).json()
    assert victim["checkpoint_path"] == str(root / "alice" / victim["id"])
    probes = [
        str(root / "alice" / victim["id"]),
        f"../alice/{victim['id']}",
        "../../x",
        "/etc/passwd/x",
        "a/../../alice",
        ".",
        "a//b",
    ]
    for sub in probes:
        spec = _spec(checkpoint={"dir": sub})
        r = c.post("/v1/jobs", json={"spec": spec}, headers=bob)
        assert r.status_code == 422, (sub, r.text)
        assert "checkpoint.dir" in r.text and "is not a relative sub-directory" in r.text
    named = c.post("/v1/jobs", json={"spec": _spec(checkpoint={"dir": "runs/exp-1"})}, headers=bob)
    assert named.status_code == 201, named.text
    assert named.json()["checkpoint_path"] == str(root / "bob" / "runs" / "exp-1")
    harness.tick()
    launched = harness.backend.jobs
    assert launched[victim["id"]]["status"]["checkpoint_root"] == victim["checkpoint_path"]
    assert launched[named.json()["id"]]["status"]["checkpoint_root"] == str(
        root / "bob" / "runs" / "exp-1"
    )


def test_two_active_jobs_never_share_a_checkpoint_directory(harness):
    """A job naming a directory an active job of its tenant writes, or one inside or
    around it, is refused (both would save, prune and resume from each other's steps);
    once that job ends the directory is free again, to resume from."""
    c = harness.client
    alice = harness.headers(harness.tenant_token("alice"))
    bob = harness.headers(harness.tenant_token("bob"))
    first = c.post("/v1/jobs", json={"spec": _spec(checkpoint={"dir": "shared"})}, headers=alice)
    assert first.status_code == 201, first.text
    plain = c.post("/v1/jobs", json={"spec": TINY}, headers=alice).json()
    # Letter case aside: on a file system that ignores it they are one directory.
    for sub in ("shared", "shared/sub", "SHARED/sub", plain["id"], f"{plain['id'].upper()}/x"):
        r = c.post("/v1/jobs", json={"spec": _spec(checkpoint={"dir": sub})}, headers=alice)
        assert r.status_code == 409, (sub, r.text)
        owner = first.json() if sub.lower().startswith("shared") else plain
        assert f"in use by job {owner['id']} (queued), which writes" in r.json()["detail"]
    for sub, who in (("shared-2", alice), ("shared", bob)):
        r = c.post("/v1/jobs", json={"spec": _spec(checkpoint={"dir": sub})}, headers=who)
        assert r.status_code == 201, (sub, r.text)
    assert c.post(f"/v1/jobs/{first.json()['id']}/cancel", headers=alice).is_success
    again = c.post("/v1/jobs", json={"spec": _spec(checkpoint={"dir": "shared"})}, headers=alice)
    assert again.status_code == 201, again.text
    assert again.json()["checkpoint_path"] == first.json()["checkpoint_path"]


def test_submissions_sent_at_once_get_one_checkpoint_directory(database_url, tmp_path):
    """Eight submissions naming one directory, at once through a real server: one is
    queued, seven refused (the tenant's submissions are judged one at a time)."""
    harness = Harness(database_url, tmp_path / "data", rate_per_s=1e9, rate_burst=10**9)
    h = harness.headers(harness.tenant_token("alice"))
    body = {"spec": _spec(checkpoint={"dir": "shared"})}
    try:
        with serve(harness) as url, ThreadPoolExecutor(8) as pool:
            post = partial(httpx.post, f"{url}/v1/jobs", json=body, headers=h, timeout=60)
            codes = sorted(r.status_code for r in pool.map(lambda _: post(), range(8)))
        assert codes == [201] + [409] * 7, codes
        assert _jobs_stored(harness) == 1
    finally:
        harness.client.close()
        harness.service.engine.dispose()


@pytest.mark.parametrize("name", [".", "..", ".hidden", "a/b", "../x"])
def test_tenant_names_cannot_be_paths(harness, name):
    r = harness.client.post(
        "/v1/tenants", json={"name": name}, headers=harness.headers(harness.admin)
    )
    assert r.status_code == 422, r.text


def test_tenant_names_must_differ_beyond_letter_case(harness):
    """A name is a directory, and ``TeamA`` and ``teama`` are one directory on a
    case-insensitive file system: the second is refused, naming the first."""
    admin = harness.headers(harness.admin)
    assert harness.client.post("/v1/tenants", json={"name": "TeamA"}, headers=admin).is_success
    for name in ("teama", "TEAMA", "teamA"):
        r = harness.client.post("/v1/tenants", json={"name": name}, headers=admin)
        assert r.status_code == 409, r.text
        assert "'TeamA' exists" in r.json()["detail"] and "letter case" in r.json()["detail"]
    r = harness.client.post("/v1/tenants", json={"name": "TeamA"}, headers=admin)
    assert r.status_code == 409 and "letter case" not in r.json()["detail"]
    assert harness.client.post("/v1/tenants", json={"name": "TeamB"}, headers=admin).is_success


def test_the_upgrade_stops_at_tenant_names_that_differ_only_in_case(database_url):
    """A store holding such names is left as it is, and the error names them; one
    without them gets the index, which the database then enforces."""
    import sqlalchemy as sa
    from sqlalchemy.exc import IntegrityError

    from api.db import make_engine, utcnow
    from api.migrate import current, upgrade

    engine = make_engine(database_url)
    tenants = sa.table(
        "tenants",
        sa.column("name", sa.String),
        sa.column("created_at", sa.DateTime(timezone=True)),
    )
    try:
        upgrade(engine, "0004")
        with engine.begin() as conn:
            for name in ("TA", "ta", "b"):
                conn.execute(sa.insert(tenants).values(name=name, created_at=utcnow()))
        with pytest.raises(RuntimeError, match=r"\['ta'\]"):
            upgrade(engine)
        assert current(engine) == "0004"
        with engine.begin() as conn:
            conn.execute(sa.update(tenants).where(tenants.c.name == "ta").values(name="ta2"))
        upgrade(engine)
        with pytest.raises(IntegrityError), engine.begin() as conn:
            conn.execute(sa.insert(tenants).values(name="B", created_at=utcnow()))
    finally:
        engine.dispose()


def test_object_storage_checkpoints_stay_under_the_tenants_prefix(database_url, tmp_path):
    """With ZEROSERVICE_CHECKPOINT_S3_ROOT a tenant may keep checkpoints at an s3
    prefix below its own sub-prefix, and nowhere else; without it, at none."""
    s3_root = "s3://zs-bucket/ckpt"
    h = Harness(database_url, tmp_path / "data", checkpoint_s3_root=s3_root)
    try:
        alice = h.headers(h.tenant_token("alice"))
        own = f"{s3_root}/alice/runs/exp-1"
        r = h.client.post("/v1/jobs", json={"spec": _spec(checkpoint={"dir": own})}, headers=alice)
        assert r.status_code == 201, r.text
        assert r.json()["checkpoint_path"] == own
        refused = [
            f"{s3_root}/bob/runs",  # another tenant's prefix
            f"{s3_root}/alice2/x",  # a tenant whose name merely starts alike
            f"{s3_root}/alice",  # the tenant's prefix itself, not below it
            f"{s3_root}/x",
            "s3://zs-bucket/other/alice/x",
            "s3://other-bucket/ckpt/alice/x",
        ]
        for uri in refused:
            spec = _spec(checkpoint={"dir": uri})
            r = h.client.post("/v1/jobs", json={"spec": spec}, headers=alice)
            assert r.status_code == 422, (uri, r.text)
            assert "is not under this tenant's object-storage prefix" in r.text
            assert f"{s3_root}/alice/" in r.text
        for uri in [f"{s3_root}/alice/../bob/x", f"{s3_root}/alice//x", "s3://", "s3://b/./x"]:
            spec = _spec(checkpoint={"dir": uri})
            r = h.client.post("/v1/jobs", json={"spec": spec}, headers=alice)
            assert r.status_code == 422 and "checkpoint.dir" in r.text, (uri, r.text)
        h.tick()
        (launched,) = h.backend.jobs.values()
        assert launched["status"]["checkpoint_root"] == own
    finally:
        h.client.close()
        h.service.engine.dispose()


def test_object_storage_checkpoints_are_refused_without_an_s3_root(harness):
    alice = harness.headers(harness.tenant_token("alice"))
    spec = _spec(checkpoint={"dir": "s3://zs-bucket/ckpt/alice/x"})
    r = harness.client.post("/v1/jobs", json={"spec": spec}, headers=alice)
    assert r.status_code == 422, r.text
    assert "ZEROSERVICE_CHECKPOINT_S3_ROOT is not set" in r.text


def test_object_storage_data_stays_under_the_tenants_prefix(database_url, tmp_path):
    """With ZEROSERVICE_DATA_S3_ROOT a tenant may read data from an s3 object below its
    own sub-prefix, and nowhere else; without it, from none."""
    s3_root = "s3://zs-data/corpora"
    h = Harness(database_url, tmp_path / "data", data_s3_root=s3_root)
    try:
        alice = h.headers(h.tenant_token("alice"))
        own = f"{s3_root}/alice/web/tokens.bin"
        r = h.client.post("/v1/jobs", json={"spec": _data(own)}, headers=alice)
        assert r.status_code == 201, r.text
        refused = [
            f"{s3_root}/bob/web/tokens.bin",
            f"{s3_root}/alice2/x.bin",
            f"{s3_root}/alice",
            "s3://zs-data/other/alice/x.bin",
            "s3://zs-checkpoints/corpora/alice/x.bin",
        ]
        for uri in refused:
            r = h.client.post("/v1/jobs", json={"spec": _data(uri)}, headers=alice)
            assert r.status_code == 422, (uri, r.text)
            assert "data.path" in r.text and f"{s3_root}/alice/" in r.text, r.text
        for uri in [f"{s3_root}/alice/../bob/x", f"{s3_root}/alice//x", "s3://", "s3://b/./x"]:
            r = h.client.post("/v1/jobs", json={"spec": _data(uri)}, headers=alice)
            assert r.status_code == 422 and "data.path" in r.text, (uri, r.text)
        h.tick()
        (launched,) = h.backend.jobs.values()
        assert launched["spec"].data.path == own  # as named: nothing resolves an object
    finally:
        h.client.close()
        h.service.engine.dispose()


def test_object_storage_data_is_refused_without_an_s3_root(harness):
    alice = harness.headers(harness.tenant_token("alice"))
    r = harness.client.post(
        "/v1/jobs", json={"spec": _data("s3://zs-data/corpora/alice/x.bin")}, headers=alice
    )
    assert r.status_code == 422, r.text
    assert "data.path" in r.text and "ZEROSERVICE_DATA_S3_ROOT is not set" in r.text


def test_an_s3_checkpoint_root_places_each_tenants_jobs_under_its_prefix(database_url, tmp_path):
    h = Harness(database_url, tmp_path / "data", checkpoint_root="s3://zs-bucket/all")
    try:
        alice = h.headers(h.tenant_token("alice"))
        job = h.client.post("/v1/jobs", json={"spec": TINY}, headers=alice).json()
        assert job["checkpoint_path"] == f"s3://zs-bucket/all/alice/{job['id']}"
        named = _spec(checkpoint={"dir": "runs/exp-1"})
        job = h.client.post("/v1/jobs", json={"spec": named}, headers=alice).json()
        assert job["checkpoint_path"] == "s3://zs-bucket/all/alice/runs/exp-1"
    finally:
        h.client.close()
        h.service.engine.dispose()
