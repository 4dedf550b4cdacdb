"""Supervised jobs on a real local Ray: completion, DP × MP, worker loss, stalls."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.workers.jobs import tiny_job

pytestmark = pytest.mark.slow


def _run(ray, job_id, spec, root, timeout=240):
    from workers.jobs import launch

    handle = launch(job_id, spec, root)
    status = ray.get(handle.wait.remote(timeout))
    return handle, status


def test_dp2_cpu_job_completes(local_ray, tmp_path):
    ray = local_ray
    handle, status = _run(ray, "dp2", tiny_job(), tmp_path / "ckpt")
    info = ray.get(handle.status.remote())
    assert status == "succeeded", info
    losses = ray.get(handle.losses.remote())
    assert sorted(losses) == list(range(1, 9))
    assert losses[8] < losses[1]
    kinds = [(e["kind"], e["reason"]) for e in ray.get(handle.events.remote())]
    assert ("checkpoint", "saved") in kinds and ("status", "completed") in kinds
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "step-00000004",
        "step-00000008",
    ]
    ray.kill(handle)


def _wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_dp2_mp2_job_on_fractional_cpus_completes(local_ray, tmp_path):
    ray = local_ray
    spec = tiny_job(
        resources={"dp": 2, "mp": 2, "cpus_per_rank": 0.5},
        engine={"stage": 3, "bucket_elements": 4096},
    )
    handle, status = _run(ray, "dp2mp2", spec, tmp_path / "ckpt")
    assert status == "succeeded", ray.get(handle.status.remote())
    ranks = ray.get(handle.metrics.remote())
    assert len(ranks) == 4
    ledgers = [ranks[str(r)]["ledger"] for r in range(4)]
    assert all(led["mp"] == 2 and led["n_d"] == 2 for led in ledgers)
    assert all(led["model_states"] == led["expected_padded"] for led in ledgers)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["mp-00-of-02", "mp-01-of-02"]
    ray.kill(handle)


def test_killed_worker_resumes_from_checkpoint_with_fewer_ranks(local_ray, tmp_path):
    ray = local_ray
    spec = tiny_job(
        steps=24,
        resources={"dp": 2, "min_dp": 1, "max_dp": 2, "cpus_per_rank": 2},
        checkpoint={"interval_steps": 4},
    )
    from workers.jobs import launch

    handle = launch("killed", spec, tmp_path / "ckpt")
    _wait_for(lambda: ray.get(handle.status.remote())["step"] >= 4, 120, "the first checkpoint")
    # Capacity for one replica only once the group is torn down: a blocker queued now
    # takes the CPUs the killed rank's replica frees.
    blocker = ray.remote(num_cpus=2)(_Blocker).remote()
    victim = ray.get(handle.ranks.remote())[1]
    os.kill(victim["pid"], signal.SIGKILL)
    status = ray.get(handle.wait.remote(300))
    info = ray.get(handle.status.remote())
    assert status == "succeeded", info
    events = ray.get(handle.events.remote())
    restarts = [e for e in events if e["kind"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["reason"] == "worker_lost"
    assert "rank 1" in restarts[0]["message"]
    assert info["restarts"] == 1
    resumed = [e for e in events if e["kind"] == "placed"][1]
    assert resumed["dp"] == 1
    saved = {e["step"] for e in events if e["kind"] == "checkpoint"}
    assert resumed["step"] in saved and resumed["step"] >= 4
    assert "from checkpoint" in resumed["message"]
    shrink = [e for e in events if e["kind"] == "resize"]
    assert shrink and shrink[0]["reason"] == "shrunk" and shrink[0]["dp_from"] == 2
    losses = ray.get(handle.losses.remote())
    assert sorted(losses) == list(range(1, 25))
    ray.kill(blocker)
    ray.kill(handle)


class _Blocker:
    def ping(self) -> bool:
        return True


def test_frozen_rank_is_named_by_the_watchdog(local_ray, tmp_path):
    ray = local_ray
    step_timeout = 6.0
    spec = tiny_job(
        steps=100_000,
        max_restarts=0,
        checkpoint={"interval_steps": 100_000},
        timeouts={"bootstrap_s": 60, "step_s": step_timeout},
    )
    from workers.jobs import launch

    handle = launch("frozen", spec, tmp_path / "ckpt")
    _wait_for(lambda: ray.get(handle.status.remote())["status"] == "running", 120, "running")
    time.sleep(1.0)
    victim = ray.get(handle.ranks.remote())[1]
    os.kill(victim["pid"], signal.SIGSTOP)
    stopped = time.monotonic()
    status = ray.get(handle.wait.remote(120))
    detected = time.monotonic() - stopped
    events = ray.get(handle.events.remote())
    assert status == "failed"
    stall = [e for e in events if e["kind"] == "restart"][0]
    assert stall["reason"] == "stalled" and stall["ranks"] == [1]
    assert "rank 1 (dp 1, mp 0" in stall["message"]
    assert "not responding" in stall["message"]
    # The last collective each rank entered is named (rank 0 waits inside one).
    assert "rank 0: collective #" in stall["message"]
    # Detected within the step timeout plus the polling slack (a poll is <= 2 s).
    assert detected < step_timeout + 10
    ray.kill(handle)
