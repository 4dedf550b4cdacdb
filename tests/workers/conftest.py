"""A private local Ray on loopback for the worker tests (see workers/cluster.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    """4 CPUs on 2 cores (fractional ranks share them) and 2 GPUs declared but absent."""
    import shutil
    import tempfile

    import ray

    from workers.cluster import start_local_ray

    workdir = tempfile.mkdtemp(prefix="zs-")  # Ray's socket paths must stay short
    start_local_ray(num_cpus=4, workdir=workdir, num_gpus=2)  # GPUs declared, absent
    yield ray
    ray.shutdown()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory):
    """A head (no CPUs) and two 2-CPU nodes, all processes of this machine on loopback."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    workdir = Path(tempfile.mkdtemp(prefix="zs-"))  # Ray's socket paths must stay short
    from workers.cluster import loopback_env

    os.environ.update(loopback_env(workdir / "home"))
    (workdir / "tmp" / "ray").mkdir(parents=True)
    os.environ["RAY_TMPDIR"] = str(workdir / "tmp")
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    ray_constants.ENABLE_RAY_CLUSTER = False
    node_args = {"node_ip_address": "127.0.0.1", "temp_dir": str(workdir / "tmp" / "ray")}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, **node_args},
    )
    nodes = [cluster.add_node(num_cpus=2, **node_args) for _ in range(2)]
    ray.init(address=cluster.address, namespace="zeroservice", log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster, nodes, node_args
    ray.shutdown()
    cluster.shutdown()
    shutil.rmtree(workdir, ignore_errors=True)
