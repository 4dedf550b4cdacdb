"""The supervisor is supervised: its process killed on a real local Ray, the control
plane's next sync starts a new one, which adopts the ranks still running (or, when
one of them died too, goes on from the newest checkpoint); the job succeeds with
every step."""

from __future__ import annotations

import contextlib
import os
import signal
import time

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


def _harness(tmp_path, **settings):
    from api.backend import RayBackend
    from tests.api.conftest import Harness

    h = Harness(
        f"sqlite:///{tmp_path / 'store.db'}", tmp_path / "data", backend=RayBackend(), **settings
    )
    return h, h.headers(h.tenant_token("alice"))


def _run_and_kill(ray, tmp_path, also_kill_rank: bool, sig=signal.SIGKILL, **settings):
    """Submit, wait for the first checkpoint, send ``sig`` to the supervisor's process
    (SIGKILL with ``also_kill_rank`` to rank 1's), tick until the job ends; its end and
    events."""
    from workers.jobs import attach

    h, auth = _harness(tmp_path, **settings)
    job_id = h.client.post("/v1/jobs", json={"spec": SPEC}, headers=auth).json()["id"]

    def job():
        h.tick()
        return h.client.get(f"/v1/jobs/{job_id}", headers=auth).json()

    wait_for(lambda: job()["step"] >= 4, 180, "the first checkpoint", job)
    first = attach(job_id)
    supervisor = ray.get(first.process_id.remote())
    rank = ray.get(first.ranks.remote())[1]["pid"]
    os.kill(supervisor, sig)
    if also_kill_rank:
        os.kill(rank, signal.SIGKILL)
    try:
        done = wait_for(
            lambda: (lambda j: j if j["status"] in ("succeeded", "failed") else None)(job()),
            300,
            "the job to end",
            job,
        )
    finally:
        if sig == signal.SIGSTOP:  # a stop the control plane did not end ends here
            with contextlib.suppress(ProcessLookupError):
                os.kill(supervisor, signal.SIGCONT)
    events = h.client.get(f"/v1/jobs/{job_id}/events?limit=1000", headers=auth).json()
    history = h.client.get(f"/v1/jobs/{job_id}/metrics", headers=auth).json()["history"]
    h.client.close()
    h.service.engine.dispose()
    return done, events, history


def _after_loss(events):
    lost = [i for i, e in enumerate(events) if e["reason"] == "supervisor_lost"]
    assert events[lost[0]]["kind"] == "restart"
    return [e for e in events[lost[0] :] if e["kind"] == "placed"]


def test_a_killed_supervisor_is_replaced_and_adopts_the_running_ranks(local_ray, tmp_path):
    done, events, history = _run_and_kill(local_ray, tmp_path, also_kill_rank=False)
    assert done["status"] == "succeeded", done
    assert done["step"] == 24 and done["attempts"] == 1
    placed = _after_loss(events)
    assert [e["reason"] for e in placed] == ["adopted"], placed
    # Every step's point reached the store, the chunk in flight at the kill included.
    assert [h["step"] for h in history] == list(range(1, 25))


def test_a_stopped_supervisor_is_replaced_and_its_ranks_adopted(local_ray, tmp_path):
    """SIGSTOP: alive to Ray, silent to the control plane, which stops its process once
    it has answered no poll for ``supervisor_silent_s`` and starts a successor (see
    [Note: supervised supervisor] in api/scheduler.py)."""
    done, events, history = _run_and_kill(
        local_ray,
        tmp_path,
        also_kill_rank=False,
        sig=signal.SIGSTOP,
        supervisor_poll_timeout_s=1.0,
        supervisor_silent_s=3.0,
    )
    assert done["status"] == "succeeded", done
    assert done["step"] == 24 and done["attempts"] == 1
    (lost,) = [e for e in events if e["kind"] == "restart"]
    assert lost["reason"] == "supervisor_lost", lost
    assert "answered no poll for" in lost["message"], lost
    placed = _after_loss(events)
    assert [e["reason"] for e in placed] == ["adopted"], placed
    assert [h["step"] for h in history] == list(range(1, 25))


def test_a_supervisor_lost_before_the_store_saw_it_run_leaves_nothing_in_the_way(
    local_ray, tmp_path
):
    """The supervisor placed and set up its group, then died before a poll saw the job
    running: the store still says ``starting``, so the next tick launches the job again
    (not a succession). Its first supervisor's ranks and placement group must not stand
    in the way of the new group (same names, the cluster's CPUs)."""
    from workers.jobs import attach

    h, auth = _harness(tmp_path)
    spec = {**SPEC, "steps": 8}
    job_id = h.client.post("/v1/jobs", json={"spec": spec}, headers=auth).json()["id"]

    def job():
        return h.client.get(f"/v1/jobs/{job_id}", headers=auth).json()

    h.tick()  # admitted and launched; not polled again until the kill
    first = attach(job_id)
    wait_for(lambda: len(local_ray.get(first.ranks.remote())) == 2, 120, "the first group", job)
    os.kill(local_ray.get(first.process_id.remote()), signal.SIGKILL)
    assert job()["status"] == "starting"

    def ended():
        h.tick()
        return (lambda j: j if j["status"] in ("succeeded", "failed") else None)(job())

    done = wait_for(ended, 300, "the job to end", job)
    assert done["status"] == "succeeded" and done["step"] == 8, (done["reason"], done["message"])
    named = local_ray.util.list_named_actors(all_namespaces=True)
    assert not [a for a in named if a["name"].startswith("zeroservice-rank-")]  # none left
    h.client.close()
    h.service.engine.dispose()


def test_without_its_ranks_the_new_supervisor_goes_on_from_the_checkpoint(local_ray, tmp_path):
    done, events, _ = _run_and_kill(local_ray, tmp_path, also_kill_rank=True)
    assert done["status"] == "succeeded", done
    assert done["step"] == 24 and done["attempts"] == 1
    placed = _after_loss(events)
    assert placed[0]["reason"] == "started" and "from checkpoint" in placed[0]["message"]
    assert placed[0]["data"]["step"] >= 4
    named = local_ray.util.list_named_actors(all_namespaces=True)
    assert not [a for a in named if a["name"].startswith("zeroservice-rank-")]  # none left


def test_a_supervisor_lost_after_a_live_resize_adopts_the_resized_group(local_ray, tmp_path):
    """Live resizes leave members with names of several attempts (the survivor's and
    the newcomer's); the new supervisor finds the group by asking its members, adopts
    both ranks without a checkpoint, and the history keeps every step once."""
    from workers.jobs import attach

    spec = {
        **SPEC,
        "name": "supervised-live",
        "engine": {**SPEC["engine"], "redundancy": "host-copy"},
        "steps": 100_000,  # runs until the adoption was seen, then cancelled
        "resources": {"dp": 2, "min_dp": 1, "max_dp": 2, "cpus_per_rank": 1},
        "checkpoint": {"interval_steps": 50},
        "max_restarts": 4,
    }
    h, auth = _harness(tmp_path)
    job_id = h.client.post("/v1/jobs", json={"spec": spec}, headers=auth).json()["id"]

    def job():
        h.tick()
        return h.client.get(f"/v1/jobs/{job_id}", headers=auth).json()

    def events():
        got = h.client.get(f"/v1/jobs/{job_id}/events?limit=1000", headers=auth).json()
        return [(e["kind"], e["reason"], e["message"]) for e in got]

    def seen(kind, reason):
        job()
        return [e for e in events() if e[:2] == (kind, reason)]

    wait_for(lambda: job()["step"] >= 4, 180, "training", job)
    first = attach(job_id)
    os.kill(local_ray.get(first.ranks.remote())[1]["pid"], signal.SIGKILL)
    wait_for(lambda: seen("resize", "grown"), 180, "the live grow-back", events)
    assert seen("placed", "regrouped"), events()
    # Kill it inside the chunk after the grow, not while that chunk's calls are on
    # their way: a kill there can leave a call on one rank only, and then the group is
    # not adopted but restarted from the checkpoint (test_controller's
    # test_a_replacement_supervisor_does_not_adopt_a_group_whose_last_call_failed).
    time.sleep(2.0)
    os.kill(local_ray.get(first.process_id.remote()), signal.SIGKILL)

    def adoption():
        found = seen("placed", "adopted")
        assert found or job()["status"] not in ("failed", "cancelled", "succeeded"), events()
        return found

    adopted = wait_for(adoption, 180, "the adoption", events)
    assert "2 running ranks" in adopted[0][2], adopted
    after = events()[events().index(adopted[0]) :]
    assert not [e for e in after if e[:2] == ("placed", "started")], after  # no restart
    step = job()["step"]
    wait_for(lambda: job()["step"] >= step + 5, 120, "training after the adoption", job)
    assert job()["current_dp"] == 2
    h.client.post(f"/v1/jobs/{job_id}/cancel", headers=auth)
    wait_for(lambda: job()["status"] == "cancelled", 120, "the cancel", job)
    history = h.client.get(f"/v1/jobs/{job_id}/metrics", headers=auth).json()["history"]
    steps = [p["step"] for p in history]
    missing = sorted(set(range(1, steps[-1] + 1)) - set(steps))
    assert steps == list(range(1, len(steps) + 1)), (missing, events())
    h.client.close()
    h.service.engine.dispose()
