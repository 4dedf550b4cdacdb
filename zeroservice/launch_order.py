"""Stages 0-2: the order in which units' reductions are launched, agreed by all ranks.

See [Note: reduction order] in reduce.py. Two proposals are made, each adopted only
when every rank made the same one: before the first reducing backward, the reverse of
the order in which the first forward used the units (backward finishes a unit when it
reaches the unit's first use); after it, the order in which that backward actually
finished them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from .flat import FlatUnit


class FirstUse:
    """Records, during the forwards it watches, the order in which units are first used
    (a module's own parameters count as used when its forward starts)."""

    def __init__(self, root: nn.Module, units: list[FlatUnit]):
        unit_of = {id(slot.param): unit.index for unit in units for slot in unit.slots}
        self.order: list[int] = []
        self._seen: set[int] = set()
        self._handles = []
        for module in root.modules():
            mine = [unit_of[id(p)] for p in module.parameters(recurse=False) if id(p) in unit_of]
            if mine:
                self._handles.append(module.register_forward_pre_hook(self._hook(mine)))

    def _hook(self, indices: list[int]):
        def pre_forward(module, args) -> None:
            for index in indices:
                if index not in self._seen:
                    self._seen.add(index)
                    self.order.append(index)

        return pre_forward

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def complete(order: list[int], every: list[int]) -> list[int]:
    """``order`` followed by the units it leaves out, in the order of ``every``."""
    seen = set(order)
    return order + [i for i in every if i not in seen]


def agreed(proposal: list[int], communicator: comm.Communicator, device) -> bool:
    """True on every rank when every rank proposed the same order: rank 0's proposal
    broadcast, then one all-reduce of "mine equals it" (tag "order")."""
    theirs = torch.tensor(proposal, dtype=torch.int64, device=device)
    communicator.broadcast(theirs, "order").wait()
    same = torch.tensor([int(theirs.tolist() == proposal)], device=device)
    communicator.all_reduce(same, "order", op=dist.ReduceOp.MIN).wait()
    return bool(same.item() == 1)
