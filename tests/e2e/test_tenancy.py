"""An unfriendly tenant against the local stack (`zeroservice up`, a real Ray, SQLite):
code for the control plane to run, files outside its data roots, another tenant's
checkpoints. A job it may run checkpoints under its own directory."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import TINY_JOB
from tests.waiting import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def stack_env():
    return {"ZEROSERVICE_MODEL_FACTORIES": "tests.workers.factories"}


def _api(home: Path) -> tuple[httpx.Client, dict]:
    record = json.loads((home / "stack.json").read_text())
    admin = Path(record["token_file"]).read_text().strip()
    http = httpx.Client(base_url=record["url"], timeout=120)
    auth = {"Authorization": f"Bearer {admin}"}
    for tenant in ("mallory", "alice"):
        assert http.post("/v1/tenants", json={"name": tenant}, headers=auth).status_code == 201
    return http, {
        t: {"Authorization": "Bearer " + _token(http, auth, t)} for t in ("mallory", "alice")
    }


def _token(http: httpx.Client, auth: dict, tenant: str) -> str:
    return http.post("/v1/tokens", json={"tenant": tenant}, headers=auth).json()["token"]


def test_an_unfriendly_tenant_reaches_nothing_of_the_control_plane(stack, tmp_path):
    _, _, tmp = stack
    home = tmp / "home"
    http, headers = _api(home)
    api_pid = json.loads((home / "stack.json").read_text())["api_pid"]
    mallory, alice = headers["mallory"], headers["alice"]

    marker = tmp_path / "x"
    system = {"kind": "factory", "factory": "os:system", "vocab_size": 64}
    system["kwargs"] = {"command": f"touch {marker}"}
    for route in ("/v1/jobs", "/v1/plan"):
        r = http.post(route, json={"spec": {**TINY_JOB, "model": system}}, headers=mallory)
        assert r.status_code == 422 and "model.factory: 'os:system'" in r.text, r.text
    assert not marker.exists()

    pid_file = tmp_path / "pid"
    allowed = {
        "kind": "factory",
        "factory": "tests.workers.factories:recorded",
        "kwargs": {"path": str(pid_file)},
        "vocab_size": 256,
        "seq_len": 16,
    }
    r = http.post("/v1/plan", json={"spec": {**TINY_JOB, "model": allowed}}, headers=mallory)
    assert r.status_code == 200 and r.json()["fits"] is True, r.text
    assert int(pid_file.read_text()) != api_pid  # built by a Ray worker, not the API

    for path in (
        "/etc/shadow",
        "../../../etc/passwd",
        str(home / "admin-token"),
        "../../zeroservice.db",
    ):
        spec = {**TINY_JOB, "data": {"kind": "text", "path": path}}
        r = http.post("/v1/jobs", json={"spec": spec}, headers=mallory)
        assert r.status_code == 422 and "data.path" in r.text, r.text

    job = {**TINY_JOB, "name": "alice", "steps": 4, "checkpoint": {"interval_steps": 2}}
    victim = http.post("/v1/jobs", json={"spec": job}, headers=alice).json()
    for sub in (victim["checkpoint_path"], f"../alice/{victim['id']}", "../../x", "/etc/passwd/x"):
        spec = {**job, "checkpoint": {"dir": sub}}
        r = http.post("/v1/jobs", json={"spec": spec}, headers=mallory)
        assert r.status_code == 422 and "checkpoint.dir" in r.text, r.text

    done = wait_for(
        lambda: (lambda j: j if j["status"] in ("succeeded", "failed") else None)(
            http.get(f"/v1/jobs/{victim['id']}", headers=alice).json()
        ),
        240,
        "alice's job to finish",
    )
    assert done["status"] == "succeeded", done
    saved = Path(done["checkpoint_path"])
    assert saved == home / "checkpoints" / "alice" / victim["id"]
    assert any(saved.glob("step-*"))
