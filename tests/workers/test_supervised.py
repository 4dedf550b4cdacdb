"""The supervisor is supervised: its process killed on a real local Ray, the control
plane's next sync starts a new one, which goes on from the newest checkpoint; the
job succeeds with every step."""

from __future__ import annotations

import os
import signal

import pytest

from tests.waiting import wait_for

pytestmark = pytest.mark.slow

SPEC = {
    "name": "supervised",
    "model": {"vocab_size": 256, "seq_len": 16, "n_layer": 2, "n_head": 4, "dim": 32},
    "engine": {"stage": 2, "bucket_elements": 4096},
    "steps": 24,
    "micro_batch": 2,
    "resources": {"dp": 2, "cpus_per_rank": 1},
    "checkpoint": {"interval_steps": 4},
    "timeouts": {"bootstrap_s": 60, "step_s": 60},
    "max_restarts": 1,
}


def test_a_killed_supervisor_is_replaced_and_the_job_goes_on(local_ray, tmp_path):
    from api.backend import RayBackend
    from tests.api.conftest import Harness
    from workers.jobs import attach

    ray = local_ray
    h = Harness(f"sqlite:///{tmp_path / 'store.db'}", tmp_path / "data", backend=RayBackend())
    auth = h.headers(h.tenant_token("alice"))
    job_id = h.client.post("/v1/jobs", json={"spec": SPEC}, headers=auth).json()["id"]

    def job():
        h.tick()
        return h.client.get(f"/v1/jobs/{job_id}", headers=auth).json()

    wait_for(lambda: job()["step"] >= 4, 180, "the first checkpoint", job)
    first = attach(job_id)
    os.kill(ray.get(first.process_id.remote()), signal.SIGKILL)
    done = wait_for(
        lambda: (lambda j: j if j["status"] in ("succeeded", "failed") else None)(job()),
        300,
        "the job to end",
        job,
    )
    assert done["status"] == "succeeded", done
    assert done["step"] == 24 and done["attempts"] == 1
    events = h.client.get(f"/v1/jobs/{job_id}/events?limit=1000", headers=auth).json()
    lost = [i for i, e in enumerate(events) if e["reason"] == "supervisor_lost"]
    assert events[lost[0]]["kind"] == "restart"
    placed = [e for e in events[lost[0] :] if e["kind"] == "placed"]
    assert placed and "from checkpoint" in placed[0]["message"]
    assert placed[0]["data"]["step"] >= 4
    history = h.client.get(f"/v1/jobs/{job_id}/metrics", headers=auth).json()["history"]
    assert history[-1]["step"] == 24
    h.client.close()
    h.service.engine.dispose()
