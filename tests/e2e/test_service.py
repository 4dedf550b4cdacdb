"""The whole stack as a user runs it: `zeroservice up`, the CLI, a real local Ray,
the API killed under a running job and started again by `zeroservice up`,
cancellation, `zeroservice down`."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import TINY_JOB
from tests.waiting import wait_for
from zscli.server import processes_with

pytestmark = pytest.mark.slow

JOB = {**TINY_JOB, "name": "e2e", "steps": 12, "checkpoint": {"interval_steps": 4}}


def _rank_processes() -> int:
    return len(processes_with(b"ray::RankActor"))


def _status(cli, job_id) -> dict | None:
    out = cli("status", job_id)
    return json.loads(out.stdout) if out.returncode == 0 else None  # the API may be restarting


def _wait(cli, job_id, statuses, timeout=180):
    return wait_for(
        lambda: (lambda job: job if job and job["status"] in statuses else None)(
            _status(cli, job_id)
        ),
        timeout,
        f"job {job_id} to reach {statuses}",
        interval=0.5,
    )


def test_submit_watch_restart_cancel(stack):
    cli, env, tmp = stack
    spec = tmp / "job.json"
    spec.write_text(json.dumps(JOB))
    watched = cli("submit", str(spec), "--watch")
    assert watched.returncode == 0, watched.stdout + watched.stderr
    assert "succeeded: completed: 12 steps" in watched.stdout
    assert "step 12/12" in watched.stdout and "tokens/s" in watched.stdout
    job_id = watched.stdout.split()[1]
    events = cli("events", job_id).stdout
    assert "checkpoint" in events and "completed" in events and "admitted" in events
    assert "tokens/s" in cli("logs", job_id).stdout
    lines = watched.stdout.splitlines()
    assert "nan" not in watched.stdout and " ETA ?" not in watched.stdout
    assert all(a != b for a, b in zip(lines, lines[1:], strict=False)), watched.stdout
    follow = cli("logs", "--follow", job_id, timeout=60)  # the job has ended: it returns
    assert follow.returncode == 0 and "step 12/12" in follow.stdout
    report = cli("report", job_id, "--out", str(tmp / "report"))
    assert report.returncode == 0, report.stdout + report.stderr
    page = (tmp / "report" / "index.html").read_text()
    assert all(f'src="{n}.png"' in page for n in ("loss", "throughput", "memory", "bandwidth"))

    # The API is killed under a running job and `zeroservice up` run again: the stack's
    # Ray runs on, so the API starts on it and reattaches to the job, which goes on.
    spec.write_text(json.dumps({**JOB, "steps": 120, "checkpoint": {"interval_steps": 20}}))
    long = cli("submit", str(spec))
    long_id = long.stdout.split()[1]
    _wait(cli, long_id, {"running"})
    record_path = Path(env["ZEROSERVICE_HOME"]) / "stack.json"
    record = json.loads(record_path.read_text())
    os.kill(record["api_pid"], signal.SIGKILL)
    again = cli("up", "--cpus", "4")
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"Ray: {record['ray_address']} (already running" in again.stdout, again.stdout
    assert len(processes_with(b"ray::JobSupervisor")) == 1  # no second copy of the job
    done = _wait(cli, long_id, {"succeeded", "failed"}, timeout=150)
    assert done["status"] == "succeeded", done
    assert done["step"] == 120 and done["attempts"] == 0, done  # reattached, not restarted
    both = cli("compare", job_id, long_id, "--out", str(tmp / "compare.png"))
    assert both.returncode == 0, both.stdout + both.stderr
    assert (tmp / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Cancel a running job: its rank actors are gone.
    spec.write_text(json.dumps({**JOB, "steps": 100_000, "checkpoint": {"interval_steps": 50}}))
    forever = cli("submit", str(spec)).stdout.split()[1]
    _wait(cli, forever, {"running"})
    time.sleep(2.0)
    assert _rank_processes() == 2
    assert "cancel requested" in cli("cancel", forever).stdout
    assert _wait(cli, forever, {"cancelled"}, timeout=60)["reason"] == "cancelled"
    wait_for(lambda: _rank_processes() == 0, 30, "the rank actors to exit", interval=0.5)
    listing = cli("list").stdout
    assert listing.count("succeeded") == 2 and "cancelled" in listing
