"""All-reduce, reduce-scatter and all-gather through shared memory, for a group on one host.

[Note: shared-memory collectives]
Between ranks of one host, gloo moves every byte through TCP on the loopback: into a
socket buffer, out of it, then (reducing) added, each step on a CPU the ranks' training
also needs. Measured on a 2-core machine, world 2, 7.4 M fp32 elements: gloo's
all_reduce 26-29 ms; copied through shared memory and summed there, 10-11 ms
(``python -m benchmarks.collectives``). With
``collectives="shm"`` a group whose ranks all share one host runs these three
collectives that way (``Communicator`` keeps tensors below ``SMALL_ELEMENTS`` and other
ops on the backend).

Each rank owns one segment, a file under ``/dev/shm`` that every rank of the group
maps; the owner unlinks it once all have mapped it, so a crashed job leaves nothing
behind. A segment has two halves; a collective runs in passes over at most one half:

- all-gather: each rank copies its chunk's columns into its half; barrier; each copies
  the others' columns out of their owners' halves;
- reduce-scatter: each rank copies its (N, w) block; barrier; rank r sums row r of
  every rank's half, in group-rank order, into its chunk;
- all-reduce: each rank copies its piece, but for sub-piece r, which only rank r reads;
  barrier; rank r sums sub-piece r of every rank (its own term from its tensor), in
  group-rank order, and writes the sum into its own half; barrier; each copies every
  sub-piece from the half of the rank that summed it.

Every rank adds the same values in the same order, so all ranks hold the same bits,
as with gloo. Passes alternate halves, so a pass never overwrites what a peer may
still be reading from the pass before: a rank starts pass k + 2 (the same half as k)
only after the first barrier of pass k + 1, which each peer reaches after its last
read of pass k.

[Note: shm barrier]
A barrier is a counter in the head of each segment: a rank writes the barrier's number
into its own and waits until every rank's has reached it. The data copied before the
write is visible to whoever then reads the counter: x86 keeps stores in order, and on
other CPUs ``Communicator`` does not offer "shm". A waiting rank first yields the CPU
between polls (the peer is usually microseconds away), then sleeps between them (up to
0.5 ms), so a rank that waits for a slower one does not take the CPU the slower one
needs. Measured on the 2-core machine, world 2: a pass's two barriers cost about
0.1 ms, where point-to-point messages over gloo took 1.4 ms each in the same loop. A
wait ends with an error when the rank waited for is gone (its pid, in the head, no
longer runs), when ``close`` is called (an interrupted engine: see [Note: interrupting
a collective] in interrupt.py), or after ``timeout_s``.

Memory: each rank maps N segments of ``2 x half_bytes`` and touches them all when the
group forms (so the first step pays no page faults): ``scratch_bytes``, in the ledger's
``comm_buffers``. ``half_bytes`` is 4 x ``max_chunk`` (the engine passes C_B / N, as for
the ring), at most ``MAPPED_BYTES`` / (2N), so a rank maps at most ``MAPPED_BYTES``.
"""

from __future__ import annotations

import os
import platform
import secrets
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist

from .config import ConfigError
from .serial import OrderedCollectives

MAPPED_BYTES = 16 * 2**20
"""The most shared memory one rank maps: N segments of two halves."""
MIN_HALF_BYTES = 64 * 2**10
HEADER_BYTES = 64
"""A segment's head: the barrier counter and the owner's pid."""
SPIN_POLLS = 200
"""Polls that yield the CPU before a waiting rank starts to sleep between polls."""
MAX_SLEEP_S = 5e-4
X86 = ("x86_64", "amd64")
WAIT_S = 1800.0
"""How long a barrier waits for a rank that is alive (torch.distributed's default
timeout)."""


def half_bytes_for(world: int, max_chunk: int | None) -> int:
    """The bytes of one half of a segment (a multiple of 64)."""
    cap = MAPPED_BYTES // (2 * world)
    size = cap if max_chunk is None else min(cap, 4 * max_chunk)
    return max(MIN_HALF_BYTES, size) // 64 * 64


class SharedMemoryComm(OrderedCollectives):
    """The group's segments, and the collectives that run through them in order."""

    def __init__(
        self,
        group=None,
        max_chunk: int | None = None,
        directory: str = "/dev/shm",
        timeout_s: float = WAIT_S,
    ):
        machine = platform.machine()
        unsupported = (
            ""
            if machine.lower() in X86
            else f"'shm' needs an x86-64 host (its barrier relies on x86's store order); "
            f"rank {dist.get_rank(group)} runs on {machine}"
        )
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.half_bytes = half_bytes_for(self.world, max_chunk)
        self.timeout_s = timeout_s
        nbytes = HEADER_BYTES + 2 * self.half_bytes
        self._segments = _map_segments(group, self.world, self.rank, nbytes, directory, unsupported)
        self._flags = [s[:HEADER_BYTES].view(torch.int64).numpy() for s in self._segments]
        """Per rank: [0] the last barrier it reached, [1] its pid."""
        self._epoch = 0
        self._pass = 0
        self._stopping = False
        super().__init__("zeroservice-shm")

    @property
    def scratch_bytes(self) -> int:
        return self.world * (HEADER_BYTES + 2 * self.half_bytes)

    def all_reduce(self, tensor: torch.Tensor) -> Future[float]:
        """Sum ``tensor`` (contiguous, on the CPU) in place; returns seconds taken."""
        return self._thread.submit(self._all_reduce, tensor)

    def reduce_scatter(self, buffer: torch.Tensor) -> Future[float]:
        """Sum ``buffer`` (N equal chunks) into its chunk ``rank``; the other chunks are
        left as they were. Returns seconds taken."""
        return self._thread.submit(self._reduce_scatter, buffer)

    def all_gather(self, buffer: torch.Tensor) -> Future[float]:
        """Fill every chunk of ``buffer`` from the rank that owns it; returns seconds."""
        return self._thread.submit(self._all_gather, buffer)

    def close(self, wait: bool = True) -> None:
        """Stop the thread once the queued jobs are done and let the mappings go; or
        (``wait=False``, after an interrupt) end the job in progress at its next poll."""
        if not wait:
            self._stopping = True
        self.shutdown(wait)
        if wait:
            self._segments, self._flags = [], []

    # -- on the thread ------------------------------------------------------------------
    def _halves(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """This pass's half of every rank's segment, as ``dtype``."""
        h = self.half_bytes
        lo = HEADER_BYTES + (self._pass % 2) * h
        self._pass += 1
        return [s[lo : lo + h].view(dtype) for s in self._segments]

    def _barrier(self) -> None:
        """Wait until every rank has reached this barrier. See [Note: shm barrier]."""
        self._epoch += 1
        epoch = self._epoch
        self._flags[self.rank][0] = epoch
        started = time.monotonic()
        polls = 0
        for j in range(self.world):
            flag = self._flags[j]
            while flag[0] < epoch:
                polls += 1
                if polls < SPIN_POLLS:
                    os.sched_yield()
                    continue
                if self._stopping:
                    raise RuntimeError("shared-memory collective abandoned: the group is closing")
                waited = time.monotonic() - started
                if polls % 64 == 0:
                    self._check_alive(j, waited)
                time.sleep(min(MAX_SLEEP_S, 1e-5 * (polls - SPIN_POLLS + 1)))

    def _check_alive(self, j: int, waited: float) -> None:
        pid = int(self._flags[j][1])
        if not _alive(pid):
            raise RuntimeError(f"shared-memory collective: group rank {j} (pid {pid}) is gone")
        if waited > self.timeout_s:
            raise RuntimeError(
                f"shared-memory collective: group rank {j} did not arrive within "
                f"{self.timeout_s:.0f} s"
            )

    def _capacity(self, dtype: torch.dtype) -> int:
        return self.half_bytes // torch.empty((), dtype=dtype).element_size()

    def _all_reduce(self, tensor: torch.Tensor) -> float:
        t0 = time.perf_counter()
        flat = tensor.view(-1)
        n, r = self.world, self.rank
        step = self._capacity(flat.dtype)
        for a, b in _blocks(flat.numel(), step):
            piece = flat[a:b]
            halves = self._halves(flat.dtype)
            bounds = _split(piece.numel(), n)
            lo, hi = bounds[r], bounds[r + 1]
            own, mine = halves[r], piece[lo:hi]
            # The others read every sub-piece but this rank's, which it sums in place.
            own[:lo].copy_(piece[:lo])
            own[hi : piece.numel()].copy_(piece[hi:])
            terms = [h[lo:hi] for h in halves]
            if r < 2:  # the first addition reads ``mine`` before it writes it
                terms[r] = mine
            else:
                terms[r].copy_(mine)
            self._barrier()
            _sum_into(mine, terms)
            own[lo:hi].copy_(mine)
            self._barrier()
            for j in range(n):
                if j != r:
                    piece[bounds[j] : bounds[j + 1]].copy_(halves[j][bounds[j] : bounds[j + 1]])
        return time.perf_counter() - t0

    def _column_passes(
        self, buffer: torch.Tensor, rows: int
    ) -> Iterator[tuple[torch.Tensor, int, int, list[torch.Tensor]]]:
        """The passes over the (N, S) view of ``buffer``: (that view, first column, end
        column, the pass's halves), each block narrow enough for ``rows`` rows in a half."""
        chunks = buffer.view(self.world, -1)
        width = max(1, self._capacity(buffer.dtype) // rows)
        for c0, c1 in _blocks(chunks.shape[1], width):
            yield chunks, c0, c1, self._halves(buffer.dtype)

    def _reduce_scatter(self, buffer: torch.Tensor) -> float:
        t0 = time.perf_counter()
        n, r = self.world, self.rank
        for chunks, c0, c1, halves in self._column_passes(buffer, n):
            w = c1 - c0
            halves[r][: n * w].view(n, w).copy_(chunks[:, c0:c1])
            self._barrier()
            _sum_into(chunks[r, c0:c1], [h[r * w : (r + 1) * w] for h in halves])
        return time.perf_counter() - t0

    def _all_gather(self, buffer: torch.Tensor) -> float:
        t0 = time.perf_counter()
        n, r = self.world, self.rank
        for chunks, c0, c1, halves in self._column_passes(buffer, 1):
            halves[r][: c1 - c0].copy_(chunks[r, c0:c1])
            self._barrier()
            for j in range(n):
                if j != r:
                    chunks[j, c0:c1].copy_(halves[j][: c1 - c0])
        return time.perf_counter() - t0


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie has ended: it only awaits its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def _blocks(total: int, width: int) -> Iterator[tuple[int, int]]:
    """[a, b) ranges of at most ``width`` that cover ``range(total)`` in order."""
    for a in range(0, total, width):
        yield a, min(total, a + width)


def _split(numel: int, parts: int) -> list[int]:
    """Bounds of ``parts`` near-equal sub-pieces of ``numel`` elements."""
    return [numel * i // parts for i in range(parts + 1)]


def _sum_into(out: torch.Tensor, terms: list[torch.Tensor]) -> None:
    """``out`` = terms[0] + terms[1] + ..., added in that order (the same on every rank)."""
    torch.add(terms[0], terms[1], out=out)
    for t in terms[2:]:
        out.add_(t)


def _map_segments(
    group, world: int, rank: int, nbytes: int, directory: str, problem: str = ""
) -> list[torch.Tensor]:
    """Create this rank's segment (its pid in the head), map every rank's, and unlink
    this rank's file.

    Collective over ``group`` (its ranks call it together). Raises ConfigError on every
    rank when one of them has a ``problem`` already or cannot see another's segment: the
    ranks are not on one host (or do not share ``directory``)."""
    names: list[str | None] = [secrets.token_hex(8) if rank == 0 else None]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(names, src=src, group=group)
    paths = [Path(directory) / f"zeroservice-{names[0]}-{i}" for i in range(world)]
    mine = paths[rank]
    segments: list[torch.Tensor] = []
    try:
        if not problem:
            try:
                fd = os.open(mine, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.posix_fallocate(fd, 0, nbytes)  # a full tmpfs fails here, not in a step
                finally:
                    os.close(fd)
            except OSError as exc:
                problem = f"rank {rank} cannot create {nbytes} bytes in {directory}: {exc}"
        _agree(problem, group)
        missing = [i for i, p in enumerate(paths) if not p.exists()]
        if missing:
            problem = (
                f"rank {rank} cannot see the shared memory of ranks {missing} in {directory}: "
                "collectives='shm' needs every rank of the group on one host"
            )
        _agree(problem, group)
        try:
            segments = [
                torch.from_file(str(p), shared=True, size=nbytes, dtype=torch.uint8) for p in paths
            ]
            segments[rank].zero_()  # touch every page now, not in the first step
            segments[rank][:HEADER_BYTES].view(torch.int64)[1] = os.getpid()
            for s in segments:
                s.max()
        except (OSError, RuntimeError) as exc:
            problem = f"rank {rank} cannot map the group's shared memory: {exc}"
        _agree(problem, group)  # all mapped, every pid written: the files can go
    finally:
        mine.unlink(missing_ok=True)
    return segments


def _agree(problem: str, group) -> None:
    """Raise ConfigError on every rank if any rank has a problem (the first one's)."""
    flag = torch.tensor([1 if problem else 0])
    dist.all_reduce(flag, group=group)
    if flag.item() == 0:
        return
    problems: list[str] = [""] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    raise ConfigError("collectives: " + next(p for p in problems if p))
