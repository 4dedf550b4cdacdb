"""ZeRO++ communication: quantized weight gathers (qwZ), quantized gradient reduction
(qgZ) and the secondary partition within a node (hpZ).

[Note: ZeRO++ collectives]
* qwZ: a unit's all-gather sends each rank's shard as one quantized row (see [Note:
  block quantization] in quantize.py), its blocks within a parameter each ([Note:
  blocks within a parameter]; every rank knows where each rank's shard is cut, so the
  rows are sized by the largest); when the gather completes every row, this rank's own
  included, is dequantized into its chunk of the gather buffer, so every rank holds
  bitwise the same weights. Tag "params-int8".
* qgZ: a reduction of an (N, S) gradient buffer quantizes each row j (destined for
  rank j) and exchanges the rows in one all-to-all; the receiver dequantizes the N rows
  it got and sums them in fp32, in group-rank order, into its chunk. Tag "grads-int8"
  or "grads-int4". With a topology (``ranks_per_node`` = L, D nodes) it runs in two
  hops: within the node, local rank l receives the rows of ranks {m L + l}, sums the L
  senders' dequantized rows (local-rank order) per destination node m, and then, among
  the D ranks of local index l, sends the partial sum for node m (quantized again) to
  node m, which sums the D partials (node order). Only the second hop crosses nodes,
  carrying 1/L of the one-hop volume. The first hop is waited for when it is launched
  (the second needs its result). Tags "grads-intN-node" and "grads-intN-nodes". With
  one node (L = N_d) or one rank per node (L = 1) a hop would be among one rank: only
  the other runs, as the one-hop reduction, under its own tag.
* hpZ: when a unit's forward gather completes, each rank copies its slice l of L equal
  slices of the whole unit (the secondary shard); a backward gather of that unit then
  all-gathers the L secondary shards among the ranks of the node only (tag
  "params-node"). Secondary shards are dropped when backward ends and when a forward
  begins, and counted in the memory ledger (``secondary_params``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import comm
from .flat import FlatUnit
from .interrupt import Interrupt
from .quantize import (
    dequantize,
    dequantize_pieces_into,
    packed_bytes,
    pieces,
    pieces_bytes,
    quantize_into,
    quantize_pieces_into,
)


@dataclass
class Scratch:
    """Bytes of the quantized send and receive buffers alive now, and their peak."""

    current: int = 0
    peak: int = 0

    def take(self, numel: int, device: torch.device) -> torch.Tensor:
        self.current += numel
        self.peak = max(self.peak, self.current)
        return torch.empty(numel, dtype=torch.uint8, device=device)

    def give(self, *buffers: torch.Tensor) -> None:
        self.current -= sum(b.numel() for b in buffers)


def shard_cuts(unit: FlatUnit) -> list[list[int]]:
    """Per rank, the offsets inside its shard of ``unit`` where a parameter or the padding
    begins: where qwZ cuts the shard (see [Note: blocks within a parameter])."""
    size = unit.shard_numel
    starts = [slot.offset for slot in unit.slots] + [unit.numel]
    return [
        [o - r * size for o in starts if r * size < o < (r + 1) * size]
        for r in range(unit.shard_world)
    ]


def qwz_row_bytes(numel: int, cuts: Sequence[Sequence[int]], block: int) -> int:
    """Bytes of each rank's int8 row for shards of ``numel`` elements cut at ``cuts``
    (one list per rank): the largest rank's, so that the rows stack."""
    return max(pieces_bytes(pieces(numel, c), 8, block) for c in cuts)


def quantized_all_gather(
    communicator: comm.Communicator,
    shard: torch.Tensor,
    buffer: torch.Tensor,
    block: int,
    scratch: Scratch,
    cuts: Sequence[Sequence[int]] | None = None,
) -> comm.Pending:
    """qwZ: gather ``shard`` from every rank into ``buffer`` via int8 rows, each rank's
    shard cut at ``cuts[rank]`` (none: whole). See [Note: ZeRO++ collectives]."""
    n, numel = communicator.world, shard.numel()
    spans = [pieces(numel, cuts[i] if cuts is not None else []) for i in range(n)]
    row = max(pieces_bytes(s, 8, block) for s in spans)
    rows = scratch.take(n * row, shard.device).view(n, row)
    quantize_pieces_into(shard, spans[communicator.rank], 8, block, rows[communicator.rank])
    pending = communicator.all_gather(rows.view(-1), "params-int8")

    def unpack() -> None:
        chunks = buffer.view(n, -1)
        for i in range(n):
            dequantize_pieces_into(rows[i], spans[i], 8, block, chunks[i])
        scratch.give(rows)

    return pending.then(unpack)


def _exchange(
    communicator: comm.Communicator,
    rows: torch.Tensor,
    bits: int,
    block: int,
    tag: str,
    scratch: Scratch,
) -> tuple[comm.Pending, torch.Tensor, torch.Tensor]:
    """Quantize each row of ``rows`` (N, w) and all-to-all them; (pending, sent, received)."""
    n, width = rows.shape
    size = packed_bytes(width, bits, block)
    send = scratch.take(n * size, rows.device).view(n, size)
    recv = scratch.take(n * size, rows.device).view(n, size)
    for j in range(n):
        quantize_into(rows[j], bits, block, send[j])
    return communicator.all_to_all(send, recv, tag), send, recv


def _sum_rows(recv: torch.Tensor, width: int, bits: int, block: int) -> torch.Tensor:
    """fp32 sum of the dequantized rows, in row order."""
    total = dequantize(recv[0], width, bits, block).clone()
    for i in range(1, recv.shape[0]):
        total += dequantize(recv[i], width, bits, block)
    return total


def quantized_reduce_scatter(
    communicator: comm.Communicator,
    buffer: torch.Tensor,
    bits: int,
    block: int,
    scratch: Scratch,
    node: NodeGroups | None = None,
) -> comm.Pending:
    """qgZ: the sum over ranks of row ``rank`` of ``buffer`` (N, S) lands in this rank's
    chunk. One hop, or two with ``node``. See [Note: ZeRO++ collectives]."""
    n = communicator.world
    rows = buffer.view(n, -1)
    width = rows.shape[1]
    out = communicator.chunk(buffer)
    name = f"grads-int{bits}"
    if node is None:
        return _one_hop(communicator, rows, out, bits, block, name, scratch)
    if 1 in (node.local.world, node.cross.world):
        # One node, or one rank per node: the other hop is among one rank and would
        # quantize for nothing. The remaining hop is the one-hop reduction (its group's
        # ranks in data-parallel order), over the link it crosses.
        hop, tag = (node.local, "-node") if node.cross.world == 1 else (node.cross, "-nodes")
        return _one_hop(hop, rows, out, bits, block, name + tag, scratch)
    local, nodes = node.local.world, node.cross.world
    # Hop 1: local rank l gets, from every rank of its node, the rows for {m L + l}.
    by_local = rows.view(nodes, local, width).transpose(0, 1).reshape(local, nodes * width)
    pending, send, recv = _exchange(node.local, by_local, bits, block, name + "-node", scratch)
    pending.wait()
    partial = _sum_rows(recv, nodes * width, bits, block).view(nodes, width)
    scratch.give(send, recv)
    # Hop 2: among the ranks of local index l, node m gets the partial sum for its rank.
    pending, send, recv = _exchange(node.cross, partial, bits, block, name + "-nodes", scratch)

    def finish_nodes() -> None:
        out.copy_(_sum_rows(recv, width, bits, block))
        scratch.give(send, recv)

    return pending.then(finish_nodes)


def _one_hop(
    communicator: comm.Communicator,
    rows: torch.Tensor,
    out: torch.Tensor,
    bits: int,
    block: int,
    name: str,
    scratch: Scratch,
) -> comm.Pending:
    """Every rank's row ``rank`` summed into ``out`` in one all-to-all."""
    pending, send, recv = _exchange(communicator, rows, bits, block, name, scratch)

    def finish() -> None:
        out.copy_(_sum_rows(recv, rows.shape[1], bits, block))
        scratch.give(send, recv)

    return pending.then(finish)


@dataclass
class NodeGroups:
    """The communicators of a two-level topology: this rank's node (``local``) and the
    ranks of the same local index on every node (``cross``)."""

    local: comm.Communicator
    cross: comm.Communicator


def node_of(dp_rank: int, ranks_per_node: int | None) -> int:
    return 0 if ranks_per_node is None else dp_rank // ranks_per_node


def build_node_groups(
    group,
    ranks_per_node: int,
    ledger: comm.CommLedger,
    impl: str,
    interrupt: Interrupt | None = None,
    device_type: str = "cpu",
) -> NodeGroups:
    """Every rank of the default group must call this (``dist.new_group`` is collective).

    With ``impl="shm"`` the node groups keep the rings: only the engine's data-parallel
    group maps shared segments, so the ledger's ``comm_buffers`` holds all of them."""
    if impl == "shm":
        impl = "auto"
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    nodes = world // ranks_per_node

    def global_rank(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    local_group = cross_group = None
    for m in range(nodes):
        members = [global_rank(m * ranks_per_node + i) for i in range(ranks_per_node)]
        g = dist.new_group(members)
        if m == me // ranks_per_node:
            local_group = g
    for i in range(ranks_per_node):
        members = [global_rank(m * ranks_per_node + i) for m in range(nodes)]
        g = dist.new_group(members)
        if i == me % ranks_per_node:
            cross_group = g

    def communicator(g, members_nodes: list[int]) -> comm.Communicator:
        return comm.Communicator(
            g, ledger, impl, nodes=members_nodes, interrupt=interrupt, device_type=device_type
        )

    local = communicator(local_group, [0] * ranks_per_node)
    cross = communicator(cross_group, list(range(nodes)))
    return NodeGroups(local, cross)


@dataclass
class Secondary:
    """hpZ's secondary shards: per unit, this rank's 1/L slice of the whole unit."""

    node: NodeGroups
    shards: dict[int, torch.Tensor] = field(default_factory=dict)
    peak_bytes: int = 0

    def keep(self, index: int, whole: torch.Tensor) -> None:
        self.shards[index] = self.node.local.chunk(whole).clone()
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def gather(self, index: int, buffer: torch.Tensor) -> comm.Pending:
        self.node.local.chunk(buffer).copy_(self.shards[index])
        return self.node.local.all_gather(buffer, "params-node")

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.shards.values())

    def clear(self) -> None:
        self.shards.clear()
