"""A real Prometheus (Debian's package) scrapes the local stack during a real job, with
the project's own scrape configuration (deploy/prometheus/prometheus.yml: the API's
/metrics and the ranks found through its HTTP service discovery); every dashboard
panel's query, evaluated through Prometheus' HTTP API, returns at least one series.
Then the PNG report of the finished job is produced."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.conftest import TINY_JOB, free_port
from tests.waiting import wait_for

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]

JOB = {**TINY_JOB, "name": "observed", "steps": 100_000, "checkpoint": {"interval_steps": 25}}


def _prometheus_config(api: str, token_file: Path) -> dict:
    """The project's compose configuration, pointed at this stack and scraping fast."""
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    for job in config["scrape_configs"]:
        if "authorization" in job:
            job["authorization"]["credentials_file"] = str(token_file)
        for static in job.get("static_configs", []):
            static["targets"] = [api]
        for sd in job.get("http_sd_configs", []):
            sd["url"] = sd["url"].replace("api:8765", api)
            sd["refresh_interval"] = "1s"
            sd["authorization"]["credentials_file"] = str(token_file)
    return config


def _queries(job_id: str) -> list[tuple[str, str]]:
    out = []
    for path in sorted((ROOT / "dashboards").glob("*.json")):
        dashboard = json.loads(path.read_text())
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                expr = target["expr"].replace("$job", job_id).replace("$rank", ".*")
                out.append((f"{path.stem}: {panel['title']}", expr))
    return out


def _query(prom: str, expr: str) -> list:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert r["status"] == "success", (expr, r)
    return r["data"]["result"]


def test_prometheus_scrapes_every_panel_and_the_report_renders(stack, tmp_path):
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed (.ci/run installs Debian's package)"
    cli, env, _ = stack
    home = Path(env["ZEROSERVICE_HOME"])
    record = json.loads((home / "stack.json").read_text())
    api = record["url"].removeprefix("http://")
    token_file = tmp_path / "token"
    token_file.write_text(Path(record["token_file"]).read_text())
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(_prometheus_config(api, token_file)))
    check = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    prom_url = f"http://127.0.0.1:{port}"
    prom = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        httpx.get(f"{record['url']}/v1/jobs")  # a 401: the errors panel has a series
        spec = tmp_path / "job.json"
        spec.write_text(json.dumps(JOB))
        job_id = cli("submit", str(spec)).stdout.split()[1]
        deadline = time.monotonic() + 180
        missing: list[str] = []
        while time.monotonic() < deadline:
            time.sleep(3)
            missing = [name for name, expr in _queries(job_id) if not _query(prom_url, expr)]
            if not missing:
                break
        assert not missing, f"panels without a series: {missing}"
        targets = httpx.get(f"{prom_url}/api/v1/targets", timeout=10).json()["data"]
        pools = {t["labels"]["job"] for t in targets["activeTargets"] if t["health"] == "up"}
        assert pools == {"zeroservice-api", "zeroservice-ranks"}
        ranks = [t for t in targets["activeTargets"] if t["labels"]["job"] == "zeroservice-ranks"]
        assert len(ranks) == 2 and all(t["labels"]["job_id"] == job_id for t in ranks)
        # Every query had data while the job was still running (not after it ended).
        assert json.loads(cli("status", job_id).stdout)["status"] == "running"
    finally:
        prom.terminate()
        prom.wait(timeout=30)
    assert "cancel requested" in cli("cancel", job_id).stdout
    wait_for(
        lambda: json.loads(cli("status", job_id).stdout)["status"] == "cancelled",
        60,
        "the cancellation",
        interval=0.5,
    )
    report = cli("report", job_id, "--out", str(tmp_path / "report"))
    assert report.returncode == 0, report.stdout + report.stderr
    for name in ("memory.png", "loss.png", "throughput.png", "bandwidth.png"):
        png = tmp_path / "report" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 10_000, name
