"""Host copies of the training state on peers (``redundancy="host-copy"``).

After every K-th optimizer step each rank copies what it would write to a checkpoint
into host memory and exchanges it along a ring of the DP group: rank r sends its copy
to rank (r - 1) mod N and receives rank (r + 1) mod N's. Every rank then holds its own
state and its neighbour's at the same step, so any single lost rank (or any set of
non-adjacent ones) can be rebuilt by the survivors from memory
(checkpoint/peers.py) instead of a file. A rank keeps its previous copy until the new
one is complete, then swaps. Stage 0 keeps whole masters on every rank: each rank's
copy is the whole state already, and nothing is exchanged. A group of one rank keeps
no copy: no peer could hold it.

[Note: reused copy buffers]
Once swapped out, the previous copy is kept as the spare, and the next refresh writes
its own copy and receives its neighbour's into the spare's buffers when their sizes
match. A refresh needs the two sets of buffers at once anyway (the new copy is written
while the current one must stay whole), so keeping the spare moves no peak; it saves
writing to fresh memory, whose first touch costs page faults and, on a node short of
free memory, the kernel's reclaim. On the 267 M GPT at stage 2, N_d = 2, the optimizer
step with its copy took 5.3 s into fresh buffers and 2.3 s into reused ones (0.7 s
with no copy; the peak resident memory the same, 9.1 GiB; ``python -m
benchmarks.host_copies``). A copy handed out by ``hand_out`` (Engine.peer_snapshot,
Engine.peer_snapshots) is never written again: it does not become the spare, and a
spare handed out is not written into.

The spare is a complete copy of the step before (K steps before) as long as no refresh
has begun writing into it: a refresh takes it out of ``_spare`` first, so a refresh cut
short (a peer lost mid-exchange) leaves no spare behind. That is why the spare is
offered to a restore beside the current copy (``peer_snapshots``): a rank lost during
a refresh can leave some survivors swapped to the new copy and others not, and the
step before is then the newest one they hold together.
"""

from __future__ import annotations

import json
import weakref

import torch

from . import comm as comm_
from .checkpoint.peers import HeldCopy, PeerSnapshot, take_copy
from .checkpoint.state import ShardedState

TAG = "redundancy"


class HostCopies:
    """The latest complete host copy of this rank (its own and its neighbour's), and
    the one before it as the spare (see [Note: reused copy buffers])."""

    def __init__(self, interval: int, comm: comm_.Communicator):
        self.interval, self.comm = interval, comm
        self.held: PeerSnapshot | None = None
        self._spare: PeerSnapshot | None = None
        self._handed_out: list[weakref.ref[PeerSnapshot]] = []
        """Weak: once the caller drops a copy, it is not kept alive here."""

    @property
    def nbytes(self) -> int:
        """Host bytes of the copies held now (own + neighbour), exactly."""
        return self.held.nbytes if self.held is not None else 0

    @property
    def spare_nbytes(self) -> int:
        """Host bytes of the spare's buffers, kept for the next refresh to write into."""
        return self._spare.nbytes if self._spare is not None else 0

    def hand_out(self, with_spare: bool = False) -> list[PeerSnapshot]:
        """The current copy (and, ``with_spare``, the spare: the step before), newest
        first, for a caller that keeps them: never written again."""
        copies = [c for c in (self.held, self._spare if with_spare else None) if c is not None]
        self._handed_out = [r for r in self._handed_out if r() is not None]
        self._handed_out += [weakref.ref(c) for c in copies if not self._is_handed_out(c)]
        return copies

    def _is_handed_out(self, copy: PeerSnapshot) -> bool:
        return any(r() is copy for r in self._handed_out)

    def after_step(self, state: ShardedState) -> None:
        """Refresh after every ``interval``-th step (a collective on the DP group)."""
        if state.counters.global_steps % self.interval == 0:
            self.refresh(state)

    def refresh(self, state: ShardedState) -> None:
        spare, self._spare = self._spare, None
        if state.world == 1:
            # No peer could hold it, and a group that grows takes its own copy at that
            # boundary (Engine.snapshot_now): a copy now would only cost a step's worth
            # of copying and the model states' bytes again.
            self.held = None
            return
        own_into = neighbour_into = None
        if spare is not None and not self._is_handed_out(spare):
            buffers = {r: c.data for r, c in spare.copies.items() if isinstance(c, HeldCopy)}
            own_into = buffers.get(spare.own)
            others = [data for r, data in buffers.items() if r != spare.own]
            neighbour_into = others[0] if others else None
        snapshot = take_copy(state, into=own_into)
        if not state.whole and state.world > 1:
            neighbour = self._exchange(snapshot, neighbour_into)
            snapshot.copies[neighbour.rank] = neighbour
        previous, self.held = self.held, snapshot  # swapped only once complete
        if previous is not None and not self._is_handed_out(previous):
            self._spare = previous

    def _exchange(self, snapshot: PeerSnapshot, into: torch.Tensor | None) -> HeldCopy:
        """Send this rank's copy to (r - 1) mod N, receive (r + 1) mod N's: its sizes,
        its metadata (segments, RNG) as JSON, its data, each one message (into ``into``
        when it has the size)."""
        rank, world = self.comm.rank, self.comm.world
        dst, src = (rank - 1) % world, (rank + 1) % world
        own = snapshot.copies[snapshot.own]
        assert isinstance(own, HeldCopy)  # packed by take_copy, never lent
        meta = json.dumps(own.meta()).encode()
        sizes = torch.tensor([len(meta), own.nbytes], dtype=torch.int64)
        their_sizes = torch.empty(2, dtype=torch.int64)
        comm_.wait_all([self.comm.send(sizes, dst, TAG), self.comm.recv(their_sizes, src, TAG)])
        meta_len, data_len = (int(x) for x in their_sizes)
        their_meta = torch.empty(meta_len, dtype=torch.uint8)
        their_data = (
            into
            if into is not None and into.numel() == data_len
            else torch.empty(data_len, dtype=torch.uint8)
        )
        pending = [
            self.comm.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8), dst, TAG),
            self.comm.recv(their_meta, src, TAG),
        ]
        if own.nbytes:
            pending.append(self.comm.send(own.data, dst, TAG))
        if data_len:
            pending.append(self.comm.recv(their_data, src, TAG))
        comm_.wait_all(pending)
        snapshot.sent_bytes = sizes.numel() * 8 + len(meta) + own.nbytes
        got = json.loads(bytes(their_meta.numpy()))
        return HeldCopy(got["rank"], got["segments"], their_data, got["rng"])
