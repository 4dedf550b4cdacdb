"""Admission counts what launched jobs will take before Ray does (see [Note: claims of
admitted jobs] in api/claims.py): on a real local Ray, jobs whose supervisors have not
placed their ranks yet hold their smallest size against the queue behind them."""

from __future__ import annotations

import shutil
import tempfile

import pytest

from api.claims import Claims

SPEC = {
    "name": "claims",
    "model": {"vocab_size": 256, "seq_len": 16, "n_layer": 1, "n_head": 2, "dim": 16},
    "steps": 4,
    "micro_batch": 1,
    "resources": {"dp": 1, "cpus_per_rank": 1},
}


def test_a_claim_holds_until_its_placement_settles_or_it_is_released():
    now = [0.0]
    claims = Claims(settle_s=2.0, clock=lambda: now[0])
    claims.claim("a", [{"CPU": 1.0}, {"CPU": 1.0}])
    claims.claim("b", [{"CPU": 0.5, "GPU": 1.0}])
    assert claims.unclaimed({"CPU": 4.0, "GPU": 1.0}, []) == {"CPU": 1.5, "GPU": 0.0}
    assert claims.unclaimed({"CPU": 4.0}, ["a"]) == {"CPU": 1.5, "GPU": -1.0}  # settling
    now[0] = 1.9
    assert claims.unclaimed({"CPU": 4.0}, []) == {"CPU": 1.5, "GPU": -1.0}
    now[0] = 2.0  # Ray's own count has had time to show a's group
    assert claims.unclaimed({"CPU": 4.0}, []) == {"CPU": 3.5, "GPU": -1.0}
    assert claims.jobs == ["b"]
    claims.release("b")
    assert claims.unclaimed({"CPU": 4.0}, []) == {"CPU": 4.0}


@pytest.fixture(scope="module")
def two_cpu_ray():
    import ray

    from workers.cluster import start_local_ray

    workdir = tempfile.mkdtemp(prefix="zs-")
    start_local_ray(num_cpus=2, workdir=workdir)
    yield ray
    ray.shutdown()
    shutil.rmtree(workdir, ignore_errors=True)


def test_jobs_not_yet_placed_hold_their_room_against_the_queue(two_cpu_ray, tmp_path, monkeypatch):
    """Three one-CPU jobs on two free CPUs: one round admits two, a placed group and a
    claim keep the third queued, and a job that ends gives its claim back."""
    from ray.util.placement_group import placement_group, remove_placement_group

    import workers.jobs
    from api.backend import RayBackend
    from tests.api.conftest import Harness
    from workers.placement import placement_name

    launched: list[str] = []
    monkeypatch.setattr(workers.jobs, "launch", lambda job_id, *a, **k: launched.append(job_id))
    backend = RayBackend()
    now = [0.0]
    backend.claims.clock = lambda: now[0]
    status = {}

    def poll(job_id, *args, **kwargs):  # a supervisor placing its ranks, or ended
        st = {"status": status.get(job_id, "starting"), "reason": "placing", "message": ""}
        st.update(dp=1, step=0, restarts=0)
        return {"status": st, "events": [], "logs": [], "metrics": {}, "history": []}

    monkeypatch.setattr(backend, "poll", poll)
    h = Harness(f"sqlite:///{tmp_path / 'store.db'}", tmp_path / "data", backend=backend)
    auth = h.headers(h.tenant_token("alice"))
    jobs = []
    for _ in range(3):
        r = h.client.post("/v1/jobs", json={"spec": SPEC}, headers=auth)
        assert r.status_code == 201, r.text
        jobs.append(r.json()["id"])

    h.tick()
    assert launched == jobs[:2]  # Ray still shows 2 free CPUs: the claims hold them

    group = placement_group([{"CPU": 1.0}], name=placement_name(jobs[0], 1), lifetime="detached")
    two_cpu_ray.get(group.ready(), timeout=30)  # the first job's ranks are placed
    h.tick()
    now[0] += backend.claims.settle_s  # Ray's free resources show the group by now
    h.tick()
    assert launched == jobs[:2]  # its group, and the second's claim, fill the cluster
    assert backend.claims.jobs == [jobs[1]]

    status[jobs[1]] = "failed"  # the second ends before it placed anything
    h.tick()
    assert launched == jobs
    remove_placement_group(group)
    h.client.close()
    h.service.engine.dispose()
