"""Collectives that record what they move.

Each collective launches asynchronously and returns a :class:`Pending` handle;
waiting on the handle closes its ledger entry. The ledger
keeps, per (op, tag), the calls, payload bytes (nccl-tests' "size": the full
tensor of an all-reduce, the full input of a reduce-scatter, the full output of an
all-gather), seconds (the op's own run time for rings; for native ops, from launch, or from the
previous native op's completion if later, to completion, so it may include time
overlapped with compute but never counts an interval twice), and the paper's volume (an
all-reduce moves 2x its payload per rank, a reduce-scatter or all-gather 1x).

[Note: bus bandwidth]
Algorithmic bandwidth is payload bytes / seconds. Bus bandwidth, as nccl-tests
defines it, rescales it to what each link carries in a ring so that numbers are
comparable across ops and world sizes: all-reduce x 2(n-1)/n, reduce-scatter and
all-gather x (n-1)/n.

[Note: bytes by link]
With ``ranks_per_node`` known, each entry also splits what this rank *received* by the
link it came over. A rank is on node ``dp_rank // ranks_per_node`` (without a topology,
every rank is on one node). The count is logical, per peer, whatever route the
implementation takes: in an all-gather, a reduce-scatter or an all-to-all over a group
of n ranks with a payload of S bytes, this rank receives S/n bytes from each of the
other n - 1 ranks (its own chunk never moves; S/n rounded down, exact for the engine's
padded buffers); an all-reduce counts twice that (its reduce-scatter and its
all-gather); a broadcast or a receive counts the whole payload from its source, a send
nothing. Bytes from a rank on the same node are
``intra_node_bytes``, from a rank on another node ``cross_node_bytes``. So at 2 nodes
x 2 ranks an all-gather over all four receives S/4 within the node and S/2 across;
over the two ranks of one node, S/2 within and nothing across. With many nodes the
cross-node share of a collective over all ranks tends to its whole payload, the
accounting of the ZeRO++ paper.

[Note: a group of one]
On a group of one rank every collective the engine issues leaves its tensors as they
are: a sum over one rank is the tensor, a reduce-scatter's or an all-gather's one chunk
is the whole buffer, a broadcast's source is this rank. So nothing is issued there
(``impl="local"`` in the ledger, with no bytes over any link). A job of one rank, or one
shrunk to one by a lost peer, would otherwise pay the backend's per-call cost for every
unit and bucket: on an H100, stage 3 of a 1.3 B GPT at N_d = 1 made 1,046 such calls a
step, and its step waited on the host while the GPU did stage 0's work
(docs/benchmarks.md). An all-to-all copies its one row.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .config import check_collectives
from .interrupt import Interrupt
from .ring import RingComm
from .shm import SharedMemoryComm

_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""The flat-tensor collectives; torch before 2.13 names them ``reduce_scatter_tensor``
and ``all_gather_into_tensor`` (the GPU images that ship an older torch)."""

SMALL_ELEMENTS = 2**14
"""With ``collectives="shm"``, an all-reduce of fewer elements stays on the backend:
two barriers would cost more than the bytes."""

_VOLUME_FACTOR = {
    "all_reduce": 2,
    "reduce_scatter": 1,
    "all_gather": 1,
    "broadcast": 1,
    "send": 1,
    "recv": 1,
    "all_to_all": 1,
}
_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
    "all_to_all": lambda n: (n - 1) / n,
}


def bus_factor(op: str, world: int) -> float:
    """Bus bandwidth / algorithmic bandwidth for ``op`` over ``world`` ranks."""
    return _BUS_FACTOR[op](world)


@dataclass
class CollectiveStats:
    """Totals for one (op, tag) pair. See [Note: bus bandwidth]."""

    op: str
    tag: str
    world_size: int
    impl: str
    """How it ran: "native" (the backend's own op), "ring" (point-to-point ring),
    "shm" (through shared memory) or "local" (a group of one: nothing issued)."""
    calls: int = 0
    payload_bytes: int = 0
    payload_elements: int = 0
    seconds: float = 0.0
    intra_node_bytes: int = 0
    """Bytes received from ranks on this rank's node. See [Note: bytes by link]."""
    cross_node_bytes: int = 0
    """Bytes received from ranks on other nodes."""

    @property
    def volume_elements(self) -> int:
        """Elements this rank moved in the paper's accounting (all-reduce counts twice)."""
        return self.payload_elements * _VOLUME_FACTOR[self.op]

    @property
    def algbw_bytes_per_second(self) -> float:
        return self.payload_bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def busbw_bytes_per_second(self) -> float:
        return self.algbw_bytes_per_second * bus_factor(self.op, self.world_size)

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "op": self.op,
            "tag": self.tag,
            "impl": self.impl,
            "calls": self.calls,
            "payload_bytes": self.payload_bytes,
            "payload_elements": self.payload_elements,
            "volume_elements": self.volume_elements,
            "seconds": self.seconds,
            "intra_node_bytes": self.intra_node_bytes,
            "cross_node_bytes": self.cross_node_bytes,
            "algbw_bytes_per_second": self.algbw_bytes_per_second,
            "busbw_bytes_per_second": self.busbw_bytes_per_second,
        }


@dataclass
class CommLedger:
    """Per-rank record of every collective the engine issued."""

    entries: dict[tuple[str, str], CollectiveStats] = field(default_factory=dict)
    native_busy_until: float = 0.0
    """When the last native op was seen to finish (see ``Pending.wait``)."""
    launched: int = 0
    """Collectives launched so far (a hang watchdog compares it across ranks)."""
    last_launched: str = ""
    """``op/tag`` of the last collective launched."""

    def record(
        self,
        op: str,
        tag: str,
        tensor: torch.Tensor,
        world: int,
        secs: float,
        impl: str,
        links: tuple[int, int] = (0, 0),
    ) -> None:
        key = (op, tag)
        stats = self.entries.get(key)
        if stats is None:
            stats = self.entries[key] = CollectiveStats(op, tag, world, impl)
        stats.calls += 1
        stats.payload_elements += tensor.numel()
        stats.payload_bytes += tensor.numel() * tensor.element_size()
        stats.seconds += secs
        stats.intra_node_bytes += links[0]
        stats.cross_node_bytes += links[1]

    def volume_elements(self, tags: tuple[str, ...] = ("grads", "params")) -> int:
        return sum(s.volume_elements for s in self.entries.values() if s.tag in tags)

    def link_bytes(self, tags: tuple[str, ...] | None = None) -> tuple[int, int]:
        """(intra-node, cross-node) bytes received, over ``tags`` (None: all)."""
        chosen = [s for s in self.entries.values() if tags is None or s.tag in tags]
        return sum(s.intra_node_bytes for s in chosen), sum(s.cross_node_bytes for s in chosen)

    def reset(self) -> None:
        self.entries.clear()

    def as_list(self) -> list[dict[str, float | int | str]]:
        return [s.as_dict() for s in self.entries.values()]


class Pending:
    """An in-flight collective; ``wait()`` blocks and closes its ledger entry."""

    __slots__ = (
        "_wait",
        "_ledger",
        "_key",
        "_payload",
        "_world",
        "_impl",
        "_t0",
        "_done",
        "_links",
        "_after",
    )

    def __init__(self, wait, ledger, op, tag, payload, world, impl, links=(0, 0)):
        self._wait, self._ledger, self._key = wait, ledger, (op, tag)
        self._payload, self._world, self._impl = payload, world, impl
        self._links = links
        self._after: list[Callable[[], None]] = []
        self._t0 = time.perf_counter()
        self._done = False

    def then(self, after: Callable[[], None]) -> Pending:
        """Run ``after`` once the collective has completed (inside ``wait``)."""
        self._after.append(after)
        return self

    def wait(self) -> None:
        if self._done:
            return
        measured = self._wait()  # a ring job returns its seconds; a native Work returns True
        self._done = True
        now = time.perf_counter()
        if isinstance(measured, float):
            secs = measured
        else:
            # A backend runs its ops in order: this one started no earlier than the
            # previous one finished, so overlapping waits are not counted twice.
            secs = now - max(self._t0, self._ledger.native_busy_until)
            self._ledger.native_busy_until = now
        op, tag = self._key
        self._ledger.record(op, tag, self._payload, self._world, secs, self._impl, self._links)
        for after in self._after:
            after()
        self._after.clear()


_SAME_ALONE = (
    dist.ReduceOp.SUM,
    dist.ReduceOp.AVG,
    dist.ReduceOp.MAX,
    dist.ReduceOp.MIN,
    dist.ReduceOp.PRODUCT,
)
"""The reductions whose result over one rank is its tensor (a pre-multiplied sum is not)."""


def _complete() -> float:
    """The wait of an op that was complete when issued: it took no time on any link."""
    return 0.0


def wait_all(pending: list[Pending]) -> None:
    for p in pending:
        p.wait()
    pending.clear()


class Communicator:
    """The engine's collectives over one group, each recorded in the ledger.

    Reduce-scatter and all-gather work in place on a buffer of N equal chunks (see
    [Note: rings on gloo] in ring.py): natively where the backend is fast (NCCL),
    as point-to-point rings on gloo, whose own versions are 2-4x slower; with
    ``impl="shm"``, through shared memory (all-reduce too), for a group on one host
    (see shm.py). The ledger names the implementation of each entry. ``ring_chunk``
    caps the ring's receive scratch (see RingComm) and sizes the shared segments.
    ``device_type``: where the tensors live; GPU tensors on gloo take its native ops.
    With ``interrupt`` (engines pass theirs) every wait on gloo can be given up from
    another thread (see [Note: interrupting a collective] in
    interrupt.py); without, native ops are waited for on the caller's thread, which
    costs no waiter thread (a model-parallel group outside an engine).
    """

    def __init__(
        self,
        group,
        ledger: CommLedger,
        impl: str = "auto",
        ring_chunk: int | None = None,
        nodes: Sequence[int] | None = None,
        interrupt: Interrupt | None = None,
        device_type: str = "cpu",
    ):
        self.group, self.ledger = group, ledger
        self.interrupt = interrupt
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = str(dist.get_backend(group))
        check_collectives(impl, self.backend, device_type)
        # gloo's point-to-point sends read host memory: GPU tensors take its native ops,
        # which stage them through the host.
        self.device_type = device_type
        on_host = device_type == "cpu"
        use_ring = impl == "ring" or (impl == "auto" and self.backend == "gloo" and on_host)
        self.ring = RingComm(group, ring_chunk) if use_ring and self.world > 1 else None
        self.shm = SharedMemoryComm(group, ring_chunk) if impl == "shm" and self.world > 1 else None
        self.nodes = list(nodes) if nodes is not None else [0] * self.world
        """The node of each group rank. See [Note: bytes by link]."""
        assert len(self.nodes) == self.world
        here = self.nodes[self.rank]
        self._peers_here = sum(1 for r, n in enumerate(self.nodes) if r != self.rank and n == here)
        """Other ranks on this rank's node; the other world - 1 - this are on others."""

    def _links(self, op: str, payload: torch.Tensor, peer: int | None) -> tuple[int, int]:
        """(intra, cross) bytes this rank receives. See [Note: bytes by link]."""
        size = payload.numel() * payload.element_size()
        here = self.nodes[self.rank]
        if op == "send":
            return 0, 0
        if peer is not None:  # broadcast, recv: the whole payload from one rank
            if peer == self.rank:
                return 0, 0
            return (size, 0) if self.nodes[peer] == here else (0, size)
        share = size // self.world * (2 if op == "all_reduce" else 1)
        same = self._peers_here
        return share * same, share * (self.world - 1 - same)

    def _native(self, work) -> Callable[[], Any]:
        """How to wait for a native op: on gloo, where another thread can give it up."""
        interrupt = self.interrupt
        if interrupt is None or self.backend != "gloo":
            return work.wait
        return lambda: interrupt.run(work.wait)

    def _job(self, future: Future[float]) -> Callable[[], float]:
        interrupt = self.interrupt
        return future.result if interrupt is None else lambda: interrupt.result(future)

    def _local(self, op: str, tag: str, payload: torch.Tensor) -> Pending | None:
        """A group of one: the op's handle, already complete (None: a real group).
        See [Note: a group of one]."""
        if self.world != 1:
            return None
        return self._pending(_complete, op, tag, payload, "local")

    def _pending(self, wait, op, tag, payload, impl="native", peer=None) -> Pending:
        self.ledger.launched += 1
        self.ledger.last_launched = f"{op}/{tag}"
        links = self._links(op, payload, peer)
        return Pending(wait, self.ledger, op, tag, payload, self.world, impl, links)

    def all_reduce(self, tensor: torch.Tensor, tag: str, op=dist.ReduceOp.SUM) -> Pending:
        """Sum (or ``op``) ``tensor`` in place across the group."""
        if op in _SAME_ALONE and (local := self._local("all_reduce", tag, tensor)) is not None:
            return local
        if (
            self.shm is not None
            and op == dist.ReduceOp.SUM
            and tensor.numel() >= SMALL_ELEMENTS
            and tensor.is_contiguous()
            and tensor.device.type == "cpu"
        ):
            future = self.shm.all_reduce(tensor)
            return self._pending(self._job(future), "all_reduce", tag, tensor, "shm")
        work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        return self._pending(self._native(work), "all_reduce", tag, tensor)

    def broadcast(self, tensor: torch.Tensor, tag: str, src_group_rank: int = 0) -> Pending:
        """Copy ``tensor`` from the group's rank ``src_group_rank`` to every rank."""
        if (local := self._local("broadcast", tag, tensor)) is not None:
            return local
        g = self.group
        src = src_group_rank if g is None else dist.get_global_rank(g, src_group_rank)
        work = dist.broadcast(tensor, src=src, group=g, async_op=True)
        return self._pending(self._native(work), "broadcast", tag, tensor, peer=src_group_rank)

    def send(self, tensor: torch.Tensor, dst_group_rank: int, tag: str) -> Pending:
        """Point-to-point: ``tensor`` to the group's rank ``dst_group_rank``."""
        g = self.group
        dst = dst_group_rank if g is None else dist.get_global_rank(g, dst_group_rank)
        work = dist.isend(tensor, dst, group=g)
        assert work is not None  # None only for ranks outside the group
        return self._pending(self._native(work), "send", tag, tensor)

    def recv(self, tensor: torch.Tensor, src_group_rank: int, tag: str) -> Pending:
        """Point-to-point: fill ``tensor`` from the group's rank ``src_group_rank``."""
        g = self.group
        src = src_group_rank if g is None else dist.get_global_rank(g, src_group_rank)
        work = dist.irecv(tensor, src, group=g)
        assert work is not None  # None only for ranks outside the group
        return self._pending(self._native(work), "recv", tag, tensor, peer=src_group_rank)

    def chunk(self, buffer: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a buffer of N equal chunks."""
        return buffer.view(self.world, -1)[self.rank]

    def reduce_scatter(self, buffer: torch.Tensor, tag: str) -> Pending:
        """Sum ``buffer`` across ranks into this rank's chunk (other chunks: scratch)."""
        if (local := self._local("reduce_scatter", tag, buffer)) is not None:
            return local
        if self.shm is not None:
            future = self.shm.reduce_scatter(buffer)
            return self._pending(self._job(future), "reduce_scatter", tag, buffer, "shm")
        if self.ring is not None:
            future = self.ring.reduce_scatter(buffer)
            return self._pending(self._job(future), "reduce_scatter", tag, buffer, "ring")
        out = self.chunk(buffer)
        if self.backend == "nccl":  # NCCL reduces in place when out is chunk `rank`.
            work = _reduce_scatter_single(out, buffer, group=self.group, async_op=True)
            return self._pending(self._native(work), "reduce_scatter", tag, buffer)
        tmp = torch.empty_like(out)
        work = _reduce_scatter_single(tmp, buffer, group=self.group, async_op=True)

        done = self._native(work)

        def wait() -> None:
            done()
            out.copy_(tmp)

        return self._pending(wait, "reduce_scatter", tag, buffer)

    def all_gather(self, buffer: torch.Tensor, tag: str) -> Pending:
        """Fill every chunk of ``buffer`` from its owner; this rank's chunk is the input."""
        if (local := self._local("all_gather", tag, buffer)) is not None:
            return local
        if self.shm is not None:
            future = self.shm.all_gather(buffer)
            return self._pending(self._job(future), "all_gather", tag, buffer, "shm")
        if self.ring is not None:
            future = self.ring.all_gather(buffer)
            return self._pending(self._job(future), "all_gather", tag, buffer, "ring")
        work = _all_gather_single(buffer, self.chunk(buffer), group=self.group, async_op=True)
        return self._pending(self._native(work), "all_gather", tag, buffer)

    def all_to_all(self, send: torch.Tensor, recv: torch.Tensor, tag: str) -> Pending:
        """Row j of ``send`` (N equal rows) goes to group rank j; row i of ``recv`` comes
        from group rank i. The ledger counts ``send``'s bytes as the payload."""
        if (local := self._local("all_to_all", tag, send)) is not None:
            recv.copy_(send)
            return local
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        return self._pending(self._native(work), "all_to_all", tag, send)

    def buffer_bytes(self) -> int:
        """The ring's receive scratch (while held: see ``release_scratch``), or the shared
        segments this rank maps."""
        if self.shm is not None:
            return self.shm.scratch_bytes
        return self.ring.scratch_bytes if self.ring is not None else 0

    def release_scratch(self) -> None:
        """After a backward's reductions: the ring's receive scratch goes until the next
        reduce-scatter allocates it. See [Note: rings on gloo] in ring.py."""
        if self.ring is not None:
            self.ring.release()

    def close(self) -> None:
        """Stop the ring's and the waiter's threads; after an interrupt, without
        waiting for a transfer that may never end."""
        fired = self.interrupt is not None and self.interrupt.fired
        if self.ring is not None:
            self.ring.shutdown(wait=not fired)
        if self.shm is not None:
            self.shm.close(wait=not fired)
        if self.interrupt is not None:
            self.interrupt.close()
