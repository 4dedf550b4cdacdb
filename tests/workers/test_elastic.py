"""Elastic capacity with simulated nodes (ray.cluster_utils.Cluster): removing a node
shrinks the job, adding one grows it back to max_dp."""

from __future__ import annotations

import time

import pytest

from tests.workers.jobs import tiny_job

pytestmark = pytest.mark.slow


def _wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_node_removed_shrinks_and_node_added_grows_back(local_cluster, tmp_path):
    import ray

    from workers.jobs import launch, stop

    cluster, nodes, node_args = local_cluster
    spec = tiny_job(
        steps=100_000,  # runs until the test has seen it shrink and grow, then cancelled
        resources={"dp": 2, "min_dp": 1, "max_dp": 2, "cpus_per_rank": 2},
        checkpoint={"interval_steps": 10},
    )
    handle = launch("elastic", spec, tmp_path / "ckpt")

    def events():
        return ray.get(handle.events.remote())

    _wait_for(lambda: ray.get(handle.status.remote())["step"] >= 10, 180, "a checkpoint")
    # One replica per node (each bundle takes a whole node's 2 CPUs).
    ranks = ray.get(handle.ranks.remote())
    assert len({r["node_id"] for r in ranks}) == 2
    cluster.remove_node(nodes[1])
    _wait_for(
        lambda: any(e["kind"] == "resize" and e["reason"] == "shrunk" for e in events()),
        180,
        "the shrink",
    )
    assert ray.get(handle.status.remote())["dp"] == 1
    cluster.add_node(num_cpus=2, **node_args)
    _wait_for(
        lambda: any(e["kind"] == "resize" and e["reason"] == "grown" for e in events()),
        240,
        "the growth",
    )
    # Growing restarts from the checkpoint just written, at dp 2; let it train a chunk.
    grown_at = ray.get(handle.status.remote())["step"]
    _wait_for(
        lambda: (lambda st: st["dp"] == 2 and st["step"] > grown_at + 10)(
            ray.get(handle.status.remote())
        ),
        180,
        "training at dp 2 after the growth",
    )
    log = events()
    lost = [e for e in log if e["kind"] == "restart"]
    assert [e["reason"] for e in lost] == ["worker_lost"]
    grown = [e for e in log if e["kind"] == "resize" and e["reason"] == "grown"][0]
    assert grown["dp"] == 2 and grown["dp_from"] == 1
    assert any(e["reason"] == "capacity_returned" for e in log)
    assert ray.get(handle.status.remote())["restarts"] == 1
    losses = ray.get(handle.losses.remote())
    assert sorted(losses) == list(range(1, max(losses) + 1))  # no step missing
    assert stop("elastic") == "cancelled"
