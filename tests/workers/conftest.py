"""A private local Ray on loopback for the worker tests (see workers/cluster.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    """4 CPUs on 2 cores: fractional ranks share them (as MACHINE_NOTES measured)."""
    import ray

    from workers.cluster import start_local_ray

    start_local_ray(num_cpus=4, workdir=tmp_path_factory.mktemp("ray"))
    yield ray
    ray.shutdown()
