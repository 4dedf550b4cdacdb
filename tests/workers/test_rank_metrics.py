"""A rank's metrics endpoint: served, and closed without holding up a regroup."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import pytest

from workers.metrics import RankMetrics

LABELS = {"job_id": "j", "rank": "0", "dp_rank": "0", "mp_rank": "0", "node": "n"}


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        return r.read().decode()


def _closed(port: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            _scrape(port)
        except (urllib.error.URLError, ConnectionError, OSError):
            return True
        time.sleep(0.05)
    return False


def test_close_without_waiting_returns_while_the_server_stops():
    """A rank re-forming its group starts a new endpoint under its new identity and
    closes the old one; the server's loop notices a shutdown only at its next poll (up
    to 0.5 s), so ``close(wait=False)`` leaves that to a thread. Here the shutdown is
    held until released: the close must return meanwhile, and the endpoint stop once
    the shutdown goes on."""
    metrics = RankMetrics(LABELS)
    port = metrics.serve("127.0.0.1")
    metrics.update(step=7)
    assert 'zeroservice_step{dp_rank="0"' in _scrape(port)
    server = metrics._server
    release = threading.Event()
    shutdown = server.shutdown

    def held_shutdown() -> None:
        release.wait(30)
        shutdown()

    server.shutdown = held_shutdown
    metrics.close(wait=False)
    assert not release.is_set() and metrics._server is None
    assert "zeroservice_step" in _scrape(port)  # still serving: nobody waited
    release.set()
    assert _closed(port, within=10.0)
    metrics.close(wait=False)  # a second close is harmless


def test_close_waits_for_the_endpoint_to_stop():
    metrics = RankMetrics(LABELS)
    port = metrics.serve("127.0.0.1")
    assert "zeroservice_step" in _scrape(port)
    metrics.close()
    with pytest.raises(OSError):
        _scrape(port)
    metrics.close()
