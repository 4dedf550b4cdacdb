"""The supervisor's bounded logs: absolute positions survive entries falling off."""

from __future__ import annotations

import pytest

from workers.ring import Ring


def test_a_ring_keeps_the_newest_and_reads_by_absolute_position():
    ring: Ring[int] = Ring(3)
    for i in range(5):
        ring.append(i * 10)
    assert len(ring) == 3 and ring.total == 5 and ring.first == 2
    assert ring.since(0) == [20, 30, 40]  # older ones are gone
    assert ring.since(3) == [30, 40]
    assert ring.since(5) == [] and ring.since(99) == []
    with pytest.raises(ValueError, match="capacity"):
        Ring(0)
