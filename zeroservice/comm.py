"""Collectives that record what they move.

Each collective is a small free function that launches the op and returns a
:class:`Pending` handle; waiting on the handle closes its ledger entry. The ledger
keeps, per (op, tag), the calls, payload bytes (nccl-tests' "size": the full
tensor of an all-reduce, the full input of a reduce-scatter, the full output of an
all-gather), seconds from launch to completion, and the paper's volume (an
all-reduce moves 2x its payload per rank, a reduce-scatter or all-gather 1x).

[Note: bus bandwidth]
Algorithmic bandwidth is payload bytes / seconds. Bus bandwidth, as nccl-tests
defines it, rescales it to what each link carries in a ring so that numbers are
comparable across ops and world sizes: all-reduce x 2(n-1)/n, reduce-scatter and
all-gather x (n-1)/n.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_VOLUME_FACTOR = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1}
_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


@dataclass
class CollectiveStats:
    """Totals for one (op, tag) pair. See [Note: bus bandwidth]."""

    op: str
    tag: str
    world_size: int
    calls: int = 0
    payload_bytes: int = 0
    payload_elements: int = 0
    seconds: float = 0.0

    @property
    def volume_elements(self) -> int:
        """Elements this rank moved in the paper's accounting (all-reduce counts twice)."""
        return self.payload_elements * _VOLUME_FACTOR[self.op]

    @property
    def algbw_bytes_per_second(self) -> float:
        return self.payload_bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def busbw_bytes_per_second(self) -> float:
        return self.algbw_bytes_per_second * _BUS_FACTOR[self.op](self.world_size)

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "op": self.op,
            "tag": self.tag,
            "calls": self.calls,
            "payload_bytes": self.payload_bytes,
            "payload_elements": self.payload_elements,
            "volume_elements": self.volume_elements,
            "seconds": self.seconds,
            "algbw_bytes_per_second": self.algbw_bytes_per_second,
            "busbw_bytes_per_second": self.busbw_bytes_per_second,
        }


@dataclass
class CommLedger:
    """Per-rank record of every collective the engine issued."""

    entries: dict[tuple[str, str], CollectiveStats] = field(default_factory=dict)

    def record(self, op: str, tag: str, tensor: torch.Tensor, world: int, secs: float) -> None:
        key = (op, tag)
        stats = self.entries.get(key)
        if stats is None:
            stats = self.entries[key] = CollectiveStats(op, tag, world)
        stats.calls += 1
        stats.payload_elements += tensor.numel()
        stats.payload_bytes += tensor.numel() * tensor.element_size()
        stats.seconds += secs

    def volume_elements(self, tags: tuple[str, ...] = ("grads", "params")) -> int:
        return sum(s.volume_elements for s in self.entries.values() if s.tag in tags)

    def reset(self) -> None:
        self.entries.clear()

    def as_list(self) -> list[dict[str, float | int | str]]:
        return [s.as_dict() for s in self.entries.values()]


class Pending:
    """An in-flight collective; ``wait()`` blocks and closes its ledger entry."""

    __slots__ = ("_work", "_ledger", "_op", "_tag", "_payload", "_world", "_t0", "_done")

    def __init__(self, work, ledger, op, tag, payload, world):
        self._work, self._ledger, self._op, self._tag = work, ledger, op, tag
        self._payload, self._world = payload, world
        self._t0 = time.perf_counter()
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            self._work.wait()
        self._done = True
        secs = time.perf_counter() - self._t0
        self._ledger.record(self._op, self._tag, self._payload, self._world, secs)


def _world(group) -> int:
    return dist.get_world_size(group)


def all_reduce(tensor, ledger: CommLedger, tag: str, group=None, op=dist.ReduceOp.SUM) -> Pending:
    """Sum (or ``op``) ``tensor`` in place across ``group``."""
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return Pending(work, ledger, "all_reduce", tag, tensor, _world(group))


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, ledger: CommLedger, tag: str, group=None
) -> Pending:
    """Sum ``input`` (world x len(output) elements) across ranks; rank r keeps chunk r."""
    work = dist.reduce_scatter_single(output, input, group=group, async_op=True)
    return Pending(work, ledger, "reduce_scatter", tag, input, _world(group))


def all_gather(
    output: torch.Tensor, input: torch.Tensor, ledger: CommLedger, tag: str, group=None
) -> Pending:
    """Concatenate every rank's ``input`` into ``output``; ``input`` may alias its slot."""
    work = dist.all_gather_single(output, input, group=group, async_op=True)
    return Pending(work, ledger, "all_gather", tag, output, _world(group))


def broadcast(tensor, ledger: CommLedger, tag: str, group=None, src_group_rank: int = 0):
    """Copy ``tensor`` from the group's rank ``src_group_rank`` to every rank, in place."""
    src = src_group_rank if group is None else dist.get_global_rank(group, src_group_rank)
    work = dist.broadcast(tensor, src=src, group=group, async_op=True)
    return Pending(work, ledger, "broadcast", tag, tensor, _world(group))


def wait_all(pending: list[Pending]) -> None:
    for p in pending:
        p.wait()
    pending.clear()
