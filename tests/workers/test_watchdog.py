"""The watchdog's diagnosis names the right rank in each kind of hang."""

from __future__ import annotations

from workers.messages import RankProgress
from workers.watchdog import diagnose


def _p(step, n, last, phase="reducing, micro-batch 0"):
    return RankProgress(step=step, phase=phase, collectives=n, last_collective=last)


def test_frozen_rank_is_named_with_where_it_was_last_seen():
    seen = {0: _p(3, 40, "reduce_scatter/grads"), 1: _p(3, 39, "reduce_scatter/grads")}
    now = {0: _p(3, 41, "all_reduce/norm"), 1: None}
    stall = diagnose(now, seen, 30)
    assert stall.stalled == [1]
    assert "rank 1: no progress for 30 s, not responding" in stall.message
    assert (
        "rank 1: not responding; last seen in collective #39 reduce_scatter/grads" in stall.message
    )
    assert "rank 0: collective #41 all_reduce/norm at step 3" in stall.message


def test_rank_behind_the_others_is_named():
    now = {
        0: _p(5, 80, "all_gather/params"),
        1: _p(5, 79, "reduce_scatter/grads", "step"),
        2: _p(5, 80, "all_gather/params"),
    }
    stall = diagnose(now, now, 10)
    assert stall.stalled == [1]
    assert "behind the others" in stall.message


def test_diverged_rank_is_named():
    now = {r: _p(2, 17, "all_gather/params") for r in range(4)}
    now[2] = _p(2, 17, "reduce_scatter/grads")
    stall = diagnose(now, now, 10, describe=lambda r: f"rank {r} (node n{r})")
    assert stall.stalled == [2]
    assert "rank 2 (node n2): no progress for 10 s, in a different collective" in stall.message


def test_all_waiting_in_the_same_collective_names_everyone():
    now = {r: _p(2, 17, "all_reduce/mp") for r in range(2)}
    stall = diagnose(now, now, 10)
    assert stall.stalled == [0, 1]
    assert "all ranks wait in the same collective" in stall.message
