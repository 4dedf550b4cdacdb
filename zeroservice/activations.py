"""Activation checkpointing per block: partitioned across MP ranks (P_a), optionally
on the host (P_a+cpu), stored in one contiguous arena (M_D).

[Note: checkpointed blocks]
A checkpointed block runs its forward without building a graph and keeps only its
input; backward runs the forward again from that input (same RNG state, so dropout
draws the same mask) and back-propagates through the recomputed graph. Activation
memory drops from every block's intermediate tensors to one input per block plus
one block's intermediates during recomputation.

With tensor parallelism the block input is replicated on every MP rank. P_a keeps
only this rank's 1/mp slice of it (flattened, padded to a multiple of mp) and
all-gathers it over the MP group right before the recomputation: the bytes held
per rank are exactly 1/mp of the whole input when mp divides its size. With CPU
offload the slice moves to host memory (pinned on CUDA, copied asynchronously) and
back before the gather.

[Note: contiguous checkpoints]
The checkpoints of one forward are long-lived (until their block's backward) while
everything around them is short-lived; allocated one by one they interleave with
temporaries and fragment the allocator (ZeRO-R's M_D). They are therefore copied
into one pre-allocated arena, sized at the first forward for every checkpointed
block, and the arena is reused by every later step. A checkpoint that does not fit
(a longer sequence than the first forward's) gets its own allocation and is
counted in ``overflows``; the arena grows to fit at the next step.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _global_forward_hooks
from torch.nn.utils.parametrize import ParametrizationList

from .buffers import Arena
from .config import ConfigError
from .naming import some_names
from .recompute_buffers import BufferWrites, as_before
from .tensor_parallel import MPGroup


@dataclass
class _Held:
    """What one checkpoint counts in its store, until it is given back."""

    bytes: int
    on_host: bool
    freed: bool = False


@dataclass
class _Saved:
    piece: torch.Tensor
    """What is held: the whole input or this rank's slice, on the device or the host;
    once given back, a private copy of the whole input (see [Note: backwards that are
    not the engine's])."""
    shape: torch.Size
    numel: int
    device: torch.device
    held: _Held


class CheckpointStore:
    """Holds the checkpointed block inputs. See [Note: checkpointed blocks]."""

    def __init__(
        self,
        mp: MPGroup | None,
        partition: bool,
        offload: bool,
        contiguous: bool,
        blocks: int,
    ):
        self.mp = mp if partition and mp is not None and mp.size > 1 else None
        self.offload, self.contiguous, self.blocks = offload, contiguous, blocks
        self.arena = Arena(blocks)
        """M_D: one buffer for a forward's checkpoints (see buffers.Arena)."""
        self._in_arena: dict[int, weakref.ref[_Saved]] = {}
        """Checkpoints held in the arena, by id of their ``_Held``."""
        self.moved_out = 0
        """Checkpoints moved out of the arena after an engine backward left them."""
        self.device_bytes = 0
        self.host_bytes = 0
        self.peak_bytes = 0
        self.saved = 0

    # -- storage ----------------------------------------------------------------------
    def _home(self, like: torch.Tensor) -> torch.device:
        return torch.device("cpu") if self.offload else like.device

    def _slot(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        home = self._home(like)
        pin = self.offload and like.is_cuda
        if not self.contiguous:
            return torch.empty(numel, dtype=like.dtype, device=home, pin_memory=pin)
        if not self._in_arena:  # nothing held: a new forward starts at the arena's start
            self.arena.rewind()
        return self.arena.take(numel, like.dtype, home, pin)

    def save(self, x: torch.Tensor) -> _Saved:
        flat = x.detach().reshape(-1)
        numel = flat.numel()
        if self.mp is not None:
            size = -(-numel // self.mp.size)
            start = self.mp.rank * size
            own = flat[start : start + size]
            piece = self._slot(size, x)
            piece[: own.numel()].copy_(own, non_blocking=True)
            piece[own.numel() :].zero_()
        else:
            piece = self._slot(numel, x)
            piece.copy_(flat, non_blocking=True)
        held = _Held(
            piece.numel() * piece.element_size(), self.offload and piece.device.type == "cpu"
        )
        self.saved += 1
        if held.on_host:
            self.host_bytes += held.bytes
        else:
            self.device_bytes += held.bytes
        self.peak_bytes = max(self.peak_bytes, self.device_bytes + self.host_bytes)
        saved = _Saved(piece, x.shape, numel, x.device, held)
        if self.arena.holds(piece):
            self._in_arena[id(held)] = weakref.ref(saved)
        # A graph dropped without a backward (a forward whose loss was never
        # back-propagated) gives its checkpoints back when it is freed: else the arena
        # would never start again from its beginning.
        weakref.finalize(saved, self._give_back, held).atexit = False
        return saved

    def load(self, saved: _Saved) -> torch.Tensor:
        """The whole input again, on its device (gathered over MP with P_a)."""
        if saved.held.freed:
            return saved.piece.clone().view(saved.shape)
        piece = saved.piece.to(saved.device, non_blocking=True)
        if self.mp is not None:
            piece = self.mp.all_gather_flat(piece)[: saved.numel]
        elif piece.data_ptr() == saved.piece.data_ptr():
            piece = piece.clone()  # the arena slot is reused by the next step's forward
        return piece.view(saved.shape)

    def free(self, saved: _Saved, keep: torch.Tensor | None = None) -> None:
        """Give the checkpoint's storage back (once). ``keep``, the whole input as
        loaded, stays with ``saved`` for a graph that may be back-propagated again."""
        if keep is not None:
            saved.piece = keep.detach().reshape(-1)
        self._give_back(saved.held)

    def _give_back(self, held: _Held) -> None:
        if held.freed:
            return
        held.freed = True
        self._in_arena.pop(id(held), None)
        if held.on_host:
            self.host_bytes -= held.bytes
        else:
            self.device_bytes -= held.bytes

    def end_backward(self) -> None:
        """The engine's backward is done. A checkpoint still in the arena belongs to a
        graph it did not traverse (a forward whose loss is kept, not back-propagated):
        it moves to storage of its own, so that the next forward starts the arena again
        and never writes over what that graph may still read; the arena is not sized
        for it."""
        for ref in list(self._in_arena.values()):
            saved = ref()
            if saved is not None:
                self.arena.forget(saved.piece.numel())
                saved.piece = saved.piece.clone()
                self.moved_out += 1
        self._in_arena.clear()

    @property
    def arena_bytes(self) -> int:
        return self.arena.bytes

    @property
    def overflows(self) -> int:
        """Checkpoints that did not fit the arena (held in tensors of their own)."""
        return self.arena.overflows

    @property
    def arena_allocations(self) -> int:
        return self.arena.allocations

    def reset_peak(self) -> None:
        self.peak_bytes = self.device_bytes + self.host_bytes


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _replay_rng(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device):
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


@dataclass(frozen=True)
class _Autocast:
    """torch.autocast as a checkpointed forward ran under it, per device type."""

    states: tuple[tuple[str, bool, torch.dtype], ...]
    cache: bool

    @staticmethod
    def now(device: torch.device) -> _Autocast:
        types = ["cpu"] if device.type == "cpu" else [device.type, "cpu"]
        return _Autocast(
            tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types),
            torch.is_autocast_cache_enabled(),
        )

    @contextlib.contextmanager
    def again(self):
        """The recomputation computes in the dtypes the forward did: backward runs
        outside the caller's autocast, and a block recomputed in float32 from a bf16
        input would fail or give other gradients."""
        with contextlib.ExitStack() as stack:
            for device_type, enabled, dtype in self.states:
                stack.enter_context(
                    torch.autocast(
                        device_type, dtype=dtype, enabled=enabled, cache_enabled=self.cache
                    )
                )
            yield


class _Checkpoint(torch.autograd.Function):
    """Forward without a graph keeping only the input; backward recomputes.

    [Note: backwards that are not the engine's]
    In the engine's own backward the recomputed block back-propagates in a backward of
    its own, which accumulates every parameter's gradient (the reentrant scheme). Any
    other backward through the block asks for less: ``torch.autograd.grad(loss, x)``
    (an adversarial example, a saliency map) wants the input's gradient and must leave
    the parameters' ``.grad`` alone, and another engine's loss through this model (a
    GAN's generator) wants only the input's too. There the recomputed block gives the
    input's gradient alone, with ``torch.autograd.grad``, so no parameter sees a
    gradient that the engine would have to tell from its step's own.

    Such a backward may retain the graph (``retain_graph=True``, then the same loss in
    the engine's backward: clean and adversarial losses together). Its checkpoint then
    leaves the arena, which the next forward reuses, for a private copy held by the
    graph's node, and the later backward recomputes from that copy.

    A backward with ``create_graph=True`` (a gradient penalty, a Hessian-vector product)
    would differentiate the recomputation a second time. The recomputation starts from
    a detached copy of the input, so the second derivative through everything before
    the block would be lost without a word: it is refused, naming the block."""

    @staticmethod
    def forward(
        ctx,
        checkpointer: ActivationCheckpointer,
        name: str,
        module: nn.Module,
        run: Callable,
        rerun: Callable,
        x: torch.Tensor,
        anchor,
    ):
        ctx.checkpointer, ctx.name, ctx.module, ctx.rerun = checkpointer, name, module, rerun
        ctx.saved = checkpointer.store.save(x)
        ctx.rng = _rng_state(x.device)
        ctx.autocast = _Autocast.now(x.device)
        ctx.requires_input_grad = x.requires_grad
        before = checkpointer.buffer_writes.before(module)
        with torch.no_grad():
            out = run(x)
        ctx.buffers = checkpointer.buffer_writes.after(module, before)
        return out

    @staticmethod
    def backward(ctx, *grads):
        ck: ActivationCheckpointer = ctx.checkpointer
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"activation checkpointing: a backward with create_graph=True reached "
                f"checkpointed block {ctx.name or 'of the model'} (a gradient penalty or a "
                "second derivative through the model); the block is recomputed from a "
                "detached copy of its input, so its second derivative would be wrong. "
                "Turn activation_checkpointing off for this model"
            )
        own = ck.own_backward()
        x = ck.store.load(ctx.saved).detach().requires_grad_(ctx.requires_input_grad)
        ck.store.free(ctx.saved, keep=None if own else x)
        # The recomputation and its backward see the buffers as the first forward did
        # (see [Note: buffers of a recomputed block] in recompute_buffers.py).
        with as_before(ctx.module, ctx.buffers):
            rng = _replay_rng(ctx.rng, x.device)
            with rng, torch.enable_grad(), ck.replaying(), ctx.autocast.again():
                out = ctx.rerun(x)
            outs = out if isinstance(out, tuple) else (out,)
            pairs = [
                (o, g)
                for o, g in zip(outs, grads, strict=True)
                if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
            ]
            none = (None, None, None, None, None)
            if own:
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                return *none, x.grad if ctx.requires_input_grad else None, None
            if not (pairs and ctx.requires_input_grad):
                return *none, None, None
            (gx,) = torch.autograd.grad(
                [o for o, _ in pairs], [x], [g for _, g in pairs], allow_unused=True
            )
            return *none, gx, None


class ActivationCheckpointer:
    """Checkpoints the forward of the given modules. See [Note: checkpointed blocks].

    Each module's ``forward`` is replaced (on the instance) by one that runs it
    through ``_Checkpoint`` when autograd records; its first positional argument is
    the checkpointed input, other arguments are passed through unchanged (tensors
    among them must not need gradients).

    [Note: gradients of a shared parameter]
    Each recomputation back-propagates in a backward of its own, so a parameter used
    by two checkpointed calls (a block called twice, a weight tied across blocks)
    has its gradient accumulated, and its post-accumulate hook run, once per call,
    and once more if the loss's own graph uses it outside every checkpointed call: a
    tied embedding's owner, a block's sub-module or weight used directly by the root's
    forward, a weight penalty over ``parameters()`` in the forward or in the loss. The
    reducer must not reduce its unit before the last of them: ``take_expected_fires``
    tells it how many to wait for, the calls counted from the forwards since the last
    backward and the outside use read from the loss's graph (an ``AccumulateGrad`` node
    of the parameter reachable from the loss; a recomputation's graph is built later
    and reaches none). Counting the outside use by which module owns the parameter
    instead missed every one of those uses but the first, and the backward failed on
    a gradient arriving after its unit's reduction.

    [Note: what a recomputation cannot replay]
    A block's recomputation must compute what its first forward did, and the first
    forward runs without a graph. Two things a block may be handed break that without
    an error anywhere, so a training forward refuses them by name: a key/value cache
    (transformers' ``past_key_values`` with ``use_cache=True``, the default of its
    decoders), which the recomputation appends to a second time, so attention runs over
    twice the keys, half of them stale (the losses drifted 2e-3 from DDP's by the third
    step); and forward hooks on modules inside the block, which keep tensors that carry
    no gradient (transformers' MoE models collect ``router_logits`` for the auxiliary
    loss by replacing the router's forward on the instance during each call, and the
    router never learned from the auxiliary loss). transformers' own gradient
    checkpointing turns ``use_cache`` off for the same reason; ``initialize`` does that
    for a model whose ``config.use_cache`` is on, with a warning."""

    def __init__(
        self,
        modules: list[tuple[str, nn.Module]],
        store: CheckpointStore,
        recompute_context: Callable[[], contextlib.AbstractContextManager] | None = None,
        own_backward: Callable[[], bool] = lambda: True,
    ):
        self.store = store
        self.buffer_writes = BufferWrites()
        self.own_backward = own_backward
        """True inside the engine's backward (see [Note: backwards that are not the
        engine's])."""
        self.recomputing = recompute_context or contextlib.nullcontext
        self.modules = modules
        self._anchor = torch.empty(0, requires_grad=True)
        self._replaying = 0
        self._params = {
            id(module): [p for p in module.parameters() if p.requires_grad] for _, module in modules
        }
        self._calls: dict[int, int] = {}
        """Per parameter id, the checkpointed calls using it since the last backward."""
        self._inner = {
            id(block): [
                (f"{name}.{sub}" if name else sub, m, m.__dict__.get("forward"))
                for sub, m in block.named_modules()
                if m is not block
            ]
            for name, block in modules
        }
        """Per block, each module inside it: its name and the forward its instance
        carried at initialize (see [Note: what a recomputation cannot replay])."""
        for name, module in modules:
            if "forward" in module.__dict__:
                what = name or "the model"
                raise ValueError(
                    f"activation checkpointing: {what} already has a forward of its own "
                    "instance (module.forward was assigned: another engine's activation "
                    "checkpointing on the same model, or a library's hook); build the "
                    "engine on a model whose blocks keep their class's forward, or turn "
                    "activation_checkpointing off"
                )
            original = module.forward
            module.forward = partial(self._forward, name, module, original)

    @contextlib.contextmanager
    def replaying(self):
        """Recomputation: the module is called again (its hooks run: stage 3 gathers its
        weights) and its forward runs directly."""
        self._replaying += 1
        try:
            with self.recomputing():
                yield
        finally:
            self._replaying -= 1

    def _forward(self, name: str, module: nn.Module, original: Callable, *args: Any, **kwargs: Any):
        if self._replaying or not torch.is_grad_enabled():
            return original(*args, **kwargs)
        if not args or not isinstance(args[0], torch.Tensor):  # in the loss's graph
            return original(*args, **kwargs)
        for p in self._params[id(module)]:
            self._calls[id(p)] = self._calls.get(id(p), 0) + 1
        x, rest = args[0], args[1:]
        for value in (*rest, *kwargs.values()):
            if any(t.requires_grad for t in flatten_tensors(value)[0]):
                raise ValueError(
                    f"activation checkpointing: {name} receives a second tensor that needs a "
                    "gradient (as an argument, or inside one); only the first positional "
                    "argument is checkpointed"
                )
        check_replayable(name, rest, kwargs, self._inner[id(module)])
        built: list[Callable[[list[torch.Tensor]], Any]] = []

        def run(inp: torch.Tensor):  # see [Note: a block's output, flattened]
            out = original(inp, *rest, **kwargs)
            if isinstance(out, torch.Tensor):
                return out
            tensors, rebuild = flatten_tensors(out)
            built.append(rebuild)
            return tuple(tensors)

        def rerun(inp: torch.Tensor):
            with _engine_hooks_only(module):  # see [Note: a recomputed block's own hooks]
                out = module(inp, *rest, **kwargs)
            return out if isinstance(out, torch.Tensor) else tuple(flatten_tensors(out)[0])

        # The anchor needs a gradient, so the block's output does even when its input
        # does not: backward always reaches the recomputation (and the parameters).
        out = _Checkpoint.apply(self, name, module, run, rerun, x, self._anchor)
        return built[0](list(out)) if built else out

    def take_expected_fires(self, loss: torch.Tensor) -> dict[int, int]:
        """Per parameter id used by a checkpointed call since the last backward, how many
        times the backward of ``loss`` accumulates its gradient (see [Note: gradients of
        a shared parameter]); counting starts again."""
        calls, self._calls = self._calls, {}
        outside = leaves_of(loss.grad_fn, set(calls)) if calls else set()
        return {pid: n + (pid in outside) for pid, n in calls.items()}

    def remove(self) -> None:
        for _, module in self.modules:
            module.__dict__.pop("forward", None)


def flatten_tensors(value: Any) -> tuple[list[torch.Tensor], Callable[[list[Any]], Any]]:
    """The tensors in ``value`` (tuples, lists, named tuples, dicts, dataclasses such as
    transformers' ``ModelOutput``, nested) and a function that builds ``value`` again
    with other tensors in their places; anything else is kept as it is.

    [Note: a block's output, flattened]
    A checkpointed block runs inside an autograd Function, and autograd connects only
    the tensors a Function returns directly. A block that returned ``(h, {"aux":
    aux})``, a list or a dataclass handed back its inner tensors as constants: the
    auxiliary loss trained nothing and, for a list, nothing before the last block
    trained (the losses drifted from DDP's by the second step). So the Function returns
    the block's output flattened (a lone tensor as it is: returned in a tuple of one,
    a stage-3 block's recomputation held 16 MiB more on the planner oracle's deep
    shape), and the caller gets its structure back."""
    tensors: list[torch.Tensor] = []

    def walk(v: Any) -> Callable[[list[Any]], Any]:
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            i = len(tensors) - 1
            return lambda new: new[i]
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            fields = {f.name: walk(getattr(v, f.name)) for f in dataclasses.fields(v) if f.init}
            return lambda new: dataclasses.replace(v, **{k: f(new) for k, f in fields.items()})
        if isinstance(v, tuple) and hasattr(v, "_fields"):  # a named tuple
            parts = [walk(x) for x in v]
            return lambda new: type(v)(*(p(new) for p in parts))
        if isinstance(v, tuple | list):
            parts = [walk(x) for x in v]
            return lambda new: type(v)(p(new) for p in parts)
        if isinstance(v, dict):
            items = {k: walk(x) for k, x in v.items()}

            def rebuilt(new: list[Any]) -> Any:
                out = copy.copy(v)  # keeps the mapping's type (and a default_factory)
                for k, f in items.items():
                    out[k] = f(new)
                return out

            return rebuilt
        return lambda new: v

    return tensors, walk(value)


def check_replayable(
    name: str, args: tuple, kwargs: dict, inner: list[tuple[str, nn.Module, Any]]
) -> None:
    """Refuse what a recomputation cannot reproduce. See [Note: what a recomputation
    cannot replay]. ``inner``: the block's modules, each with its name and its
    instance's forward at initialize."""
    what = name or "the model"
    for key, value in [*((f"argument {i + 1}", v) for i, v in enumerate(args)), *kwargs.items()]:
        if _is_cache(value):
            raise ValueError(
                f"activation checkpointing: {what} is called with a key/value cache "
                f"({key}, a {type(value).__name__}) in a training forward; its recomputation "
                "would append to the cache a second time and attend over stale keys. Call "
                "the model with use_cache=False in training (for a transformers model, "
                "model.config.use_cache = False)"
            )
    hooked = [
        where
        for where, m, forward in inner
        if _foreign_hooks(m._forward_hooks) or m.__dict__.get("forward") is not forward
    ]
    if _foreign_hooks(_global_forward_hooks):
        hooked.insert(0, "every module (a global forward hook)")
    if hooked:
        raise ValueError(
            f"activation checkpointing: inside checkpointed block {what}, forward hooks or "
            f"a forward replaced since initialize (how transformers records router logits "
            f"and attentions) on {some_names(hooked, 3)}. The block's first forward "
            "runs without autograd, so a tensor kept that way (router logits for an "
            "auxiliary loss, features for a distillation loss) would carry no gradient and "
            "its loss term would train nothing. Remove the hooks (for a transformers MoE "
            "model, output_router_logits=False), or turn activation_checkpointing off (a "
            "transformers model may use its own gradient_checkpointing_enable())"
        )


def check_not_checkpointed_twice(module: nn.Module) -> None:
    """Refuse a model that checkpoints its own blocks (transformers'
    ``gradient_checkpointing_enable()`` sets ``gradient_checkpointing`` on its modules):
    each block would be checkpointed inside the engine's checkpoint, recomputed twice,
    and torch's checkpoint fails in backward ("a different number of tensors was
    saved") or, where it does not, computes what neither scheme meant."""
    own = [
        name or type(module).__name__
        for name, m in module.named_modules()
        if getattr(m, "gradient_checkpointing", False) is True
    ]
    if own:
        raise ConfigError(
            f"activation_checkpointing: the model checkpoints its own blocks "
            f"(gradient_checkpointing on in {some_names(own, 3)}, as transformers' "
            "gradient_checkpointing_enable() sets it): use one of the two "
            "(model.gradient_checkpointing_disable(), or activation_checkpointing off)"
        )


def turn_cache_off(module: nn.Module) -> None:
    """A model whose config asks for a key/value cache (transformers' decoders do by
    default) is told not to, with a warning: training never reads the cache, and a
    checkpointed block handed one is refused (see [Note: what a recomputation cannot
    replay]). ``generate`` reads its own generation config and keeps its cache."""
    config = getattr(module, "config", None)
    if getattr(config, "use_cache", None) is True:
        config.use_cache = False  # type: ignore[union-attr]
        warnings.warn(
            "activation_checkpointing: model.config.use_cache set to False (a checkpointed "
            "block's recomputation would append to the key/value cache a second time)",
            stacklevel=3,
        )


def _is_cache(value: Any) -> bool:
    """A key/value cache as transformers passes it to a block (``Cache``: ``update``
    appends this call's keys and values, ``get_seq_length`` says how many it holds)."""
    return (
        not isinstance(value, torch.Tensor)
        and callable(getattr(value, "update", None))
        and callable(getattr(value, "get_seq_length", None))
    )


def _foreign_hooks(hooks: dict) -> bool:
    """Any hook that is not the engine's own (stage 3's gather and release)."""
    return any(not _engine_hook(h) for h in hooks.values())


def _engine_hook(hook: Any) -> bool:
    return getattr(getattr(hook, "func", hook), "__module__", "").startswith("zeroservice.")


_BLOCK_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


@contextlib.contextmanager
def _engine_hooks_only(block: nn.Module) -> Iterator[None]:
    """[Note: a recomputed block's own hooks]
    The recomputation calls the block again, so that the engine's own hooks on it run
    (stage 3 gathers its weights). The model's hooks on the block itself have run
    already, around the checkpointed call: a pre-hook changed the input the checkpoint
    keeps, a forward hook the output, a backward hook sees the gradients at the
    block's boundary. Run again inside, they applied twice (a pre-hook doubling the
    input doubled it again; a gradient-reversal hook reversed the gradient twice).
    So the recomputation runs with the engine's hooks alone, as torch's own
    checkpoint calls the hooks once."""
    saved = {attr: getattr(block, attr) for attr in _BLOCK_HOOKS}
    for attr, hooks in saved.items():
        setattr(block, attr, OrderedDict((k, h) for k, h in hooks.items() if _engine_hook(h)))
    try:
        yield
    finally:
        for attr, hooks in saved.items():
            setattr(block, attr, hooks)


def leaves_of(node, wanted: set[int]) -> set[int]:
    """ids of the parameters in ``wanted`` whose gradient the graph from ``node`` (a
    loss's ``grad_fn``) accumulates directly: an ``AccumulateGrad`` node of theirs is
    reachable from it. The walk ends once every one is found."""
    found: set[int] = set()
    seen: set[int] = set()
    stack = [node] if node is not None else []
    while stack and len(found) < len(wanted):
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        variable = getattr(current, "variable", None)
        if variable is not None and id(variable) in wanted:
            found.add(id(variable))
        stack.extend(nxt for nxt, _ in current.next_functions if nxt is not None)
    return found


def checkpointed_modules(root: nn.Module, whole: Sequence[str] = ()) -> list[tuple[str, nn.Module]]:
    """Every item of the outermost nn.ModuleLists: the transformer blocks. An item that
    is itself a container (a list of lists, a list of nn.ModuleDicts) is no block, since
    it is never called: its own items are, as in the stage-3 partition. A list inside an
    item already found (a block's experts) is recomputed with its block, and a
    parametrization's list (``torch.nn.utils.parametrize``) computes a weight from other
    parameters at every access: neither is a block of its own. Nor is a list inside a
    module of ``whole`` (stage 3's leaf modules, whose weights exist only inside their
    own forward: see [Note: leaf modules] in leaf_modules.py). A module the lists hold
    several times (one layer shared by every position, as ALBERT does) is one block,
    named by its first place."""
    found: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    outer: list[str] = []

    def items(qual: str, container: nn.Module) -> None:
        for key, item in container.named_children():
            if isinstance(item, (nn.ModuleList, nn.ModuleDict)):
                items(f"{qual}.{key}" if qual else key, item)
            elif id(item) not in seen:
                seen.add(id(item))
                found.append((f"{qual}.{key}" if qual else key, item))

    for name, module in root.named_modules():
        if not isinstance(module, nn.ModuleList) or isinstance(module, ParametrizationList):
            continue
        if any(o == "" or name.startswith(f"{o}.") for o in outer) or any(
            name.startswith(f"{leaf}.") for leaf in whole
        ):
            continue
        outer.append(name)
        items(name, module)
    return found
