"""Stage 3's debug check that every rank gathers the same unit at the same point.

[Note: rank-divergent control flow]
Stage 3 needs every rank to gather the same units in the same order: a rank that
skips a block issues the next block's all-gather while its peers issue this one's,
and when the two units have the same size the collective succeeds and hands each
rank a shard of the wrong unit, silently. With ``stage3_check_gathers`` every gather
is preceded by one all-reduce of (index, -index) under MAX, on a process group of its
own (so it never interleaves with the ring's point-to-point traffic on the engine's
group): the ranks agree exactly when the result is (index, -index) everywhere; if not,
each rank learns every rank's unit and raises the same error naming them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .flat import FlatUnit


class GatherCheck:
    """Consensus on the unit each gather fetches. See [Note: rank-divergent control flow]."""

    def __init__(self, group: dist.ProcessGroup | None, units: list[FlatUnit]):
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        ranks = ranks or list(range(dist.get_world_size()))
        self.group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        self.units = units
        self.checked = 0
        """Gathers confirmed so far."""

    def agree(self, index: int) -> None:
        """Return when every rank gathers unit ``index`` now; raise naming them otherwise."""
        probe = torch.tensor([index, -index], dtype=torch.int64)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=self.group)
        if probe.tolist() == [index, -index]:
            self.checked += 1
            return
        seen: list[int | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(seen, index, group=self.group)
        ranks = "; ".join(f"rank {r}: {self._describe(i)}" for r, i in enumerate(seen))
        raise RuntimeError(
            "stage 3: ranks gather different units (rank-divergent control flow) - "
            f"{ranks}. Every rank must run the same modules in the same order at stage 3 "
            "(use stage 0-2 for models whose ranks take different branches)"
        )

    def _describe(self, index: int | None) -> str:
        if index is None or not 0 <= index < len(self.units):
            return f"unit {index}"
        names = [s.names[0] for s in self.units[index].slots]
        shown = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
        return f"unit {index} [{shown}]"
