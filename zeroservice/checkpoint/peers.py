"""Restore from peers' host memory instead of a checkpoint file.

[Note: restore from peers]
A host copy (``PeerSnapshot``) holds, per old rank, exactly what that rank would write
to a checkpoint (save.snapshot_items), packed into one host buffer, with the manifest
header and the rank's random generators. After a failure the survivors (and any
newcomers) form a new group and build a new engine; ``restore_from_peers`` then runs
over the new group:

1. every rank all-gathers a catalog of what it holds (per copy: step, old world,
   which old ranks' segments: metadata, not data); a survivor offers its last copy
   and the one before it (Engine.peer_snapshots), so that a peer lost during a
   refresh, which leaves some survivors swapped to the new copy and some not, still
   leaves a step they cover together;
2. the newest step whose holdings cover every old rank is chosen (a stage-0 copy is
   whole: any holder covers all); if none, every rank raises PeersIncomplete naming
   the missing old ranks, having changed nothing;
3. a manifest for that step is assembled from the catalog and planned exactly as a
   checkpoint load is (load._Plan): each rank learns which element ranges of which
   old rank's segments its new shards need;
4. the requests are all-gathered; one holder per old rank (its own process if it
   survived, else the lowest new rank holding it) sends each requester the slices it
   asked for (see below); a rank holding the data reads it locally;
5. load._apply writes the rest of the state, as a file load would.

With model parallelism every MP slice is a sharded state of its own over its DP group
(as its checkpoint is, under ``mp-RR-of-MM``), and each slice runs the steps above over
that group. A slice's copies may stand at other steps than another slice's (a rank
lost during a refresh: some slices swapped to the new copy, some did not), and a
model whose slices are at different steps is no model: in step 2 the slices exchange
the steps each covers over the MP group and take the newest they all cover; when
there is none, every rank of every slice raises PeersIncomplete, having changed
nothing.

[Note: slices straight into place]
A slice of at least DIRECT_BYTES travels as a message of its own: the holder sends a
view of its host copy and the requester receives into the very tensor the slice
belongs to (a master, an optimizer state), so neither side stages it. Smaller slices
share one packed message per pair of ranks (one message instead of thousands on a
model of many small tensors). Both sides order the messages alike from the gathered
requests: the packed one first, then the large ones in request order. A newcomer
taking half of a 267 M GPT's stage-2 states (1.5 GiB) restored in 7.6 s with every
slice packed, 1.7 s this way, and each side's peak is 1.5 GiB lower (the packed and the
staging buffer; ``benchmarks/peer_restore.py``). Since data lands in the engine as it
arrives, a transfer that fails part-way leaves the engine partly written: the caller
falls back to a checkpoint, whose load rewrites every byte, as after any failure here.

[Note: a grow lends its state]
To grow, every existing rank offers its state at the step boundary and then drops its
engine before building the new one (workers/rank.py). A packed copy of that state is
written only to be read once and freed: on a 267 M GPT alone at stage 2 that is 3 GiB of
fresh memory beside the engine it copies (the rank's peak) and a second or more of
writing. ``take_copy(lend_state=True)`` (``Engine.snapshot_now(lend=True)``) instead returns a
``LentCopy``: the engine's own host tensors, by reference, which stay alive and
unwritten once the engine is closed and dropped, since nothing trains them any more. It
is only for a caller that never trains that engine again; tensors on a GPU are copied
to host memory, one by one, as a packed copy would.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .files import CheckpointError, dtype_of
from .load import (
    Destination,
    LoadResult,
    _all_errors,
    _apply,
    _check_optimizer,
    _Plan,
    saved_counters,
    zero_masters,
)
from .save import manifest_header, per_element_kinds, rng_state, snapshot_items
from .state import ShardedState

if TYPE_CHECKING:
    from ..comm import Communicator

PEERS = Path("<peers>")
"""The ``path`` of a LoadResult restored from peers."""
ALIGN = 8
"""Segments start at multiples of this in a packed buffer, so any dtype views them."""
DIRECT_BYTES = 1 << 20
"""Slices of at least this many bytes travel as messages of their own, straight from
the holder's copy into the requester's tensor; smaller ones share one packed message.
See [Note: slices straight into place]."""


class PeersIncomplete(CheckpointError):
    """No step at which the ranks' host copies together cover every old rank; the
    message names the missing old ranks. Fall back to a checkpoint on disk."""


def _label(rank: int) -> str:
    return f"rank-{rank:05d}"


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _view(buffer: torch.Tensor, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    return buffer[offset : offset + count * size].view(dtype)


@dataclass
class HeldCopy:
    """One old rank's checkpoint items at one step, packed into one host buffer:
    ``segments`` are manifest segments whose ``offset``/``bytes`` point into ``data``."""

    rank: int
    segments: list[dict[str, Any]]
    data: torch.Tensor
    """uint8, host memory."""
    rng: dict[str, Any] | None

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def read(self, seg: dict[str, Any], start: int, end: int, what: str) -> torch.Tensor:
        """Elements [start, end) of one of this copy's segments (a view)."""
        dtype = dtype_of(seg["dtype"])
        size = torch.empty((), dtype=dtype).element_size()
        return _view(self.data, seg["offset"] + start * size, end - start, dtype)

    def meta(self) -> dict[str, Any]:
        """Everything but the data, as plain JSON."""
        return {"rank": self.rank, "segments": self.segments, "rng": self.rng}


@dataclass
class LentCopy:
    """One old rank's checkpoint items as its engine's own host tensors, by reference
    (see [Note: a grow lends its state]): read as a ``HeldCopy`` is. ``segments`` carry
    the offsets a packed copy would give them, which name each one's tensor here."""

    rank: int
    segments: list[dict[str, Any]]
    tensors: list[torch.Tensor]
    """Flat, one per segment, in the segments' order."""
    rng: dict[str, Any] | None

    def __post_init__(self) -> None:
        self._by_offset = {
            seg["offset"]: t for seg, t in zip(self.segments, self.tensors, strict=True)
        }

    @property
    def nbytes(self) -> int:
        """Bytes referenced (none of them allocated for the copy, except from a GPU)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def read(self, seg: dict[str, Any], start: int, end: int, what: str) -> torch.Tensor:
        tensor = self._by_offset[seg["offset"]]
        if tensor.dtype != dtype_of(seg["dtype"]):
            raise CheckpointError(f"{what}: lent {tensor.dtype}, asked for {seg['dtype']}")
        return tensor[start:end]

    def meta(self) -> dict[str, Any]:
        return {"rank": self.rank, "segments": self.segments, "rng": self.rng}


@dataclass
class PeerSnapshot:
    """What a rank holds in host memory at one step: its own copy and (ring
    redundancy) its neighbour's. Plain tensors and dicts: valid after the engine is
    closed and its process group destroyed."""

    step: int
    world: int
    """The data-parallel world size the copies were taken at."""
    own: int
    """The old rank that took it (its own copy is ``copies[own]``)."""
    whole: bool
    """Stage 0: each copy holds the whole state (any one covers every old rank)."""
    header: dict[str, Any]
    """The manifest header (params, kinds, optimizer, counters): save.manifest_header."""
    copies: dict[int, HeldCopy | LentCopy] = field(default_factory=dict)
    """By old rank."""
    sent_bytes: int = 0
    """Bytes this rank sent to its neighbour for this copy (data and metadata)."""

    @property
    def nbytes(self) -> int:
        """Host bytes of the copies' buffers."""
        return sum(c.nbytes for c in self.copies.values())

    def release(self) -> None:
        """Let go of the copies (a restore has used them): their memory is freed once
        nothing else refers to it, and from here on this snapshot covers no rank."""
        self.copies = {}

    def catalog(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "world": self.world,
            "own": self.own,
            "whole": self.whole,
            "header": self.header,
            "copies": {r: c.meta() for r, c in self.copies.items()},
        }


def _segments(
    rank: int, items: list[tuple[dict[str, Any], torch.Tensor]]
) -> tuple[list[dict[str, Any]], int]:
    """The items' manifest segments, at their offsets in one aligned buffer, and its size."""
    segments, offset = [], 0
    for meta, data in items:
        n = data.numel() * data.element_size()
        dtype = str(data.dtype).removeprefix("torch.")
        segments.append(meta | {"file": _label(rank), "offset": offset, "bytes": n, "dtype": dtype})
        offset = _aligned(offset + n)
    return segments, offset


def pack(
    rank: int,
    items: list[tuple[dict[str, Any], torch.Tensor]],
    rng,
    into: torch.Tensor | None = None,
) -> HeldCopy:
    """Copy ``items`` (save.snapshot_items) into one aligned host buffer: ``into`` when
    it has the size (see [Note: reused copy buffers] in redundancy.py), else a new one."""
    segments, total = _segments(rank, items)
    raws = [data.detach().reshape(-1).contiguous().view(torch.uint8) for _, data in items]
    buffer = _packed(
        total, [(seg["offset"], raw) for seg, raw in zip(segments, raws, strict=True)], into
    )
    return HeldCopy(rank, segments, buffer, rng)


def lend(rank: int, items: list[tuple[dict[str, Any], torch.Tensor]], rng) -> LentCopy:
    """``items`` by reference, flat (a GPU tensor copied to host memory). See [Note: a
    grow lends its state]."""
    segments, _ = _segments(rank, items)
    tensors = [data.detach().to("cpu").reshape(-1) for _, data in items]
    return LentCopy(rank, segments, tensors, rng)


def _packed(
    total: int, pieces: list[tuple[int, torch.Tensor]], into: torch.Tensor | None = None
) -> torch.Tensor:
    """A uint8 buffer of ``total`` bytes (``into`` when it has the size) holding each
    (offset, bytes) piece, in order of offset, with the alignment gaps between them
    zeroed. Not zero-filled first: each byte is written once (a 267 M GPT's 3.2 GiB
    host copy, taken again in a warm process: 1.44 s with the buffer zeroed first, 1.13
    s without)."""
    usable = into is not None and into.numel() == total and into.dtype == torch.uint8
    buffer = into if usable else torch.empty(total, dtype=torch.uint8)
    assert buffer is not None
    end = 0
    for offset, raw in pieces:
        buffer[end:offset].zero_()
        buffer[offset : offset + raw.numel()].copy_(raw)
        end = offset + raw.numel()
    buffer[end:].zero_()
    return buffer


def take_copy(
    state: ShardedState, into: torch.Tensor | None = None, lend_state: bool = False
) -> PeerSnapshot:
    """This rank's own checkpoint items now, in host memory (no collective): in
    ``into`` when it has the size; ``lend_state``: the state's own tensors, by reference
    (see [Note: a grow lends its state]). Stage 0: the whole state, as rank 0 would
    write it."""
    if state.pending_micro_steps:
        raise CheckpointError(
            f"snapshot: {state.pending_micro_steps} micro-batch(es) accumulated since the "
            "last step; take it after engine.step() completes an optimizer step"
        )
    kinds, scalars = per_element_kinds(state)
    writer = dataclasses.replace(state, rank=0) if state.whole else state
    # copy=False: pack() is the copy, one host buffer, with no second staging copy.
    items = snapshot_items(writer, kinds, copy=False)
    own: HeldCopy | LentCopy = (
        lend(state.rank, items, rng_state())
        if lend_state
        else pack(state.rank, items, rng_state(), into)
    )
    header = manifest_header(state, kinds, scalars, None)
    step, world = state.counters.global_steps, state.world
    return PeerSnapshot(step, world, state.rank, state.whole, header, {state.rank: own})


Key = tuple[int, int]
"""(step, old world) of a host copy."""


def _covered(
    catalogs: list[list[dict[str, Any]]],
) -> tuple[list[tuple[Key, dict[str, Any], dict[int, int]]], list[str]]:
    """Every (step, world) the ranks' copies cover fully, newest first, each with its
    manifest and, for each old rank, the new rank that serves it; and, for the others,
    which old ranks are missing. The same on every rank: all see the catalogs."""
    by_key: dict[Key, dict[int, dict[str, Any]]] = {}
    for new, held in enumerate(catalogs):
        for cat in held:
            by_key.setdefault((cat["step"], cat["world"]), {})[new] = cat
    covered, missing_at = [], []
    for step, world in sorted(by_key, reverse=True):
        cats = by_key[(step, world)]
        holders = sorted(cats)
        if cats[holders[0]]["whole"]:
            serve = {cats[holders[0]]["own"]: holders[0]}
            covered.append(((step, world), _manifest(cats, step, world, serve), serve))
            continue
        # Each old rank from its own process if it survived, else the lowest new rank.
        serve = {cats[n]["own"]: n for n in holders}
        for new in holders:
            for old in cats[new]["copies"]:
                serve.setdefault(old, new)
        missing = [r for r in range(world) if r not in serve]
        if missing:
            missing_at.append(f"step {step} (world {world}): old ranks {missing} missing")
        else:
            covered.append(((step, world), _manifest(cats, step, world, serve), serve))
    return covered, missing_at


def _incomplete(missing_at: list[str], any_held: bool) -> PeersIncomplete:
    if not any_held:
        return PeersIncomplete("<peers>: no rank holds a host copy; load a checkpoint")
    return PeersIncomplete(
        "<peers>: no step at which the survivors' host copies cover every old rank: "
        + "; ".join(missing_at)
        + "; load a checkpoint instead"
    )


def _manifest(
    cats: dict[int, dict[str, Any]], step: int, world: int, serve: dict[int, int]
) -> dict[str, Any]:
    """A manifest for ``step`` assembled from the holders' catalogs (load._Plan reads
    it); the random generators of every old rank that any holder has."""
    header = cats[serve[min(serve)]]["header"]
    rng: list[dict[str, Any] | None] = [None] * world
    for cat in cats.values():
        for old, meta in cat["copies"].items():
            rng[old] = meta["rng"]
    segments = [
        seg for old, new in sorted(serve.items()) for seg in cats[new]["copies"][old]["segments"]
    ]
    assert header["step"] == step
    return header | {"segments": segments, "rng": rng, "files": {}, "client_state": {}}


def _key(seg: dict[str, Any], start: int, end: int) -> tuple[str, int, int, int]:
    return (seg["file"], seg["offset"], start, end)


class _Fetched:
    """The slices this rank asked for, by (file, offset, start, end): a load.Reader."""

    def __init__(self) -> None:
        self.slices: dict[tuple[str, int, int, int], torch.Tensor] = {}

    def read(self, seg: dict[str, Any], start: int, end: int, what: str) -> torch.Tensor:
        return self.slices[_key(seg, start, end)]


def _nbytes(request: list[Any]) -> int:
    _, _, _, start, end, dtype = request
    return (end - start) * torch.empty((), dtype=dtype_of(dtype)).element_size()


def _exchange(
    held: PeerSnapshot | None,
    destinations: list[Destination],
    serve: dict[int, int],
    comm: Communicator,
    group,
    tag: str,
) -> _Fetched:
    """Point-to-point: every rank receives the slices it needs from their holders. See
    [Note: slices straight into place]."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    by_label = {_label(old): old for old in serve}
    into: dict[tuple[str, int, int, int], torch.Tensor] = {}
    mine: list[list[Any]] = []
    for seg, a, b, view in destinations:
        key = _key(seg, a, b)
        if key not in into:
            into[key] = view
            mine.append([serve[by_label[seg["file"]]], *key, seg["dtype"]])
    requests: list[Any] = [None] * world
    dist.all_gather_object(requests, mine, group=group)
    fetched = _Fetched()
    copies = {_label(r): c for r, c in held.copies.items()} if held is not None else {}

    def local(request) -> torch.Tensor:
        _, file, offset, a, b, dtype = request
        return copies[file].read({"offset": offset, "dtype": dtype}, a, b, file)

    def packed(requests: list[Any]) -> tuple[list[int], int]:
        offsets, total = [], 0
        for r in requests:
            offsets.append(total)
            total = _aligned(total + _nbytes(r))
        return offsets, total

    pending, unpack = [], []
    for peer in range(world):
        if peer == me:
            for r in mine:
                if r[0] == me:
                    fetched.slices[(r[1], r[2], r[3], r[4])] = local(r)
            continue
        wanted = [r for r in requests[peer] if r[0] == me]  # I serve these to peer
        small = [r for r in wanted if _nbytes(r) < DIRECT_BYTES]
        if small:
            offsets, total = packed(small)
            raws = [local(r).reshape(-1).view(torch.uint8) for r in small]
            out = _packed(total, list(zip(offsets, raws, strict=True)))
            pending.append(comm.send(out, peer, tag))
        pending += [comm.send(local(r), peer, tag) for r in wanted if _nbytes(r) >= DIRECT_BYTES]
        asked = [r for r in mine if r[0] == peer]
        small = [r for r in asked if _nbytes(r) < DIRECT_BYTES]
        if small:
            offsets, total = packed(small)
            buffer = torch.empty(total, dtype=torch.uint8)
            pending.append(comm.recv(buffer, peer, tag))
            unpack.append((buffer, small, offsets))
        for r in asked:
            if _nbytes(r) >= DIRECT_BYTES:
                key = (r[1], r[2], r[3], r[4])
                dest = into[key]
                if dest.dtype != dtype_of(r[5]) or not dest.is_contiguous():
                    dest = torch.empty(r[4] - r[3], dtype=dtype_of(r[5]))
                pending.append(comm.recv(dest, peer, tag))
                fetched.slices[key] = dest
    for p in pending:
        p.wait()
    for buffer, small, offsets in unpack:
        for r, off in zip(small, offsets, strict=True):
            data = _view(buffer, off, r[4] - r[3], dtype_of(r[5]))
            fetched.slices[(r[1], r[2], r[3], r[4])] = data
    return fetched


def _common_step(covered: list[Key], why: str, slices) -> Key:
    """The newest (step, world) that every MP slice covers (collective over
    ``slices``, the model-parallel group); PeersIncomplete on every rank when there is
    none. See [Note: restore from peers]."""
    verdicts: list[Any] = [None] * dist.get_world_size(slices)
    dist.all_gather_object(verdicts, (covered, why), group=slices)
    lacking = [f"model-parallel slice {i}: {w}" for i, (keys, w) in enumerate(verdicts) if not keys]
    if lacking:
        raise PeersIncomplete("; ".join(lacking))
    common = set.intersection(*(set(map(tuple, keys)) for keys, _ in verdicts))
    if not common:
        steps = [sorted(step for step, _ in keys) for keys, _ in verdicts]
        raise PeersIncomplete(
            f"<peers>: the model-parallel slices' host copies share no step (steps by "
            f"slice: {steps}); load a checkpoint instead"
        )
    return max(common)


def snapshots_of(held: PeerSnapshot | list[PeerSnapshot] | None) -> list[PeerSnapshot]:
    """What a rank passes to a restore (one snapshot, several, or none), as a list."""
    return [held] if isinstance(held, PeerSnapshot) else list(held or [])


def restore_from_peers(
    state: ShardedState,
    held: PeerSnapshot | list[PeerSnapshot] | None,
    comm: Communicator,
    tag: str = "load",
    slices=None,
) -> LoadResult:
    """Collective over ``state.group`` (the new group) and ``slices`` (the model-
    parallel group, with MP): restore ``state`` from what the ranks hold. See [Note:
    restore from peers]. The caller applies the counters and publishes the parameters,
    as after ``load_checkpoint``."""
    if state.pending_micro_steps:
        raise CheckpointError("restore: gradients are being accumulated; restore between steps")
    group = state.group
    mine = snapshots_of(held)
    catalogs: list[Any] = [None] * state.world
    dist.all_gather_object(catalogs, [c.catalog() for c in mine], group=group)
    covered, missing_at = _covered(catalogs)
    if slices is not None:
        why = "" if covered else str(_incomplete(missing_at, any(catalogs)))
        key = _common_step([k for k, _, _ in covered], why, slices)
    elif covered:
        key = covered[0][0]
    else:
        raise _incomplete(missing_at, any(catalogs))
    manifest, serve = next((m, sv) for k, m, sv in covered if k == key)
    source = next((c for c in mine if (c.step, c.world) == key), None)
    error, plan = None, None
    try:
        _check_optimizer(state, manifest, PEERS)
        plan = _Plan(state, manifest, PEERS)
    except CheckpointError as exc:
        error = str(exc)
    errors = _all_errors(error, group)
    if errors:
        raise CheckpointError("; ".join(errors))
    assert plan is not None
    zero_masters(state)
    fetched = _exchange(source, plan.destinations(state), serve, comm, group, tag)
    _apply(state, plan, fetched, zeroed=True)
    return LoadResult(PEERS, manifest["step"], {}, saved_counters(manifest))
