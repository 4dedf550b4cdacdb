"""The link to the Ray cluster: unreachable -> Unavailable at once; reachable again ->
rejoined (once)."""

from __future__ import annotations

import socket

import pytest

from api.cluster_link import ClusterLink, endpoint
from api.errors import Unavailable


def test_addresses_name_the_endpoint_to_probe():
    assert endpoint("127.0.0.1:6379") == ("127.0.0.1", 6379)
    assert endpoint("ray://ray-head:10001") == ("ray-head", 10001)
    assert endpoint("auto") is None and endpoint(None) is None


def test_an_unreachable_cluster_is_unavailable_and_rejoined_when_back():
    joins: list[int] = []
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    link = ClusterLink(f"127.0.0.1:{port}", lambda: joins.append(1))
    with pytest.raises(Unavailable, match="the Ray cluster unavailable"):
        link.ensure()  # bound, not listening: nothing answers
    assert link.lost and joins == []
    server.listen()
    link.ensure()
    link.ensure()
    assert joins == [1] and not link.lost
    server.close()
