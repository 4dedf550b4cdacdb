"""The control plane's link to the Ray cluster, which may go away (its head restarts)
and come back.

Before each use the cluster's address is probed (a TCP connect, 1 s at most): while
nothing answers, callers get ``Unavailable`` (503 with Retry-After) at once instead of
hanging on a Ray call; once it answers again, ``rejoin`` is called. A Ray driver
cannot leave a cluster whose head went away (``ray.shutdown`` ends the process when
its raylet is gone), so the API's ``rejoin`` replaces the process by a fresh one
(api/serve.py). The API process runs with a long
``RAY_gcs_rpc_server_reconnect_timeout_s`` so that Ray does not end it meanwhile.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

from .errors import Unavailable

PROBE_TIMEOUT_S = 1.0


def endpoint(address: str | None) -> tuple[str, int] | None:
    """Host and port to probe for ``host:port`` or ``ray://host:port``; None for "auto"."""
    if not address or ":" not in address.removeprefix("ray://"):
        return None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    return (host, int(port)) if port.isdigit() else None


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


class ClusterLink:
    def __init__(self, address: str | None, rejoin: Callable[[], None]):
        self.endpoint, self.rejoin = endpoint(address), rejoin
        self.lost = False
        self._rejoining = threading.Lock()

    def ensure(self) -> None:
        """Return when the cluster answers and this process is joined to it."""
        if self.endpoint is not None and not _answers(*self.endpoint):
            self.lost = True
            raise Unavailable("the Ray cluster")
        if self.lost:
            self._rejoin()

    def _rejoin(self) -> None:
        if not self._rejoining.acquire(blocking=False):
            raise Unavailable("the Ray cluster")  # another caller is rejoining it
        try:
            self.rejoin()
            self.lost = False
        except Exception as exc:
            raise Unavailable("the Ray cluster", exc) from None
        finally:
            self._rejoining.release()
