"""``run_local``: rank 0 hosts the group's store, so it outlives every peer's use of it."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from zeroservice.launch import run_local


def _a_late_group_without_rank_0() -> float:
    if dist.get_rank() == 0:
        return 0.0  # done at once: the others still need the store it hosts
    time.sleep(1.0)
    group = dist.new_group([1, 2], use_local_synchronization=True)
    total = torch.ones(1)
    dist.all_reduce(total, group=group)
    return float(total.item())


def test_rank_0_leaves_only_after_the_others_are_done_with_its_store():
    assert run_local(_a_late_group_without_rank_0, 3) == [0.0, 2.0, 2.0]
