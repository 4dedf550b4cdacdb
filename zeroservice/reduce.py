"""Gradient reduction: each unit's gradients leave the rank as soon as backward finishes it.

[Note: reduction order]
Collectives must be issued in the same order on every rank. Gradients can arrive in
a different order on different ranks (data-dependent control flow, unused
parameters), so a finished unit is launched only when every unit before it in the
*launch order* has been launched; ``finalize_backward`` launches whatever is left, in
that order, with zeros for parameters that got no gradient. A unit finished before its
turn waits in a staging buffer of its own, so the launch order must follow the order
backward finishes units, or a model whose forward calls its modules out of
registration order would hold about Psi extra bytes at stage 2. The launch order starts
as index order (reverse registration); the first forward records the order in which it
used the units, and before the first backward that reduces, every rank adopts its
reverse; after that backward, the order in which units actually finished (see
launch_order.py). Each is adopted only when all ranks proposed the same order (two
small collectives, tag "order", each once). From then on two staging buffers suffice;
a model whose order changes from step to step falls back on temporary buffers,
counted in the pool's ``overflows`` and in the ledger's peak.

[Note: gradient storage]
Stages 0 and 1 keep a full gradient buffer per unit and make each ``param.grad`` a
view of it, so autograd accumulates micro-batches in place and nothing is copied
before the reduction. Stages 2 and 3 keep only the shard: each parameter's gradient
is copied into a staging buffer as it arrives and released at once; the
reduce-scatter output is copied into the resident shard on the first micro-batch and
added to it on the next ones. A unit larger than C_B is not staged whole: see
[Note: constant buffers]. At most two staging buffers are in flight; without
``overlap_comm`` each reduction is still launched as soon as its unit is ready (so
units never wait in buffers of their own), then waited for at once.

[Note: fp16 gradients are averaged, not summed]
In fp16 each rank divides its (loss-scaled) gradient by N_d before the reduction, as
DDP does, so the reduction yields the mean. Summed, N_d finite gradients can pass
fp16's 65504 together: the step would be skipped where DDP + ``GradScaler`` (which
judges the mean) applies it, and the loss scale would settle about N_d times lower.
fp32 and bf16 have the range to sum first and divide once in the optimizer step, one
pass over the gradients fewer (see [Note: shard step] in optim.py).

[Note: gradient lifetime]
A gradient shard is needed from the reduction that writes it to the step that consumes
it, so stages 2 and 3 do not hold one in between: the shards (one contiguous buffer,
M_D) are allocated at the first reduction after a step and dropped by ``zero_grads``
after it, as ``zero_grad(set_to_none=True)`` drops a plain model's gradients. The
forward, where a step without activation checkpointing peaks, then runs 4Ψ/N_d (fp32)
bytes lighter. The buffer is allocated uninitialised: every unit's slice is written
whole by its first reduction (zeros where no gradient exists), and on a CPU its pages
become resident only as reductions write them, while backward frees the activations
those units saved. With gradient accumulation the shards live from the first
micro-batch's backward to the step. Stages 0/1 keep their full buffers: ``param.grad``
views them and autograd accumulates into them. The ledger's ``grads`` counts the
shards' bytes whether or not they are held at the moment.

[Note: constant buffers]
Every staging buffer holds C_B = ``bucket_elements`` rounded up to a multiple of N
elements (fewer if no unit is that large), whatever the model's size: the paper's
constant buffers. Units are at most C_B elements (flat.py) except a single parameter
larger than that, which forms its own *oversized* unit. Such a unit is never staged
whole. Its gradients are held as they are (stage 2: the tensor autograd made for
``param.grad``; stage 3: the tensor handed to ``stage_grad``) or read from the full
gradient (stages 0/1, reducing in fp32 from bf16/fp16), and reduced *piecewise*: for
each column block [c0, c1) of width at most C_B / N of the unit's (N, S) view, the
block (N x w elements, zeros where no gradient exists: padding, or a parameter
without a gradient) is copied into a staging buffer and reduce-scattered, and this
rank's chunk lands in [c0, c1) of its gradient shard (copied, or added after the
first micro-batch, as for a whole unit). Unsharded reductions (stage 0, or a world
of 1) are the case N = 1: contiguous pieces all-reduced. The pieces of a unit are
issued one after the other, in column order, at the unit's place in the reduction
order, so every rank issues the same collectives. At stage 3 without a cast, where
every other unit borrows its staging from the gather cache, the two pool buffers the
pieces go through are allocated when an oversized unit's reduction starts and let go
when its last piece lands: the forward and the blocks' backward run without them.
Stages 0/1 without a cast reduce the full gradient in place and need no staging buffer
at all; the ring's receive scratch is bounded by C_B / N as well (see [Note: rings on
gloo] in ring.py).

[Note: sparse gradients]
An op such as ``nn.Embedding(sparse=True)`` gives autograd a sparse gradient (the rows
of the indices it read, repeated indices not yet summed). Stages 0/1 let autograd add it
into the dense ``param.grad`` view in place. Stages 2/3 make it dense in ``stage_grad``
before staging or holding it: the reduction partitions the flat parameter, so every
rank needs its chunk's rows whatever the indices. The dense copy is the parameter's
size and lives until it is staged (or, for an oversized unit, reduced), as a dense
gradient would; the bytes sent are the same as for a dense model.

[Note: stage 3 reduction]
At stage 3 the parameters are not leaves of the graph, so no hook fires per
parameter: the gather node of a unit (gather.py) hands over all of the unit's
gradients at once, when autograd is done with the unit, and the unit is launched
at once (``launch_now``). Autograd visits nodes in the same order on every rank (the
graphs are the same, since every rank gathered the same units in the same order),
so the collectives still match.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from . import comm
from .buffers import BufferPool, BufferSource, contiguous_slices
from .flat import FlatUnit, padded_size
from .launch_order import FirstUse, agreed, complete
from .stages import StagePolicy
from .state import StateCell, TrainingState
from .zeropp import NodeGroups, Scratch, quantized_reduce_scatter


@dataclass
class _Lease:
    """A staging buffer taken from the pool (``temporary``: an overflow) or borrowed."""

    buffer: torch.Tensor
    temporary: bool = False
    borrowed: bool = False


def late_gradient(name: str) -> RuntimeError:
    """A gradient that reached the engine after its unit's reduction: it would be lost."""
    return RuntimeError(
        f"{name}: a gradient arrived after its unit was reduced in this backward. A "
        "parameter used by more than one reentrant checkpointed call "
        "(torch.utils.checkpoint with use_reentrant=True) has its gradient accumulated in "
        "separate backward passes the engine cannot foresee; use use_reentrant=False, or "
        "the engine's activation_checkpointing, which counts them. So does a forward run "
        "again inside a custom autograd Function's backward (reversible layers, such as "
        "Reformer's): train such a model at stages 0-2"
    )


@dataclass
class _InFlight:
    pending: comm.Pending
    lease: _Lease | None
    finish: Callable[[], None]


class GradReducer:
    """Owns the resident gradients and reduces them across the data-parallel group."""

    def __init__(
        self,
        units: list[FlatUnit],
        policy: StagePolicy,
        grad_dtype: torch.dtype,
        comm_dtype: torch.dtype,
        communicator: comm.Communicator,
        state: StateCell,
        overlap: bool,
        param_hooks: bool = True,
        staging: BufferSource | None = None,
        bucket_elements: int | None = None,
        module: nn.Module | None = None,
        quantized: tuple[int, int] | None = None,
        node: NodeGroups | None = None,
        scratch: Scratch | None = None,
        after_unit_backward: Callable[[], None] | None = None,
        predivide: bool = False,
    ):
        self.units, self.policy, self.comm = units, policy, communicator
        self.divisor = communicator.world if predivide else 1
        """Each rank's gradient is divided by this before the sum: N_d with ``predivide``
        (the sum is then the mean; see [Note: fp16 gradients are averaged, not summed]),
        else 1 (the sum itself)."""
        self.after_unit_backward = after_unit_backward
        """Stages 0-2: called once backward has produced all of a unit's gradients (the
        engine hands freed heap pages back there: see [Note: host heap trimming])."""
        self.quantized = quantized
        """qgZ: (bits, block) of the quantized all-to-all that replaces the reduce-scatter
        (None: off); two hops over ``node`` when given. See [Note: ZeRO++ collectives]."""
        self.node = node
        self.scratch = scratch if scratch is not None else Scratch()
        self.state = state
        self.overlap = overlap
        device = units[0].flat.device
        self.full_grads: list[torch.Tensor] = []
        self._grad_dtype, self._device = grad_dtype, device
        self._shard_grads: list[torch.Tensor] | None = None
        """Stages 2/3: the gradient shards from the backward that makes them to the step
        that consumes them; None between steps. See [Note: gradient lifetime]."""
        # M_D: every unit's gradient is a slice of one buffer, so these long-lived tensors
        # never interleave with backward's temporaries.
        if policy.keep_full_grads:
            self.full_grads = contiguous_slices([u.padded_numel for u in units], grad_dtype, device)
            self._grad_views = [u.views_of(g) for u, g in zip(units, self.full_grads, strict=True)]
        self._cast = comm_dtype != grad_dtype
        self.external = staging
        largest = max(u.padded_numel for u in units)
        self.block_elements = (
            largest if bucket_elements is None else padded_size(bucket_elements, communicator.world)
        )
        """C_B: the size of every staging buffer; larger units go piecewise."""
        stages = (not policy.keep_full_grads) or self._cast
        self._piecewise = [stages and u.padded_numel > self.block_elements for u in units]
        need_pool = stages and (staging is None or any(self._piecewise))
        staging_numel = min(largest, self.block_elements) if need_pool else 0
        self.pool = BufferPool(2, staging_numel, comm_dtype, device)
        self._first_micro = True
        """The shard gradients hold nothing yet this step (copy, not add, into them)."""
        self._ready = [0] * len(units)
        """Per unit, its slots whose gradients are all in (see ``post_accumulate_grad``)."""
        self._fires: list[list[int]] = [[0] * len(u.slots) for u in units]
        self._expected_fires: dict[int, int] = {}
        self._filled: list[list[bool]] = [[False] * len(u.slots) for u in units]
        self._staged: dict[int, _Lease] = {}
        self._held: dict[int, list[torch.Tensor | None]] = {}
        """Oversized units at stages 2/3: their gradients, flat, until the unit launches."""
        self._launched = [False] * len(units)
        self.order = list(range(len(units)))
        """The launch order (unit indices). See [Note: reduction order]."""
        self._learning = param_hooks and communicator.world > 1
        self._first_use = FirstUse(module, units) if self._learning and module is not None else None
        self._finished: list[int] = []
        self._next_launch = 0
        """Position in ``order`` of the next unit to launch."""
        self._inflight: deque[_InFlight] = deque()
        self.stray: dict[str, None] = {}
        self.stray_mid_step: dict[str, None] = {}
        """Parameters another backward reached, in order (see ``_stray``)."""
        self._handles = (
            [
                slot.param.register_post_accumulate_grad_hook(self._hook(u, i))
                for u in units
                for i, slot in enumerate(u.slots)
            ]
            if param_hooks
            else []
        )

    @property
    def active(self) -> bool:
        """Inside engine.backward, and this backward reduces."""
        return self.state.value is TrainingState.REDUCING

    # -- what the optimizer reads -------------------------------------------------
    def grad_shards(self) -> list[torch.Tensor]:
        """Per unit, the reduced gradient slice this rank's optimizer consumes."""
        if self.policy.keep_full_grads:
            if self.policy.shard_world == 1:
                return self.full_grads
            return [u.shard_of(g) for u, g in zip(self.units, self.full_grads, strict=True)]
        if self._shard_grads is None:  # no backward reduced since the last step
            sizes = self._shard_sizes()
            self._shard_grads = contiguous_slices(sizes, self._grad_dtype, self._device)
        return self._shard_grads

    def zero_grads(self) -> None:
        """After a step (or a load): no gradient is held. Stages 0/1 zero their buffers
        in place (``param.grad`` views them); stages 2/3 drop their shards."""
        for g in self.full_grads:
            g.zero_()
        self._shard_grads = None
        self._first_micro = True

    def grad_bytes(self) -> int:
        """Bytes of the gradients this rank holds after a backward (the ledger's grads)."""
        if self.policy.keep_full_grads:
            return sum(g.numel() * g.element_size() for g in self.full_grads)
        return sum(self._shard_sizes()) * self._grad_dtype.itemsize

    def held_grad_bytes(self) -> int:
        """Bytes of gradient buffers allocated now: ``grad_bytes()`` at stages 0/1; at
        stages 2/3 the same from a backward's first reduction to the step, 0 between."""
        if self.policy.keep_full_grads or self._shard_grads is not None:
            return self.grad_bytes()
        return 0

    def _shard_sizes(self) -> list[int]:
        return [u.shard_numel for u in self.units]

    def _shards(self) -> list[torch.Tensor]:
        """The gradient shards, allocated at the first reduction after a step. Their pages
        are not touched here: each unit's become resident when its reduction lands."""
        if self._shard_grads is None:
            sizes = self._shard_sizes()
            flat = torch.empty(sum(sizes), dtype=self._grad_dtype, device=self._device)
            self._shard_grads = list(flat.split(sizes))
        return self._shard_grads

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._first_use is not None:
            self._first_use.close()

    # -- hook points ----------------------------------------------------------------
    def pre_backward(self, expected_fires: dict[int, int] | None = None) -> None:
        """Arm the hooks for one backward (the engine has set the state already).
        ``expected_fires``: per parameter id, how many times this backward accumulates
        its gradient when not once (see [Note: gradients of a shared parameter] in
        activations.py)."""
        if self._first_use is not None and self.active:
            self._first_use.close()
            proposal = complete(self._first_use.order[::-1], self.order)
            self._first_use = None
            if agreed(proposal, self.comm, self.units[0].flat.device):
                self.order = proposal
        self._ready = [0] * len(self.units)
        self._fires = [[0] * len(u.slots) for u in self.units]
        self._expected_fires = expected_fires or {}
        self._launched = [False] * len(self.units)
        self._next_launch = 0
        self._finished = []
        self._held.clear()
        if self.policy.keep_full_grads:
            for unit, views in zip(self.units, self._grad_views, strict=True):
                for slot, view in zip(unit.slots, views, strict=True):
                    if slot.param.grad is not view:
                        slot.param.grad = view

    def _hook(self, unit: FlatUnit, slot_index: int):
        def post_accumulate_grad(param: torch.Tensor) -> None:
            self.post_accumulate_grad(unit, slot_index, param)

        return post_accumulate_grad

    def post_accumulate_grad(self, unit: FlatUnit, slot_index: int, param: torch.Tensor) -> None:
        if not self.state.value.in_backward:
            self._stray(unit, slot_index, param)
            return
        if not self.active:
            return
        if self._launched[unit.index]:
            raise late_gradient(unit.slots[slot_index].names[0])
        if not self.policy.keep_full_grads:
            assert param.grad is not None
            self.stage_grad(unit, slot_index, param.grad)
            param.grad = None
        fires = self._fires[unit.index]
        fires[slot_index] += 1
        if fires[slot_index] == self._expected_fires.get(id(param), 1):
            self._ready[unit.index] += 1
        finished = self._ready[unit.index] == len(unit.slots)
        if finished:
            self._finished.append(unit.index)
        self._launch_ready()
        if not self.overlap:  # wait now: backward does not run beside a reduction
            while self._inflight:
                self._complete_oldest()
        if finished and self.after_unit_backward is not None:
            self.after_unit_backward()

    def _stray(self, unit: FlatUnit, slot_index: int, param: torch.Tensor) -> None:
        """A gradient from a backward that is not this engine's (see [Note: gradients
        from another backward] in engine.py). Stage 2 drops it at once; stages 0/1 have
        added it to the gradient buffer ``param.grad`` views. Either way the parameter
        is named: between steps, for the engine to zero that buffer; inside a step, for
        it to refuse the step."""
        if not self.policy.keep_full_grads:
            param.grad = None
        name = unit.slots[slot_index].names[0]
        if self.state.value is TrainingState.ACCUMULATED:
            self.stray_mid_step[name] = None
        elif self.policy.keep_full_grads:
            self.stray[name] = None

    def take_stray(self) -> tuple[list[str], list[str]]:
        """Parameters another backward reached since the last call: (between steps, at
        stages 0/1; inside a step), both then cleared."""
        if not (self.stray or self.stray_mid_step):
            return [], []  # the usual case, on every backward and step
        found = (list(self.stray), list(self.stray_mid_step))
        self.stray, self.stray_mid_step = {}, {}
        return found

    def stage_grad(self, unit: FlatUnit, slot_index: int, grad: torch.Tensor) -> None:
        """Copy one gradient into the unit's staging buffer (added if already staged).

        An oversized unit keeps a reference instead. See [Note: constant buffers] and
        [Note: sparse gradients]."""
        if grad.layout != torch.strided:
            grad = grad.to_dense()
        if self._piecewise[unit.index]:
            held = self._held.setdefault(unit.index, [None] * len(unit.slots))
            flat, before = grad.reshape(-1), held[slot_index]
            held[slot_index] = flat if before is None else before + flat
            return
        if unit.index not in self._staged:
            self._staged[unit.index] = self._acquire(unit)
        staging = self._staged[unit.index].buffer
        slot = unit.slots[slot_index]
        target = staging[slot.offset : slot.offset + slot.numel]
        if self._filled[unit.index][slot_index]:
            target.add_(grad.reshape(-1))
        else:
            target.copy_(grad.reshape(-1))
            self._filled[unit.index][slot_index] = True

    def launched(self, unit: FlatUnit) -> bool:
        """Whether this backward has launched the unit's reduction."""
        return self._launched[unit.index]

    def launch_now(self, unit: FlatUnit) -> None:
        """Stage 3: reduce a unit as soon as autograd is done with it.

        See [Note: stage 3 reduction]."""
        if self.active and not self._launched[unit.index]:
            self._launch(unit)

    def finalize_backward(self) -> None:
        """Launch what is left, in order (see [Note: reduction order]), and wait for all."""
        if not self.active:
            return
        for index in self.order:
            if not self._launched[index]:
                self._launch(self.units[index])
        self._next_launch = len(self.units)
        while self._inflight:
            self._complete_oldest()
        if self._learning:
            self._learning = False
            self._adopt_finish_order()
        if self.policy.reduce_every_micro_batch:
            self._first_micro = False

    # -- internals ------------------------------------------------------------------
    def _acquire(self, unit: FlatUnit) -> _Lease:
        if self.external is not None:
            self._bound_inflight()
            return _Lease(self.external.take(unit.padded_numel), borrowed=True)
        return self._acquire_pooled()

    def _bound_inflight(self) -> None:
        """Borrowed buffers come back only when their reduction completes: keep at most
        two reductions in flight, as the pool would, or a backward would hold every
        gradient."""
        while len(self._inflight) >= 2:
            self._complete_oldest()

    def _acquire_pooled(self) -> _Lease:
        if self.external is not None:
            self._bound_inflight()
        while True:
            buffer = self.pool.try_acquire()
            if buffer is not None:
                return _Lease(buffer)
            if not self._inflight:
                return _Lease(self.pool.acquire_temporary(), temporary=True)
            self._complete_oldest()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.units):
            unit = self.units[self.order[self._next_launch]]
            if self._ready[unit.index] < len(unit.slots):
                return
            self._launch(unit)
            self._next_launch += 1

    def _adopt_finish_order(self) -> None:
        """Launch units from now on in the order this backward finished them, if every
        rank saw the same order. See [Note: reduction order]."""
        observed = complete(self._finished, self.order)
        if agreed(observed, self.comm, self.units[0].flat.device):
            self.order = observed

    def _source(self, unit: FlatUnit) -> tuple[torch.Tensor, _Lease | None]:
        """The unit-sized tensor to reduce, and the staging buffer it occupies."""
        if not self.policy.keep_full_grads:
            if unit.index not in self._staged:
                self._staged[unit.index] = self._acquire(unit)
            lease = self._staged.pop(unit.index)
            staging = lease.buffer[: unit.padded_numel]
            filled = self._filled[unit.index]
            for slot, done in zip(unit.slots, filled, strict=True):
                if not done:
                    staging[slot.offset : slot.offset + slot.numel].zero_()
            staging[unit.numel :].zero_()
            self._filled[unit.index] = [False] * len(unit.slots)
            return staging, lease
        grads = self.full_grads[unit.index]
        if not self._cast:
            return grads, None
        lease = self._acquire(unit)
        staging = lease.buffer[: unit.padded_numel]
        staging.copy_(grads)
        return staging, lease

    def _target(self, unit: FlatUnit) -> torch.Tensor:
        """Where this rank's reduced gradient of ``unit`` goes."""
        if not self.policy.keep_full_grads:
            return self._shards()[unit.index]
        full = self.full_grads[unit.index]
        return full if self.policy.shard_world == 1 else unit.shard_of(full)

    def _launch(self, unit: FlatUnit) -> None:
        self._launched[unit.index] = True
        if self._piecewise[unit.index]:
            self._launch_pieces(unit)
            return
        source, lease = self._source(unit)
        self._issue(source, lease, self._target(unit))

    def _launch_pieces(self, unit: FlatUnit) -> None:
        """Reduce an oversized unit block by block. See [Note: constant buffers]."""
        n = self.policy.shard_world
        columns = unit.padded_numel // n
        width = self.block_elements // n
        target = self._target(unit)
        full = self.full_grads[unit.index].view(n, columns) if self.policy.keep_full_grads else None
        held = self._held.pop(unit.index, None)
        for c0 in range(0, columns, width):
            c1 = min(columns, c0 + width)
            lease = self._acquire_pooled()
            staging = lease.buffer[: n * (c1 - c0)]
            if full is not None:
                staging.view(n, c1 - c0).copy_(full[:, c0:c1])
            else:
                self._fill_block(unit, held, staging.view(n, c1 - c0), c0, c1)
            self._issue(staging, lease, target[c0:c1])

    @staticmethod
    def _fill_block(
        unit: FlatUnit,
        held: list[torch.Tensor | None] | None,
        block: torch.Tensor,
        c0: int,
        c1: int,
    ) -> None:
        """Columns [c0, c1) of the unit's (N, S) gradient view, zeros where none exists."""
        columns = unit.padded_numel // block.shape[0]
        for i, row in enumerate(block):
            lo, hi = i * columns + c0, i * columns + c1
            for s, slot in enumerate(unit.slots):
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if a >= b:
                    continue
                grad = held[s] if held is not None else None
                if grad is None:
                    row[a - lo : b - lo].zero_()
                else:
                    row[a - lo : b - lo].copy_(grad[a - slot.offset : b - slot.offset])
            if max(lo, unit.numel) < hi:
                row[max(lo, unit.numel) - lo :].zero_()

    def _issue(self, source: torch.Tensor, lease: _Lease | None, target: torch.Tensor) -> None:
        """Launch the reduction of ``source`` into ``target`` (added after the first micro)."""
        if self.divisor != 1:
            source.div_(self.divisor)
        if self.policy.shard_world == 1:
            pending = self.comm.all_reduce(source, "grads")
            reduced = source
        elif self.quantized is not None:
            bits, block = self.quantized
            pending = quantized_reduce_scatter(
                self.comm, source, bits, block, self.scratch, self.node
            )
            reduced = self.comm.chunk(source)
        else:
            # In place: the sum lands in this rank's chunk of the source.
            pending = self.comm.reduce_scatter(source, "grads")
            reduced = self.comm.chunk(source)
        accumulate = not self.policy.keep_full_grads and not self._first_micro

        def finish() -> None:
            if accumulate:
                target.add_(reduced)
            elif reduced.data_ptr() != target.data_ptr():
                target.copy_(reduced)

        self._inflight.append(_InFlight(pending, lease, finish))

    def _complete_oldest(self) -> None:
        item = self._inflight.popleft()
        item.pending.wait()
        item.finish()
        lease, item.lease = item.lease, None
        del item  # drops the views of the buffer it holds, so the buffer can be reused
        if lease is None:
            return
        if lease.borrowed:
            assert self.external is not None
            self.external.give(lease.buffer)
            return
        self.pool.release(lease.buffer, lease.temporary)
        if self.external is not None and self.pool.idle:
            self.pool.trim()  # stage 3: an oversized unit is done; see [Note: constant buffers]
