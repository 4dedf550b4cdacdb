"""Chaos: at least 20 seeded faults of six kinds against one job through the control
plane (tests/e2e/chaos_scenario.py, in a process of its own): rank SIGKILL and SIGSTOP,
a node removed and added back, the supervisor killed, the API service restarted, and
a full disk during a save (where the test may mount a small tmpfs). The job succeeds,
its history has every step exactly once, every checkpoint left verifies, and each
restarted API schedules from its first tick."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]


def test_twenty_one_faults_and_the_job_succeeds_with_every_step_once():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run(
        [sys.executable, "-m", "tests.e2e.chaos_scenario", "--seed", "7", "--faults", "21"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    kinds = Counter(f["kind"] for f in result["faults"])
    assert sum(kinds.values()) >= 20, kinds
    expected = {"rank_kill", "rank_stop", "node", "supervisor", "api"}
    if result["mounted"]:
        expected.add("disk_full")
    assert set(kinds) == expected, kinds
    # A restarted API took its scheduler lease back at once (api/lease.py).
    assert all(f["scheduling_at_once"] for f in result["faults"] if f["kind"] == "api")
    job = result["job"]
    assert job["status"] == "succeeded", job
    assert result["history"] == list(range(1, result["steps"] + 1))  # none missing, none twice
    events = result["events"]
    saved = {e["data"].get("path") for e in events if e["reason"] == "saved"}
    loaded = [e["data"].get("from_checkpoint") for e in events if e["kind"] == "placed"]
    assert {p for p in loaded if p} <= saved  # only committed checkpoints were loaded
    regrouped = [e for e in events if e["reason"] == "regrouped"]
    assert sum(e["data"]["from_peers"] for e in regrouped) >= kinds["rank_kill"]
    if result["mounted"]:
        assert sum(e["reason"] == "save_failed" for e in events) >= kinds["disk_full"]
    assert result["checkpoints"], "no checkpoint left"
    for path, verdict in result["checkpoints"].items():
        assert "every checksum matches" in verdict, (path, verdict)
