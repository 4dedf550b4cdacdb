"""The elastic scenario, run in a process of its own (``python -m``) so that its
simulated cluster shares no Ray state with other tests: a head without CPUs and two
2-CPU nodes; a dp=2 job (one replica per node) loses a node, shrinks to dp 1, gets a
node back and grows to dp 2. Prints a JSON summary on its last line."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path


def main() -> dict:
    from workers.cluster import use_loopback

    workdir = Path(tempfile.mkdtemp(prefix="zs-"))  # Ray's socket paths must stay short
    use_loopback(workdir / "home")
    (workdir / "tmp" / "ray").mkdir(parents=True)
    os.environ["RAY_TMPDIR"] = str(workdir / "tmp")
    import ray
    from ray.cluster_utils import Cluster

    from tests.waiting import wait_for
    from tests.workers.jobs import tiny_job
    from workers.jobs import launch, stop

    node_args = {"node_ip_address": "127.0.0.1", "temp_dir": str(workdir / "tmp" / "ray")}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, **node_args},
    )
    nodes = [cluster.add_node(num_cpus=2, **node_args) for _ in range(2)]
    ray.init(address=cluster.address, namespace="zeroservice", log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        spec = tiny_job(
            steps=100_000,  # runs until the shrink and the growth were seen, then cancelled
            resources={"dp": 2, "min_dp": 1, "max_dp": 2, "cpus_per_rank": 2},
            checkpoint={"interval_steps": 10},
        )
        handle = launch("elastic", spec, workdir / "ckpt")

        def status():
            return ray.get(handle.status.remote())

        def events():
            return ray.get(handle.events.remote())

        def explain():
            return (status(), events()[-6:], ray.available_resources())

        wait_for(lambda: status()["step"] >= 10, 180, "a checkpoint", explain)
        ranks = ray.get(handle.ranks.remote())
        nodes_before = len({r["node_id"] for r in ranks})
        cluster.remove_node(nodes[1])
        wait_for(
            lambda: any(e["kind"] == "resize" and e["reason"] == "shrunk" for e in events()),
            180,
            "the shrink",
            explain,
        )
        dp_after_shrink = status()["dp"]
        cluster.add_node(num_cpus=2, **node_args)
        cluster.wait_for_nodes()
        wait_for(
            lambda: any(e["kind"] == "resize" and e["reason"] == "grown" for e in events()),
            240,
            "the growth",
            explain,
        )
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
            "losses": sorted(int(s) for s in ray.get(handle.losses.remote())),
            "stopped": stop("elastic"),
        }
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
    return summary


if __name__ == "__main__":
    print(json.dumps(main()))
