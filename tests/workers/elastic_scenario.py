"""The elastic scenario, run in a process of its own (``python -m``) so that its
simulated cluster shares no Ray state with other tests: a head without CPUs and two
2-CPU nodes; a dp=2 job (one replica per node) loses a node, shrinks to dp 1, gets a
node back and grows to dp 2. Prints a JSON summary on its last line.

``python -m tests.workers.elastic_scenario live``: the job keeps host copies
(``engine.redundancy: host-copy``), so every resize is live (see [Note: live resize]);
before the node is removed, one rank's process is SIGKILLed on a node that stays, and
the job shrinks and grows back into the lost rank's own seat. ``... live shm``: the
same with ``engine.collectives: shm`` (the simulated nodes share this host's
``/dev/shm``), so the killed rank dies in the middle of shared-memory collectives.
``... live mp``: the job is model-parallel (mp 2, one replica of two ranks per node);
the killed rank's replica leaves whole and comes back whole."""

from __future__ import annotations

import json
import os
import signal
import sys


def main(live: bool, shm: bool = False, mp: bool = False) -> dict:
    from workers.cluster import SimulatedCluster

    with SimulatedCluster(nodes=2, cpus_per_node=2) as sim:
        import ray

        from tests.waiting import wait_for
        from tests.workers.jobs import tiny_job
        from workers.jobs import launch, stop

        engine = {"stage": 2, "bucket_elements": 4096}
        if live:
            engine["redundancy"] = "host-copy"
        if shm:
            engine["collectives"] = "shm"
        resources = {"dp": 2, "min_dp": 1, "max_dp": 2, "cpus_per_rank": 2}
        if mp:
            resources |= {"mp": 2, "cpus_per_rank": 1}
        spec = tiny_job(
            steps=100_000,  # runs until the shrink and the growth were seen, then cancelled
            resources=resources,
            checkpoint={"interval_steps": 10},
            engine=engine,
        )
        handle = launch("elastic", spec, sim.workdir / "ckpt")

        def status():
            return ray.get(handle.status.remote())

        def events():
            return ray.get(handle.events.remote())

        def explain():
            return (
                status(),
                [e for e in events() if e["kind"] != "checkpoint"][-8:],
                ray.available_resources(),
            )

        wait_for(lambda: status()["step"] >= 10, 180, "a checkpoint", explain)
        ranks = ray.get(handle.ranks.remote())
        nodes_before = len({r["node_id"] for r in ranks})

        def count(kind, reason):
            return sum(e["kind"] == kind and e["reason"] == reason for e in events())

        if live:  # a rank's process killed on a node that stays: shrink, then grow back
            os.kill(ranks[1 if mp else 0]["pid"], signal.SIGKILL)  # mp: rank 0's partner
            wait_for(lambda: count("resize", "grown") == 1, 180, "the grow-back", explain)
        shrinks = count("resize", "shrunk")
        sim.remove_node(sim.nodes[1])
        wait_for(lambda: count("resize", "shrunk") > shrinks, 180, "the shrink", explain)
        dp_after_shrink = status()["dp"]
        world_after_shrink = len(ray.get(handle.ranks.remote()))
        sim.add_node(num_cpus=2)
        grows = 1 if live else 0
        wait_for(lambda: count("resize", "grown") > grows, 240, "the growth", explain)
        grown_at = status()["step"]
        wait_for(
            lambda: (lambda st: st["dp"] == 2 and st["step"] > grown_at + 10)(status()),
            180,
            "training at dp 2 after the growth",
            explain,
        )
        summary = {
            "nodes_before": nodes_before,
            "dp_after_shrink": dp_after_shrink,
            "events": events(),
            "status": status(),
            "world_after_shrink": world_after_shrink,
            "ranks_after": ray.get(handle.ranks.remote()),
            "losses": sorted(int(s) for s in ray.get(handle.losses.remote())),
            "history": [p["step"] for p in ray.get(handle.history.remote())],
            "stopped": stop("elastic"),
        }
    return summary


if __name__ == "__main__":
    args = sys.argv[1:]
    print(json.dumps(main(live="live" in args, shm="shm" in args, mp="mp" in args)))
