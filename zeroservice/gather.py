"""Stage 3: parameters exist whole only while a module uses them.

[Note: gather and release]
Every rank keeps only its shard of each unit. A group's forward (partition.py)
gathers its units into fresh buffers on entry and drops them on exit. What the
module sees as ``self.weight`` is served by a property on its class (param_access.py):
the view of the gathered buffer that a ``_GatherUnit`` autograd node produced for this
window.
The module's registered nn.Parameter stays in place as an empty placeholder (so
``parameters()``, dtype and device queries keep working) but holds no data.

Three things make this hold for arbitrary models:

* Saved tensors. Autograd keeps the weights it needs for backward. A saved-tensor
  hook replaces every tensor that aliases a gathered buffer by a reference (unit,
  offset, shape, stride) and, in backward, gathers the unit again and returns the
  same view of the new buffer (saved_tensors.py). So a buffer can be released after
  forward whatever the module did with its weights, and backward gathers exactly what
  it reads.
* Uses outside the owner's window. A property read of a released unit inside a
  forward (a tied weight read by another group, a block's weight read by its
  neighbour) gathers the unit on demand for the innermost open window.
* Gradients. The ``_GatherUnit`` node receives the gradients of all the unit's
  parameters once autograd is done with every use in its window; a unit used in k
  windows has k nodes, and its reduce-scatter is launched when the last fires
  (or, for a node that never fires, when backward ends). See [Note: stage 3
  reduction] in reduce.py.

Prefetching follows each pass's recorded order: see [Note: prefetch] in prefetch.py.
With ZeRO++ switched on, parameter gathers are quantized (qwZ) and backward gathers run
within the node from secondary shards (hpZ): see [Note: ZeRO++ collectives] in zeropp.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial, wraps

import torch
from torch import nn

from . import comm
from .buffers import BufferCache
from .flat import FlatUnit
from .gather_check import GatherCheck, GatherDigest
from .leaf_modules import LeafBackward
from .naming import some_names
from .param_access import ParamAccess
from .prefetch import PrefetchPlan
from .reduce import GradReducer, late_gradient
from .saved_tensors import SavedTensorRefs
from .state import Pass
from .zeropp import Scratch, Secondary, quantized_all_gather, shard_cuts


class _GatherUnit(torch.autograd.Function):
    """Forward: the views of a gathered unit. Backward: hand their gradients to the engine."""

    @staticmethod
    def forward(ctx, gatherer: ParamGatherer, index: int, anchor: torch.Tensor):
        ctx.gatherer, ctx.index = gatherer, index
        ctx.set_materialize_grads(False)
        return tuple(gatherer.views_of_live(index))

    @staticmethod
    def backward(ctx, *grads):
        ctx.gatherer.post_backward(ctx.index, grads)
        return None, None, None


@dataclass
class _Live:
    buffer: torch.Tensor
    pending: comm.Pending | None
    version: int = -1
    """The buffer's autograd version once gathered: an in-place write changes it."""


def _outside_inference_mode(method: Callable) -> Callable:
    """Run a forward hook of the gatherer outside ``torch.inference_mode``.

    [Note: inference mode]
    A forward under ``torch.inference_mode()`` (an evaluation between steps) makes every
    tensor it allocates an inference tensor, which has no version counter and can never
    enter a graph. The gatherer's buffers outlive that forward (the cache, the units
    that stay gathered), and it reads their versions: they failed there ("Inference
    tensors do not track version counter"), and kept, they would fail the next training
    forward. Its hooks therefore allocate and gather as normal tensors, with gradients
    still off; the model's own computation stays in inference mode."""

    @wraps(method)
    def run(*args, **kwargs):
        if not torch.is_inference_mode_enabled():
            return method(*args, **kwargs)
        with torch.inference_mode(False):
            return method(*args, **kwargs)

    return run


class ParamGatherer:
    """Gathers, serves and releases partitioned units. See [Note: gather and release]."""

    def __init__(
        self,
        root: nn.Module,
        groups: Sequence[tuple[nn.Module, list[int]]],
        units: list[FlatUnit],
        communicator: comm.Communicator,
        reducer: GradReducer,
        cache: BufferCache,
        prefetch_elements: int,
        persistence_elements: int,
        persistent_total: int | None = None,
        check: GatherCheck | None = None,
        digest: GatherDigest | None = None,
        quantize_block: int | None = None,
        secondary: Secondary | None = None,
        scratch: Scratch | None = None,
        after_unit_backward: Callable[[], None] | None = None,
        leaves: Sequence[tuple[nn.Module, list[int]]] = (),
    ):
        self.root, self.units, self.comm, self.reducer = root, units, communicator, reducer
        self.quantize_block = quantize_block
        """qwZ: parameter gathers travel as int8 blocks of this size (None: off)."""
        self._cuts: dict[int, list[list[int]]] = {}
        """qwZ: per unit, where each rank's shard is cut (zeropp.shard_cuts)."""
        self.secondary = secondary
        """hpZ: secondary shards kept by forward gathers for backward (None: off)."""
        self.scratch = scratch if scratch is not None else Scratch()
        self.after_unit_backward = after_unit_backward
        """Called once a unit's backward is done and its reduction launched (the engine
        hands freed heap pages back there: see [Note: host heap trimming])."""
        self.check = check
        """Debug consensus on every gather (see gather_check.py), or None."""
        self.digest = digest
        """Running hash of the units this rank issued, checked once per step (see
        gather_check.py), or None."""
        self._in_place_write: str | None = None
        self.copies_out = False
        """Inside ``engine.gathered_parameters()``: the placeholders hold gathered copies,
        and a forward is refused (see [Note: gathered parameters] in gathered.py)."""
        """What ``_check_unmodified`` last found (see ``take_in_place_write``)."""
        self.prefetch_elements = prefetch_elements
        self.dtype = units[0].flat.dtype
        self.element_size = units[0].flat.element_size()
        self.persistent = _persistent_units(units, persistence_elements, persistent_total)
        self.cache = cache
        self._anchor = torch.empty(0, requires_grad=True)
        self._live: dict[int, _Live] = {}
        self._by_storage: dict[int, int] = {}
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}
        self._windows: list[list[int]] = []
        self._expected = [0] * len(units)
        self._fired = [0] * len(units)
        self.plan = PrefetchPlan()
        self.saved = SavedTensorRefs(self)
        """The saved-tensor hooks a forward under this gatherer runs with."""
        self.checkpointed: set[int] = set()
        """ids of modules whose forward runs without a graph and is recomputed in backward
        (activations.py): their first forward builds no gather nodes."""
        self._recomputing = 0
        self._prepaid = [0] * len(units)
        """Per unit, gather nodes a checkpointed block's recomputation will build that
        ``_expected`` already counts (see ``post_forward``)."""
        self._runs: list[set[int] | None] = []
        """Per open window, the units a checkpointed block's first forward (no graph)
        used, or None for any other window."""
        self._run: set[int] | None = None
        """The innermost checkpointed first forward's set, if one is running."""
        self.live_elements = 0
        self.peak_live_elements = 0
        self.forward_reads: set[int] = set()
        """Units whose weights a module read since the root's forward began (compared
        across ranks after it: see ``ForwardReads`` in gather_check.py)."""
        self.on_demand_gathers = 0
        """Gathers issued when a unit was needed (the first of a pass, or off-plan)."""
        self.prefetched_gathers = 0
        """Gathers issued ahead of use, following the recorded order."""
        self._access = ParamAccess(root, units, self)
        self.groups = [indices for _, indices in groups]
        """Per group module, the indices of the units its forward gathers."""
        self._group_modules = [module for module, _ in groups]
        self._handles = []
        self.leaves = LeafBackward([indices for _, indices in leaves])
        """Leaf modules' units, gathered and reduced together in backward (see [Note:
        leaf modules] in leaf_modules.py)."""
        for k, (module, _) in enumerate(leaves):  # before the groups': see the Note
            self._handles.append(
                module.register_forward_pre_hook(partial(self._leaf_called, k), with_kwargs=True)
            )
        for module, indices in groups:
            is_root = module is root
            self._handles.append(
                module.register_forward_pre_hook(partial(self.pre_forward, indices, is_root))
            )
            self._handles.append(
                module.register_forward_hook(partial(self.post_forward, is_root), always_call=True)
            )
        self._entered: list[bool | None] = []
        """Per entry point's forward running, whether it opened a window: None, none (one
        was open); True, the root's as a forward; False, one inside a backward (see
        [Note: a sub-module called directly])."""
        root_indices = next(indices for module, indices in groups if module is root)
        for entry in _entry_points(root, [m for m, _ in groups]):
            self._handles.append(
                entry.register_forward_pre_hook(partial(self._enter, root_indices), prepend=True)
            )
            self._handles.append(entry.register_forward_hook(self._leave, always_call=True))
        comm.wait_all([self._issue(i) for i in sorted(self.persistent)])

    def checkpoint_blocks(self, blocks: list[nn.Module]) -> None:
        """Modules whose forward runs without a graph and is recomputed in backward
        (activations.py). A block that is not a group of its own (its weights belong to
        a group never called itself, a ModuleList that ``stage3_grouping="size"`` made
        one group) still opens a window with no units: its weights are read on demand
        into it, its first forward counts the gather nodes its recomputation will build
        (``_close_run``), and its recomputation, in backward, has a window to read them
        into. Without one, those reads in backward found no window open and returned
        the empty placeholders, and a unit that several such blocks read was reduced
        after the first block's backward."""
        groups = {id(module) for module in self._group_modules}
        for block in blocks:
            self.checkpointed.add(id(block))
            if id(block) in groups:
                continue
            self._handles.append(
                block.register_forward_pre_hook(partial(self.pre_forward, [], False))
            )
            self._handles.append(
                block.register_forward_hook(
                    partial(self.post_forward, False), always_call=True, prepend=True
                )  # before an entry point's own: windows close in the order they opened
            )

    # -- what modules see ---------------------------------------------------------
    @_outside_inference_mode
    def param(self, module: nn.Module, name: str) -> torch.Tensor:
        """The value of ``module.<name>``: the gathered view, gathered on demand in forward."""
        index, slot = self._access.slots[(id(module), name)]
        views = self._views.get(index)
        if views is None:
            if not self._windows:
                placeholder = module._parameters[name]  # outside forward: empty
                assert placeholder is not None
                return placeholder
            self._use(index, self._windows[-1])
            views = self._views[index]
        if self._run is not None:
            self._run.add(index)
        self.forward_reads.add(index)
        return views[slot]

    def in_forward(self) -> bool:
        """A forward (or its recomputation) is running: a parameter read gathers."""
        return bool(self._windows)

    def views_of_live(self, index: int) -> list[torch.Tensor]:
        return self.units[index].views_of(self._buffer(index))

    # -- forward windows ------------------------------------------------------------
    @_outside_inference_mode
    def pre_forward(self, indices: list[int], is_root: bool, module, args) -> None:
        """A group's forward begins: gather its units into a new window."""
        if self.copies_out and not self._windows:
            raise RuntimeError(
                "forward: inside engine.gathered_parameters() at stage 3 the parameters hold "
                "gathered copies that a forward's own gathers would release; run the forward "
                "outside the context"
            )
        if is_root and not self._windows:
            self.plan.begin(Pass.FORWARD)
            self.forward_reads.clear()
            if self.secondary is not None:
                self.secondary.clear()  # the weights changed since they were kept
        window: list[int] = []
        self._windows.append(window)
        checkpointed = self._first_of_checkpointed(module, args)
        if checkpointed:
            self._run = set()
        self._runs.append(self._run if checkpointed else None)
        graph = torch.is_grad_enabled() and not checkpointed
        for index in indices:
            if index not in self._views:
                self._use(index, window, graph)
            if self._run is not None:
                self._run.add(index)

    def _first_of_checkpointed(self, module: nn.Module, args) -> bool:
        """The same test as ActivationCheckpointer._forward: a checkpointed block's first
        forward (a tensor input, a graph recorded outside) builds no gather nodes."""
        return (
            torch.is_grad_enabled()
            and self._recomputing == 0
            and id(module) in self.checkpointed
            and bool(args)
            and isinstance(args[0], torch.Tensor)
        )

    @_outside_inference_mode
    def _leaf_called(self, leaf: int, module, args, kwargs):
        """A leaf module's forward begins: one that builds a graph waits for its inputs'
        gradients to launch the leaf's reductions (see [Note: leaf modules])."""
        if torch.is_grad_enabled() and not self._first_of_checkpointed(module, args):
            return self.leaves.called(leaf, args, kwargs, self._leaf_backward_done)
        return None

    def _leaf_backward_done(self, leaf: int) -> None:
        """Autograd computed a leaf's input gradients: release its units and launch their
        reductions in index order, zeros where this rank had no gradient."""
        if not self.reducer.active:
            return
        for index in self.leaves.units_of[leaf]:
            self._release(index)
            unit = self.units[index]
            if not unit.frozen:
                self.reducer.launch_now(unit)
        if self.after_unit_backward is not None:
            self.after_unit_backward()

    @_outside_inference_mode
    def _enter(self, root_indices: list[int], module, args) -> None:
        """An entry point's forward begins: called directly (no window open, not a
        recomputation), it opens the root's window, as the root's own forward would.

        [Note: a sub-module called directly]
        A parameter is read through the open windows; with none open it is the empty
        placeholder. The root's window holds the units no single group owns: a weight
        tied across modules (an embedding shared by an encoder, a decoder and the head).
        Called through the root everything is gathered; a sub-module called on its own
        read empty placeholders and failed inside torch ("'weight' must be 2-D", "size
        mismatch ... vec (0)"): T5's ``generate`` runs ``model.encoder(...)`` first, a
        user embeds with ``model.get_input_embeddings()(ids)`` (a tied embedding, in the
        root's window) or calls ``model.layers[0].mlp(x)`` (inside a block's group), and
        a reversible layer (Reformer) runs its feed-forward again inside its own
        autograd backward. So every module below the root that has parameters and is
        not a group is an entry point: entered with no window open, it opens the root's
        window and its reads gather the rest on demand, as they do in a forward. Inside
        a backward that window is an inner one: it releases what it gathered and leaves
        the pass's plan and its other units alone."""
        if self._windows or self._recomputing or self.copies_out:
            self._entered.append(None)  # inside gathered_parameters() it reads the copies
            return
        as_forward = not self.reducer.state.value.in_backward
        self._entered.append(as_forward)
        self.pre_forward(root_indices, as_forward, module, args)

    @_outside_inference_mode
    def _leave(self, module, args, output) -> None:
        opened = self._entered.pop()
        if opened is not None:
            self.post_forward(opened, module, args, output)

    @contextlib.contextmanager
    def recomputing(self):
        """A checkpointed block's forward run again inside backward (activations.py)."""
        self._recomputing += 1
        try:
            yield
        finally:
            self._recomputing -= 1

    @_outside_inference_mode
    def post_forward(self, is_root: bool, module, args, output) -> None:
        """A group's forward ends: release its window (the root's: everything)."""
        for index in self._windows.pop():
            self._views.pop(index, None)
            self._release(index)
        if self._runs.pop() is not None:
            self._close_run()
        self._drop_idle_after_last_gather()
        if is_root and not self._windows:
            self._views.clear()
            self._release_all()
            self.cache.clear()  # idle buffers would sit beside the activations' peak
            self.plan.end(Pass.FORWARD)
            for index in self.persistent:
                self._check_unmodified(index, self._live[index])

    def _close_run(self) -> None:
        """A checkpointed block's first forward ended: each unit it used gets one gather
        node in the block's recomputation, counted now, so that no earlier node counts
        as the unit's last (see [Note: gradients of a shared parameter] in
        activations.py)."""
        run = self._run
        assert run is not None
        for index in run:
            if not self.units[index].frozen:
                self._expected[index] += 1
                self._prepaid[index] += 1
        self._run = next((r for r in reversed(self._runs) if r is not None), None)

    def _use(self, index: int, window: list[int], graph: bool | None = None) -> None:
        self._request(
            index, Pass.BACKWARD if self.reducer.state.value.in_backward else Pass.FORWARD
        )
        if graph is None:
            graph = torch.is_grad_enabled()
        if graph and not self.units[index].frozen:  # a frozen unit has no gradient node
            if self._recomputing and self._prepaid[index]:
                self._prepaid[index] -= 1
            else:
                self._expected[index] += 1
            self._views[index] = _GatherUnit.apply(self, index, self._anchor)
        else:
            self._views[index] = tuple(self.views_of_live(index))
        window.append(index)

    # -- backward -------------------------------------------------------------------
    def unit_of_storage(self, data_ptr: int) -> int | None:
        """The live unit whose buffer has this storage (saved_tensors.py)."""
        return self._by_storage.get(data_ptr)

    def buffer_for_backward(self, index: int, first_use: bool) -> torch.Tensor:
        """A unit's buffer for a saved reference: gathered again if released, and each
        unit's first read in a backward counts as a request of the backward pass."""
        leaf_units = self.leaves.first_touch(index)
        if leaf_units:
            for i in leaf_units:  # every rank gathers all of them (see [Note: leaf modules])
                self._request(i, Pass.BACKWARD)
        elif index not in self._live or (first_use and leaf_units is None):
            self._request(index, Pass.BACKWARD)
        return self._buffer(index)

    def begin_backward(self) -> None:
        self.saved.begin_backward()
        self.plan.begin(Pass.BACKWARD)

    def post_backward(self, index: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Autograd is done with one use of a unit (its ``_GatherUnit`` node fired): stage
        its gradients; after the last use, release it and launch its reduction."""
        if not self.reducer.active:
            names = some_names([s.names[0] for s in self.units[index].slots])
            raise RuntimeError(
                f"stage 3: a backward that was not this engine's reached [{names}]: "
                "loss.backward() instead of engine.backward(loss), or another engine's "
                "loss through this model (a GAN's generator loss through its "
                "discriminator). Stage 3 gathers weights only for its own backward: call "
                "engine.backward(loss), and train a model that another engine's loss "
                "passes through at stage 0-2, which drops such gradients between steps"
            )
        unit = self.units[index]
        if self.reducer.launched(unit):
            raise late_gradient(unit.slots[0].names[0])
        self._fired[index] += 1
        last = self._fired[index] >= self._expected[index]
        if last:
            # Released first, so the staging buffer below reuses its memory.
            self._release(index)
        for slot, grad in enumerate(grads):
            if grad is not None:
                self.reducer.stage_grad(unit, slot, grad)
        if last and not self.leaves.holds(index):
            self.reducer.launch_now(unit)
            if self.after_unit_backward is not None:
                self.after_unit_backward()

    def end_backward(self) -> None:
        """After the reducer finished: drop what backward gathered, reset the node counts."""
        self._release_all()
        self.cache.clear()
        if self.secondary is not None:
            self.secondary.clear()
        self.forget_forward()
        self.plan.end(Pass.BACKWARD)

    def forget_forward(self) -> None:
        """A forward's graph is dropped before its backward: no node it built is awaited."""
        self.leaves.reset()
        self._expected = [0] * len(self.units)
        self._fired = [0] * len(self.units)
        self._prepaid = [0] * len(self.units)

    def take_outside_uses(self) -> list[str]:
        """Names of the placeholders a backward reached (their ``.grad`` is cleared):
        a loss term built from a weight read outside every forward, where it is the
        empty placeholder, so the term contributed nothing to the real weight."""
        names = []
        for unit in self.units:
            for slot in unit.slots:
                if slot.param.grad is not None:
                    slot.param.grad = None
                    names.append(slot.names[0])
        return names

    # -- after the optimizer step -----------------------------------------------------
    def refresh_persistent(self) -> list[comm.Pending]:
        """Persistent units are gathered again from the updated shards."""
        pending = []
        for index in sorted(self.persistent):
            live = self._live[index]
            live.pending = self._gather_into(index, live.buffer)
            pending.append(live.pending)
        return pending

    def gather_copy(self, index: int) -> torch.Tensor:
        """A fresh whole copy of one unit (for state dicts), not tracked as live."""
        unit = self.units[index]
        buffer = torch.empty(unit.padded_numel, dtype=self.dtype, device=unit.flat.device)
        self._gather_into(index, buffer, tag="state").wait()
        return buffer

    # -- gathering ------------------------------------------------------------------
    def _gather_into(
        self, index: int, buffer: torch.Tensor, tag: str = "params", phase: Pass | None = None
    ) -> comm.Pending:
        if self.check is not None:
            self.check.agree(index)
        hpz = self.secondary
        if hpz is not None and phase is Pass.BACKWARD and index in hpz.shards:
            return hpz.gather(index, buffer)
        if self.quantize_block is not None and tag == "params":
            unit = self.units[index]
            if index not in self._cuts:
                self._cuts[index] = shard_cuts(unit)
            pending = quantized_all_gather(
                self.comm, unit.flat, buffer, self.quantize_block, self.scratch, self._cuts[index]
            )
        else:
            self.comm.chunk(buffer).copy_(self.units[index].flat)
            pending = self.comm.all_gather(buffer, tag)
        if hpz is not None and phase is Pass.FORWARD and torch.is_grad_enabled():
            pending.then(partial(hpz.keep, index, buffer))
        return pending

    def _issue(self, index: int, phase: Pass | None = None) -> comm.Pending:
        unit = self.units[index]
        buffer = self.cache.take(unit.padded_numel)
        if self.digest is not None:
            self.digest.add(index)
        pending = self._gather_into(index, buffer, phase=phase)
        self._live[index] = _Live(buffer, pending)
        self._by_storage[buffer.untyped_storage().data_ptr()] = index
        self.live_elements += unit.padded_numel
        self.peak_live_elements = max(self.peak_live_elements, self.live_elements)
        return pending

    def _buffer(self, index: int) -> torch.Tensor:
        live = self._live[index]
        if live.pending is not None:
            live.pending.wait()
            live.pending = None
            live.version = live.buffer._version
        return live.buffer

    def _request(self, index: int, phase: Pass) -> None:
        """Make sure ``index`` is gathered (or on its way), following and recording the plan."""
        if index in self.persistent:
            return
        following = self.plan.record(index, phase)
        if index not in self._live:
            self._issue(index, phase)
            self.on_demand_gathers += 1
        if following:
            self._prefetch(phase)
        self._drop_idle_after_last_gather()

    def _drop_idle_after_last_gather(self) -> None:
        """Once the forward has issued its last gather (as its plan says), no buffer
        that is idle now would be taken again before the backward: it would only sit
        beside the head's product and the loss, where the forward peaks."""
        if self.reducer.state.value.in_backward:
            return
        remaining = self.plan.remaining(Pass.FORWARD)
        if remaining is not None and all(
            i in self._live or i in self.persistent for i in remaining
        ):
            self.cache.clear()

    def _prefetch(self, phase: Pass) -> None:
        """Gather the plan's next units while they fit the budget (see prefetch.py)."""
        for index in self.plan.upcoming(phase):
            if index in self._live or index in self.persistent:
                continue
            if self.live_elements + self.units[index].padded_numel > self.prefetch_elements:
                return
            self._issue(index, phase)
            self.prefetched_gathers += 1

    def _release(self, index: int) -> None:
        if index in self.persistent or index not in self._live:
            return
        self._buffer(index)  # an in-flight gather completes before its buffer is dropped
        live = self._live.pop(index)
        del self._by_storage[live.buffer.untyped_storage().data_ptr()]
        self.live_elements -= self.units[index].padded_numel
        self._check_unmodified(index, live)
        self.cache.give(live.buffer)

    def _check_unmodified(self, index: int, live: _Live) -> None:
        if live.pending is None and live.buffer._version != live.version:
            names = ", ".join(s.names[0] for s in self.units[index].slots)
            self._in_place_write = (
                f"stage 3: a parameter among [{names}] was modified in place while gathered; "
                "the change would be lost, since only shards persist. Change parameters "
                "through the optimizer, or outside training with stage 0-2"
            )
            raise RuntimeError(self._in_place_write)

    def take_in_place_write(self) -> str | None:
        """The last in-place write to a gathered unit found, once: when the write made
        autograd fail first, torch silences the release hook's error, and the engine
        raises this instead."""
        found, self._in_place_write = self._in_place_write, None
        return found

    def _release_all(self) -> None:
        for index in list(self._live):
            self._release(index)

    # -- ledger and teardown ----------------------------------------------------------
    @property
    def live_bytes(self) -> int:
        return self.live_elements * self.element_size

    @property
    def cached_bytes(self) -> int:
        """Released buffers kept for reuse (see BufferCache)."""
        return self.cache.idle_elements * self.element_size

    @property
    def largest_cached_bytes(self) -> int:
        """The largest released buffer kept for reuse (0 between passes)."""
        return self.cache.largest_idle * self.element_size

    @property
    def peak_live_bytes(self) -> int:
        return self.peak_live_elements * self.element_size

    def reset_peak(self) -> None:
        """Restart the peak from what is gathered now."""
        self.peak_live_elements = self.live_elements

    def reset_counters(self) -> None:
        """Restart the peak and the gather counts (e.g. at the start of a step)."""
        self.reset_peak()
        self.on_demand_gathers = self.prefetched_gathers = 0

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._access.restore()
        self._views.clear()
        self._release_all()
        self.cache.clear()


def _persistent_units(units: list[FlatUnit], largest: int, total: int | None) -> set[int]:
    """Units of at most ``largest`` elements that stay gathered between steps, smallest
    first while together within ``total`` (see [Note: stage order] in units.py)."""
    small = sorted((u for u in units if u.padded_numel <= largest), key=lambda u: u.padded_numel)
    chosen: set[int] = set()
    held = 0
    for unit in small:
        if total is not None and held + unit.padded_numel > total:
            break
        chosen.add(unit.index)
        held += unit.padded_numel
    return chosen


def _entry_points(root: nn.Module, groups: list[nn.Module]) -> list[nn.Module]:
    """Modules below the root with parameters that are not groups (see [Note: a
    sub-module called directly])."""
    group_ids = {id(g) for g in groups}
    return [
        module
        for module in root.modules()
        if module is not root
        and id(module) not in group_ids
        and next(module.parameters(), None) is not None
    ]
