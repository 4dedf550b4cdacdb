"""Start or join Ray so that nothing leaves loopback on a single machine.

[Note: Ray on loopback]
Left to itself, Ray probes the cloud-metadata address at every start unless
``~/ray_bootstrap_config.yaml`` exists, posts a usage report, and binds the machine's
external address. ``loopback_env`` gives the settings that prevent all three (HOME
pointing at a directory holding an empty bootstrap config, usage stats off, the
report URL on loopback, Ray's node address 127.0.0.1) and gloo's interface; they are
set in this process before Ray starts, so every Ray process inherits them, and
every rank actor sets them again in its own process (``actor_env`` in rank_env.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


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


def use_loopback(home: str | Path) -> None:
    """Apply ``loopback_env`` to this process (before or after Ray was imported)."""
    os.environ.update(loopback_env(home))
    import ray._private.ray_constants as ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def is_loopback_address(address: str | None) -> bool:
    if not address:
        return False
    host = address.removeprefix("ray://").rsplit(":", 1)[0]
    return host in ("127.0.0.1", "localhost", "::1", "[::1]")


def use_own_token() -> None:
    """Token authentication with a fresh token for the Ray this process is about to start.

    Ray turns token authentication on for a new local instance and keeps the token it
    wrote under the first start's HOME cached in this process; a second instance (another
    HOME) would start a GCS that finds no token file and aborts. The token travels in the
    environment instead (readable only by this user), so Ray's own processes and every
    actor share it, and the cache is reloaded.
    """
    import secrets

    from ray._raylet import AuthenticationTokenLoader, Config

    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def start_local_ray(
    num_cpus: float, workdir: str | Path, num_gpus: int = 0, resources: dict | None = None
):
    """A private local Ray instance on loopback (tests, the demo, ``zeroservice up``)."""
    workdir = Path(workdir)
    # Read by Ray at import: if Ray was imported before the variables were set, they are
    # applied now (Ray's own processes, started below, read them from the environment).
    use_loopback(workdir / "home")
    import ray

    tmp = workdir / "ray"
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ["RAY_TMPDIR"] = str(tmp)
    use_own_token()
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


class SimulatedCluster:
    """Simulated nodes on this machine (``ray.cluster_utils.Cluster``), on loopback:
    a head without CPUs (supervisors run there) and nodes that a scenario removes and
    adds back; this process is connected to it. Its files live in ``workdir`` (short:
    Ray's socket paths must stay short), removed on exit. For the fault scenarios,
    their tests and the recovery benchmark."""

    def __init__(self, nodes: int, cpus_per_node: float):
        self.workdir = Path(tempfile.mkdtemp(prefix="zs-"))
        use_loopback(self.workdir / "home")
        temp = self.workdir / "tmp" / "ray"
        temp.mkdir(parents=True)
        os.environ["RAY_TMPDIR"] = str(temp.parent)
        import ray
        from ray.cluster_utils import Cluster

        self._node_args = {"node_ip_address": "127.0.0.1", "temp_dir": str(temp)}
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "include_dashboard": False, **self._node_args},
        )
        self.nodes = [self.add_node(cpus_per_node, wait=False) for _ in range(nodes)]
        ray.init(address=self.cluster.address, namespace="zeroservice", log_to_driver=False)
        self.cluster.wait_for_nodes()

    def add_node(self, num_cpus: float, wait: bool = True) -> Any:
        """A new node (``wait``: return once Ray has registered it)."""
        node = self.cluster.add_node(num_cpus=num_cpus, **self._node_args)
        if wait:
            self.cluster.wait_for_nodes()
        return node

    def remove_node(self, node: Any) -> None:
        self.cluster.remove_node(node)

    def __enter__(self) -> SimulatedCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
        shutil.rmtree(self.workdir, ignore_errors=True)
