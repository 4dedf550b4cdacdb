"""A reservation of room to grow that found none is not tried again at every step while
the cluster's free resources stay as they were (see [Note: a reservation that found no
room] in workers/ray_group.py): each try waits out a placement's probe."""

from __future__ import annotations

import types

from tests.workers.jobs import tiny_job
from workers import ray_group


def test_a_reservation_that_found_no_room_waits_for_the_free_resources_to_change(
    monkeypatch,
):
    tried, free, now = [], {"CPU": 1.0, "GPU": 0.0}, [100.0]
    monkeypatch.setattr(ray_group, "place", lambda *a, **k: tried.append(1))  # no room
    monkeypatch.setattr(ray_group, "_free_now", lambda: dict(free))
    monkeypatch.setattr(ray_group, "_clock", lambda: now[0])  # not the process's clock
    spec = tiny_job(resources={"dp": 1, "max_dp": 2, "cpus_per_rank": 1})
    pool = ray_group.RayWorkerPool("job", spec, spec.model_dump_json(), "/ckpt")
    monkeypatch.setattr(pool, "available", lambda: 1)  # by the sum: half a CPU on two nodes
    group = types.SimpleNamespace(vacant=[], placements=[])
    for _ in range(5):  # five one-step chunks below max_dp
        pool.reserve(group, 1)
    assert len(tried) == 1
    free["CPU"] = 2.0  # a node joined
    pool.reserve(group, 1)
    pool.reserve(group, 1)
    assert len(tried) == 2
    now[0] += ray_group.RESERVE_RETRY_S  # and in any case, now and then
    pool.reserve(group, 1)
    assert len(tried) == 3
