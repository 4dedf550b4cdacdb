"""The flat unit: a group of parameters living in one contiguous buffer.

[Note: flat unit]
A unit owns one buffer of ``padded_numel`` elements in the training dtype. Each of
its parameters becomes a view into that buffer, so the module keeps working
unchanged while the engine moves the whole unit with one collective. The buffer is
padded with zeros to a multiple of the sharding world N, so rank r owns the equal
slice ``[r * shard_numel, (r + 1) * shard_numel)`` (its shard). Padding is fewer than
N elements per unit.

Units are formed in reverse registration order (the order backward produces
gradients) and hold at most ``bucket_elements`` elements, except a single parameter
larger than that, which forms a unit of its own. A unit never holds parameters of
two optimizer param groups (see [Note: param groups] in optim.py). Communication
buffers stay at the constant size all the same: a unit above the cap has its
gradient reduced in pieces (see [Note: constant buffers] in reduce.py).

[Note: frozen units]
Parameters with ``requires_grad=False`` (a frozen base under adapters) live in units
of their own, after every trainable unit, so that the trainable units are the prefix
``units[:T]`` the reducer and the optimizer work on. A frozen unit is broadcast at the
start, saved, resharded and exported like any unit, and at stage 3 partitioned and
gathered like any unit; it has no gradient buffer, no master, no optimizer state and
takes part in no gradient collective. The ledger counts its bytes as ``frozen``.

At stage 3 a unit is *partitioned*: ``flat`` holds only this rank's shard, and the
whole buffer exists only while the unit is gathered (gather.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class ParamSlot:
    """Where one parameter lives inside its unit's flat buffer."""

    names: list[str]
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size


@dataclass
class FlatUnit:
    """One contiguous buffer of parameters and its shard geometry. See [Note: flat unit]."""

    index: int
    slots: list[ParamSlot]
    shard_world: int
    shard_rank: int
    flat: torch.Tensor = field(repr=False)
    """The resident parameters: the whole unit, or only this rank's shard if partitioned."""
    partitioned: bool = False
    opt_group: int = 0
    """The optimizer param group of every parameter in this unit (see [Note: param groups]
    in optim.py): a unit never mixes two groups."""
    frozen: bool = False
    """Its parameters have ``requires_grad=False``: see [Note: frozen units]."""

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def padded_numel(self) -> int:
        return self.flat.numel() * (self.shard_world if self.partitioned else 1)

    @property
    def param_shard(self) -> torch.Tensor:
        """This rank's slice of the parameters (what its optimizer updates)."""
        return self.flat if self.partitioned else self.shard_of(self.flat)

    @property
    def shard_range(self) -> tuple[int, int]:
        return self.shard_start, self.shard_start + self.shard_numel

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.shard_world

    @property
    def shard_start(self) -> int:
        return self.shard_rank * self.shard_numel

    def shard_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a unit-sized tensor (the unit's buffer, or a gradient)."""
        return tensor[self.shard_start : self.shard_start + self.shard_numel]

    def views_of(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a unit-sized tensor, shaped like the parameters."""
        return [tensor[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots]


def padded_size(numel: int, world: int) -> int:
    return -(-numel // world) * world


def split_into_units(
    params: list[tuple[list[str], nn.Parameter]],
    bucket_elements: int,
    opt_group: dict[int, int] | None = None,
) -> list[list[tuple[list[str], nn.Parameter]]]:
    """Consecutive parameters packed into size-capped chunks that never mix optimizer groups."""
    group_of = opt_group or {}
    chunks: list[list[tuple[list[str], nn.Parameter]]] = []
    current: list[tuple[list[str], nn.Parameter]] = []
    size = 0
    for names, p in params:
        crosses = current and group_of.get(id(p), 0) != group_of.get(id(current[0][1]), 0)
        if current and (crosses or size + p.numel() > bucket_elements):
            chunks.append(current)
            current, size = [], 0
        current.append((names, p))
        size += p.numel()
    if current:
        chunks.append(current)
    return chunks


def frozen_key(opt_group: dict[int, int] | None, params) -> dict[int, int]:
    """``opt_group`` with every frozen parameter in a group of its own (-1), so that
    ``split_into_units`` never puts frozen and trainable parameters in one unit."""
    keys = dict(opt_group or {})
    keys.update({id(p): FROZEN for _, p in params if not p.requires_grad})
    return keys


FROZEN = -1
"""The group key of frozen parameters in ``split_into_units``."""


def trainable_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The module's trainable parameters (each once) with their first name."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def swap_in(param: nn.Parameter, value: torch.Tensor) -> None:
    """``param.data = value``, also from the meta device (which ``.data`` refuses)."""
    if param.is_meta != value.is_meta:
        fresh = nn.Parameter(value, requires_grad=param.requires_grad)
        torch.utils.swap_tensors(param, fresh)
    else:
        param.data = value


def build_unit(
    index: int,
    group: list[tuple[list[str], nn.Parameter]],
    dtype: torch.dtype,
    shard_world: int,
    shard_rank: int,
    opt_group: int = 0,
    frozen: bool = False,
    device: torch.device | None = None,
) -> FlatUnit:
    """Copy a group's parameters into a fresh flat buffer and make them views of it.

    A parameter still on the meta device (a model built to be restored, see
    ``zeroservice.RESTORED``) has nothing to copy: its view stays zero until a load or
    a restore fills it, and no whole-parameter tensor is allocated and copied on the
    way (on a 267 M GPT, about 0.3 s and 1 GiB of page faults per re-forming rank).
    ``device``: where the buffer goes (default: the first parameter's)."""
    device = device or group[0][1].device
    slots, offset = [], 0
    for names, p in group:
        if p.device != device and not p.is_meta:
            raise ValueError(
                f"parameter {names[0]} is on {p.device}, but {group[0][0][0]} is on {device}: "
                "the engine needs every parameter on one device"
            )
        slots.append(ParamSlot(names, p, offset, p.numel(), p.shape))
        offset += p.numel()
    flat = torch.zeros(padded_size(offset, shard_world), dtype=dtype, device=device)
    unit = FlatUnit(index, slots, shard_world, shard_rank, flat, opt_group=opt_group, frozen=frozen)
    with torch.no_grad():
        for slot, view in zip(slots, unit.views_of(flat), strict=True):
            if slot.param.is_meta:
                swap_in(slot.param, view)
            else:
                view.copy_(slot.param.detach())
                slot.param.data = view
    return unit


def build_units(
    chunks: list[list[tuple[list[str], nn.Parameter]]],
    dtype: torch.dtype,
    shard_world: int,
    shard_rank: int,
    opt_group: dict[int, int] | None = None,
    device: torch.device | None = None,
) -> list[FlatUnit]:
    """Stages 0-2: a unit per chunk of ``units.plan_layout``, holding its parameters."""
    group_of = opt_group or {}
    return [
        build_unit(
            i,
            g,
            dtype,
            shard_world,
            shard_rank,
            group_of.get(id(g[0][1]), 0),
            frozen=not g[0][1].requires_grad,
            device=device,
        )
        for i, g in enumerate(chunks)
    ]
