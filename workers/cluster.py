"""Start or join Ray so that nothing leaves loopback on a single machine.

[Note: Ray on loopback]
Left to itself, Ray probes the cloud-metadata address at every start unless
``~/ray_bootstrap_config.yaml`` exists, posts a usage report, and binds the machine's
external address. ``loopback_env`` gives the settings that prevent all three (HOME
pointing at a directory holding an empty bootstrap config, usage stats off, the
report URL on loopback, Ray's node address 127.0.0.1) and gloo's interface; they are
set in this process before Ray starts, so every Ray process inherits them, and are
passed to every actor through the runtime environment.
"""

from __future__ import annotations

import os
from pathlib import Path


def loopback_env(home: str | Path) -> dict[str, str]:
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    (home / "ray_bootstrap_config.yaml").write_text("{}\n")
    return {
        "HOME": str(home),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:9/",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    }


def actor_env() -> dict[str, str]:
    """Variables every rank actor gets (from this process's environment)."""
    keys = (
        "GLOO_SOCKET_IFNAME",
        "NCCL_SOCKET_IFNAME",
        "MALLOC_MMAP_THRESHOLD_",
        "ZEROSERVICE_PEAK_TFLOPS",
        "RAY_USAGE_STATS_ENABLED",
    )
    return {k: os.environ[k] for k in keys if k in os.environ}


def start_local_ray(
    num_cpus: float, workdir: str | Path, num_gpus: int = 0, resources: dict | None = None
):
    """A private local Ray instance on loopback (tests, the demo, ``zeroservice up``)."""
    workdir = Path(workdir)
    os.environ.update(loopback_env(workdir / "home"))
    import ray
    from ray._private import ray_constants

    # Read by Ray at import: if Ray was imported before the variable was set, apply it
    # now (Ray's own processes, started below, read it from the environment).
    ray_constants.ENABLE_RAY_CLUSTER = False
    tmp = workdir / "ray"
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ["RAY_TMPDIR"] = str(tmp)
    return ray.init(
        address="local",
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        resources=resources,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=str(tmp),
        namespace="zeroservice",
        log_to_driver=False,
    )
