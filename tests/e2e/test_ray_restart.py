"""The Ray head of the local stack stops and `zeroservice up` starts it again:
meanwhile the routes that need the cluster answer 503 with Retry-After (the store's
routes still answer), and the API rejoins the new head by itself."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from api.settings import Settings
from tests.waiting import wait_for
from zscli.server import stop_ray_head

pytestmark = pytest.mark.slow


def test_the_api_answers_503_while_ray_is_down_and_rejoins_it(stack):
    cli, env, tmp = stack
    home = tmp / "home"
    record = json.loads((home / "stack.json").read_text())
    http = httpx.Client(base_url=record["url"], timeout=60)
    auth = {"Authorization": "Bearer " + Path(record["token_file"]).read_text().strip()}
    assert http.get("/v1/cluster", headers=auth).status_code == 200

    settings = Settings(data_dir=home, port=int(env["ZEROSERVICE_PORT"]))
    stop_ray_head(settings, record["ray_address"])
    down = http.get("/v1/cluster", headers=auth)
    assert down.status_code == 503 and down.headers["Retry-After"] == "5"
    assert "the Ray cluster unavailable" in down.json()["detail"]
    assert http.get("/readyz").status_code == 503
    assert http.get("/v1/jobs", headers=auth).status_code == 200  # the store still answers

    again = cli("up", "--cpus", "2")  # the API runs: only the head starts, on its address
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"Ray: {record['ray_address']} (had stopped: started again" in again.stdout
    back = wait_for(
        lambda: _answer(http, "/v1/cluster", auth),
        120,
        "the API to rejoin the restarted Ray head",
        interval=1.0,
    )
    assert back.json()["total"]["CPU"] == 2.0
    wait_for(lambda: _answer(http, "/readyz", {}), 60, "readiness")
    assert json.loads((home / "stack.json").read_text())["api_pid"] == record["api_pid"]


def _answer(http: httpx.Client, path: str, headers: dict) -> httpx.Response | None:
    """A 200 answer, or None (also while the API process restarts to rejoin Ray)."""
    try:
        r = http.get(path, headers=headers)
    except httpx.TransportError:
        return None
    return r if r.status_code == 200 else None
