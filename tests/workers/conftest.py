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
