"""Run the API process: join Ray, open the store, serve (``python -m api.serve``).

Settings come from the environment (api/settings.py). At first start the admin token is
written to ``<data_dir>/admin-token`` (mode 600) and its path logged; the token is
never stored in the database in clear.
"""

from __future__ import annotations

import logging
import os
import sys

import uvicorn

from .backend import RayBackend
from .cluster_link import ClusterLink
from .main import create_app
from .service import Service
from .settings import TOKEN_FILE, Settings

log = logging.getLogger("zeroservice.api")


def connect_ray(settings: Settings) -> None:
    """Join the cluster. A cluster on this machine's loopback (the local stack) is
    joined with the same loopback settings and HOME it was started with (so Ray
    resolves no external address and finds the cluster's auth token)."""
    from workers.cluster import is_loopback_address, use_loopback

    if settings.ray_address is None:
        raise RuntimeError("ZEROSERVICE_RAY_ADDRESS is not set: which Ray cluster to join?")
    if is_loopback_address(settings.ray_address):
        use_loopback(settings.data_dir / "ray-home")
    import ray

    if ray.is_initialized():
        return
    ray.init(address=settings.ray_address, namespace="zeroservice", log_to_driver=False)


def restart() -> None:
    """Replace this process by a fresh API process (same pid and arguments): the way to
    join a Ray cluster whose head came back (see api/cluster_link.py). Requests in
    flight are dropped; the scheduler's lease lapses and is taken again."""
    log.warning("the Ray cluster is back: restarting the API to join it")
    logging.shutdown()
    os.execv(sys.executable, [sys.executable, "-m", "api.serve"])


def write_token(settings: Settings, token: str) -> str:
    path = settings.data_dir / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return str(path)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = Settings.from_env()
    # Ray would end this process a minute after losing its cluster; the link rejoins.
    os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", str(10**7))
    connect_ray(settings)
    service = Service(settings, RayBackend(ClusterLink(settings.ray_address, restart)))
    if service.bootstrap_token is not None:
        where = write_token(settings, service.bootstrap_token)
        log.info("admin token written to %s (shown nowhere else)", where)
    uvicorn.run(create_app(service), host=settings.host, port=settings.port, log_level="warning")


if __name__ == "__main__":
    main()
