"""Ranks arranged as data parallel × model parallel, and their process groups.

[Note: topology]
The world is ``dp × mp`` ranks. The ``mp`` ranks of one model-parallel group are
adjacent (global ranks ``d·mp … d·mp + mp − 1``), so a launcher that fills nodes
in rank order puts each MP group on one node, where its per-layer all-reduces run
over the fastest links. Rank ``r`` has ``dp_rank = r // mp`` and ``mp_rank = r % mp``.
ZeRO-DP partitions over the DP group (the ranks that hold the same model slice);
tensor-parallel layers communicate over the MP group.

``torch.distributed.new_group`` is collective over the whole world: every rank
creates every group, in the same order, and keeps its own two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


class TopologyError(ValueError):
    """The requested degrees do not fit the world."""


def check_degrees(world: int, mp: int, dp: int | None = None) -> int:
    """The DP degree for ``world`` ranks with ``mp``-way model parallelism (errors name both)."""
    if not isinstance(mp, int) or mp < 1:
        raise TopologyError(f"mp: {mp!r} must be an integer >= 1")
    if world % mp:
        raise TopologyError(
            f"mp: model-parallel degree {mp} does not divide the world size {world}"
        )
    if dp is not None and dp * mp != world:
        raise TopologyError(f"dp × mp = {dp} × {mp} = {dp * mp} is not the world size {world}")
    return world // mp


@dataclass
class Topology:
    """This rank's place in the grid and the groups it belongs to. See [Note: topology]."""

    world: int
    dp: int
    mp: int
    rank: int
    dp_group: dist.ProcessGroup | None
    """Ranks holding the same model slice (None: the whole world, when mp = 1)."""
    mp_group: dist.ProcessGroup | None
    """Ranks sharing one model replica's layers (None when mp = 1)."""

    @property
    def dp_rank(self) -> int:
        return self.rank // self.mp

    @property
    def mp_rank(self) -> int:
        return self.rank % self.mp

    def dp_ranks(self) -> list[int]:
        return [d * self.mp + self.mp_rank for d in range(self.dp)]

    def mp_ranks(self) -> list[int]:
        return [self.dp_rank * self.mp + m for m in range(self.mp)]


def build_topology(mp: int = 1, dp: int | None = None) -> Topology:
    """Create the DP and MP groups of the initialised world (collective on every rank)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("build_topology: torch.distributed is not initialised")
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = check_degrees(world, mp, dp)
    if mp == 1:
        return Topology(world, dp, 1, rank, None, None)
    dp_group = mp_group = None
    for m in range(mp):
        group = dist.new_group([d * mp + m for d in range(dp)])
        if rank % mp == m:
            dp_group = group
    for d in range(dp):
        group = dist.new_group([d * mp + m for m in range(mp)])
        if rank // mp == d:
            mp_group = group
    return Topology(world, dp, mp, rank, dp_group, mp_group)
