"""Building a model straight into shards, so that no rank ever holds all of it.

[Note: deferred construction]
Under ``deferred_init()`` every parameter a module registers is moved to the meta
device: shapes and dtypes, no data (buffers stay real, since many cannot be
recomputed later). The engine then creates only this rank's shards and fills them,
one module (or one file entry) at a time, from one of three sources:

* a state-dict file (``init="weights.pt"``), memory-mapped, so each rank reads only
  the bytes of its own slices;
* the modules' own ``reset_parameters()`` followed by an optional
  ``init(qualified_name, module)``; rank 0's values are broadcast module by module,
  so every rank agrees whatever the RNG state;
* for an ordinary (materialised) model: its current values, rank 0's broadcast unit
  by unit, as DDP does.

The peak is one module's (or one unit's) parameters, never the model.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from .config import ConfigError
from .flat import FlatUnit, ParamSlot, frozen_key, padded_size, swap_in
from .naming import some_names
from .partition import NamedParams

ModuleInit = Callable[[str, nn.Module], None]


class Restored:
    """``init=RESTORED``: the weights are about to be overwritten (a checkpoint load or
    a restore from peers follows), so a deferred model's parameters are allocated but
    neither initialised nor broadcast: for a large model that is seconds of random
    numbers and a whole-model broadcast saved on every restart and live resize. The
    engine refuses to train or save until the state has arrived."""

    def __repr__(self) -> str:
        return "zeroservice.RESTORED"


RESTORED = Restored()
InitSource = str | os.PathLike | ModuleInit | Restored | None


@contextlib.contextmanager
def deferred_init() -> Iterator[None]:
    """Construct modules with parameters on the meta device. See [Note: deferred construction]."""
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def check_materialised(module: nn.Module) -> None:
    """Refuse a lazy module's parameters (``nn.LazyLinear`` before its first forward):
    they have no shape yet, so no unit can hold them."""
    lazy = [n for n, p in module.named_parameters() if isinstance(p, nn.UninitializedParameter)]
    if lazy:
        raise ConfigError(
            f"model: parameters {some_names(lazy)} are not initialised yet (a lazy "
            "module): run one forward with a sample batch before initialize, so they have "
            "their shapes"
        )


def check_no_buffer_views(module: nn.Module) -> None:
    """Refuse a buffer that shares a parameter's storage (``register_buffer("w_t",
    self.weight.detach().t())``): the engine moves every parameter into its flat
    buffers, so the buffer would keep the weights of ``initialize`` while they train
    (DDP's followed them), silently."""
    storages = {
        p.untyped_storage().data_ptr(): n
        for n, p in module.named_parameters()
        if p.numel() and not p.is_meta
    }
    shared = [
        f"{b} (a view of {storages[buf.untyped_storage().data_ptr()]})"
        for b, buf in module.named_buffers()
        if buf.numel() and not buf.is_meta and buf.untyped_storage().data_ptr() in storages
    ]
    if shared:
        raise ConfigError(
            f"model: buffers {some_names(shared)} share a parameter's storage; the engine "
            "moves the parameters into its own buffers, so these would keep the weights "
            "of initialize while the parameters train. Compute them from the parameter in "
            "the forward instead (or register a copy, if that is what is meant)"
        )


def check_unwrapped(module: nn.Module) -> None:
    """Refuse a model wrapped in another data-parallel wrapper (DDP, DataParallel,
    FSDP or ``fully_shard``), itself or inside: its own hooks would reduce or shard the
    gradients and weights the engine reduces and shards, and training would silently
    not be the engine's."""
    kinds: list[type] = [nn.parallel.DistributedDataParallel, nn.DataParallel]
    fsdp = sys.modules.get("torch.distributed.fsdp")  # only a program that used it
    if fsdp is not None:
        kinds += [getattr(fsdp, n) for n in ("FullyShardedDataParallel", "FSDPModule")]
    found = [
        (name or "the model", type(m).__name__)
        for name, m in module.named_modules()
        if isinstance(m, tuple(kinds))
    ]
    if found:
        where, kind = found[0]
        raise ConfigError(
            f"model: {where} is a {kind}, which reduces (or shards) gradients itself; pass "
            "the bare module (for DDP and DataParallel, their .module): the engine does "
            "the data parallelism"
        )


def check_no_gradient_hooks(module: nn.Module) -> None:
    """Refuse hooks on parameters at stage 3: the module computes with gathered copies,
    the parameters themselves become empty placeholders, and a hook registered on
    one (``register_hook``, ``register_post_accumulate_grad_hook``) would never run."""
    hooked = gradient_hooked(module.named_parameters())
    if hooked:
        raise ConfigError(
            f"stage: 3 partitions parameters, and {some_names(hooked)} carry "
            "gradient hooks that would never run on them; change the gradient in the "
            "module's forward instead, or use stage 0, 1 or 2"
        )


def gradient_hooked(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the parameters that carry a gradient hook of either kind."""
    return [
        n
        for n, p in named
        if getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None)
    ]


def is_deferred(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def _placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)


def empty_units(
    chunks: list[NamedParams],
    dtype: torch.dtype,
    world: int,
    rank: int,
    device: torch.device,
    opt_group: dict[int, int] | None = None,
) -> list[FlatUnit]:
    """Stage 3: an empty shard per chunk of ``units.plan_layout`` (filled by ``fill_*``)."""
    return [
        _empty_unit(i, chunk, dtype, world, rank, device, frozen_key(opt_group, chunk))
        for i, chunk in enumerate(chunks)
    ]


def _empty_unit(index, chunk: NamedParams, dtype, world, rank, device, keys) -> FlatUnit:
    slots, offset = [], 0
    for names, q in chunk:
        slots.append(ParamSlot(names, q, offset, q.numel(), q.shape))
        offset += q.numel()
    shard = torch.zeros(padded_size(offset, world) // world, dtype=dtype, device=device)
    frozen = not chunk[0][1].requires_grad
    opt = 0 if frozen else keys.get(id(chunk[0][1]), 0)
    return FlatUnit(
        index, slots, world, rank, shard, partitioned=True, opt_group=opt, frozen=frozen
    )


def _copy_overlap(unit: FlatUnit, slot: ParamSlot, values: torch.Tensor) -> None:
    """Copy the part of one parameter's values that falls in this rank's shard."""
    lo, hi = unit.shard_range
    a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
    if a < b:
        flat = values.reshape(-1)
        unit.flat[a - lo : b - lo].copy_(flat[a - slot.offset : b - slot.offset])


def _slot_index(units: list[FlatUnit]) -> dict[int, tuple[FlatUnit, ParamSlot]]:
    return {id(s.param): (u, s) for u in units for s in u.slots}


def fill_from_module(units: list[FlatUnit], communicator: comm.Communicator) -> None:
    """Shards from a materialised model's own values, rank 0's broadcast unit by unit."""
    first = units[0].flat
    largest = max(u.padded_numel for u in units)
    scratch = torch.empty(largest, dtype=first.dtype, device=first.device)
    for unit in units:
        full = scratch[: unit.padded_numel].zero_()
        for slot, view in zip(unit.slots, unit.views_of(full), strict=True):
            view.copy_(slot.param.detach())
        if communicator.world > 1:
            communicator.broadcast(full, "init").wait()
        unit.flat.copy_(unit.shard_of(full))


def _own_params(module: nn.Module, done: set[int]) -> list[nn.Parameter]:
    return [p for p in module._parameters.values() if p is not None and id(p) not in done]


class _Scratch:
    """One reusable host buffer that every module's parameters are materialised into in
    turn: allocating and freeing each module's tensors instead leaves glibc's heap
    holding most of the model's bytes after the fact."""

    ALIGN = 64

    def __init__(self, modules: list[nn.Module], device: torch.device):
        need = max((self._layout(m)[1] for m in modules), default=0)
        self.buffer = torch.empty(need, dtype=torch.uint8, device=device)

    @classmethod
    def _layout(cls, module: nn.Module) -> tuple[list[int], int]:
        offsets, end = [], 0
        for p in module._parameters.values():
            if p is not None:
                offsets.append(end)
                end += -(-p.numel() * p.element_size() // cls.ALIGN) * cls.ALIGN
        return offsets, end

    def views(self, module: nn.Module) -> dict[int, torch.Tensor]:
        offsets, _ = self._layout(module)
        params = [p for p in module._parameters.values() if p is not None]
        out = {}
        for p, start in zip(params, offsets, strict=True):
            raw = self.buffer[start : start + p.numel() * p.element_size()]
            out[id(p)] = raw.view(p.dtype).view(p.shape)
        return out


def fill_from_init(
    root: nn.Module,
    units: list[FlatUnit],
    communicator: comm.Communicator,
    init: ModuleInit | None,
) -> None:
    """Shards of a deferred model from its initialisers, one module at a time."""
    where = _slot_index(units)
    device = units[0].flat.device
    modules = list(root.named_modules())
    scratch = _Scratch([m for _, m in modules], device)
    done: set[int] = set()
    for qual, module in modules:
        own = _own_params(module, done)
        if not own:
            continue
        views = scratch.views(module)
        for p in own:
            swap_in(p, views[id(p)])
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        if init is not None:
            init(qual, module)
        for p in own:
            done.add(id(p))
            if communicator.world > 1:
                communicator.broadcast(p.data, "init").wait()
            if id(p) in where:
                unit, slot = where[id(p)]
                _copy_overlap(unit, slot, p.data)
            p.data = _placeholder(p.dtype, device)


class StateDictFile:
    """A full state dict on disk, memory-mapped; entries are read only where sliced."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"init: {self.path} is not a file")
        try:
            self.entries = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:
            raise ValueError(f"init: {self.path} is not a torch state-dict file: {exc}") from exc
        if not isinstance(self.entries, dict):
            raise ValueError(f"init: {self.path} holds a {type(self.entries).__name__}, not a dict")

    def value(self, names: list[str], shape: torch.Size) -> torch.Tensor:
        for name in names:
            if name in self.entries:
                tensor = self.entries[name]
                if tensor.shape != shape:
                    raise ValueError(
                        f"init: {self.path}: {name} has shape {tuple(tensor.shape)}, "
                        f"the model expects {tuple(shape)}"
                    )
                return tensor
        raise ValueError(f"init: {self.path} has no entry for parameter {' / '.join(names)}")

    def check_keys(self, root: nn.Module) -> None:
        known = {n for n, _ in root.named_parameters(remove_duplicate=False)}
        known |= {n for n, _ in root.named_buffers(remove_duplicate=False)}
        unknown = sorted(set(self.entries) - known)
        if unknown:
            shown = ", ".join(unknown[:5]) + (" ..." if len(unknown) > 5 else "")
            raise ValueError(f"init: {self.path} has entries the model lacks: {shown}")

    def load_buffers(self, root: nn.Module) -> None:
        for name, buffer in root.named_buffers():
            if name in self.entries:
                with torch.no_grad():
                    buffer.copy_(self.value([name], buffer.shape))


def fill_from_file(root: nn.Module, units: list[FlatUnit], source: StateDictFile) -> None:
    """Shards straight from a state-dict file: each rank reads its own slices."""
    source.check_keys(root)
    with torch.no_grad():
        for unit in units:
            for slot in unit.slots:
                _copy_overlap(unit, slot, source.value(slot.names, slot.shape))
    source.load_buffers(root)


def materialize(root: nn.Module, init: InitSource, device: torch.device) -> None:
    """Give a deferred model (or one to be loaded from a file) real, whole parameters.

    For stages 0-2, which keep whole parameters anyway.
    """
    if isinstance(init, str | os.PathLike):
        source = StateDictFile(init)
        source.check_keys(root)
        with torch.no_grad():
            for names, p in _named_unique(root):
                value = source.value(names, p.shape)
                swap_in(p, value.to(device=device, dtype=p.dtype, copy=True))
        source.load_buffers(root)
        return
    done: set[int] = set()
    restored = isinstance(init, Restored)
    for qual, module in root.named_modules():
        own = [p for p in module._parameters.values() if p is not None and p.is_meta]
        own = [p for p in own if id(p) not in done]
        if not own:
            continue
        for p in own:
            swap_in(p, torch.empty(p.shape, dtype=p.dtype, device=device))
            done.add(id(p))
        if restored:
            continue
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        if callable(init):
            init(qual, module)


def _named_unique(root: nn.Module) -> list[tuple[list[str], nn.Parameter]]:
    names: dict[int, tuple[list[str], nn.Parameter]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), ([], p))[0].append(name)
    return list(names.values())


def release_parameters(units: list[FlatUnit]) -> None:
    """Make every registered parameter an empty placeholder (its data lives in shards)."""
    for unit in units:
        for slot in unit.slots:
            swap_in(slot.param, _placeholder(unit.flat.dtype, unit.flat.device))


def engine_device(module: nn.Module, group) -> torch.device:
    """Where a deferred model's shards go: this rank's GPU on NCCL, else the CPU."""
    if str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    for p in module.parameters():
        if not p.is_meta:
            return p.device
    return torch.device("cpu")
