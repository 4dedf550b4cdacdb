"""How a model is cut into flat units, in one place: the engine builds what this plans,
and the planner counts it without building anything.

[Note: stage order]
Each stage must hold no more bytes than the stage below it, at every model size:
model states plus every buffer the engine allocates. Sharding the gradients (stage 2)
saves ``(1 - 1/N) Psi`` gradient elements per rank and costs two staging buffers of
C_B elements (see [Note: constant buffers] in reduce.py); so C_B is capped at
``Psi (1 - 1/N) / 2`` elements, a multiple of N. Partitioning the parameters (stage 3)
saves ``(1 - 1/N) Psi`` parameter elements and costs what it keeps gathered: the units
it prefetches, the units that persist between steps and the staging buffers it borrows
from the same cache. Both budgets are capped at the same ``Psi (1 - 1/N) / 2`` (the
cache at twice that, which covers the staging buffers), so the gathered parameters never
outgrow what partitioning saves. The caps apply to the sizes the configuration leaves
to the engine (``bucket_elements`` etc. None, the default; a configured number is used
as given) and bind only for models smaller than about 4 x 2^23 = 2^25 elements at
N = 2; larger models get the default sizes unchanged. What a module's forward needs at
once is always gathered whole, whatever the budget: a model whose single parameter is
larger than the cap (one weight of more than about a quarter of the model at N = 2) can
hold more at stage 3 than at stage 2, by at most that unit; the ledger's
``gathered_peak`` shows it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from .config import KNOWN_MOE_LEAVES
from .flat import frozen_key, padded_size, split_into_units, trainable_parameters
from .partition import Group, NamedParams, build_groups


@dataclass(frozen=True)
class Budgets:
    """Sizes in elements that the engine uses for a model at a data-parallel degree."""

    unit_elements: int
    """C_B: the most elements a unit holds (a larger single parameter forms its own unit)
    and the size of every staging buffer."""
    prefetch_elements: int
    """Stage 3: gathered parameter elements prefetched ahead of use."""
    persistence_elements: int
    """Stage 3: a unit of at most this many elements stays gathered between steps..."""
    persistent_total: int | None
    """...while all such units together stay within this many elements (None: no cap)."""


def stage_slack(psi: int, world: int) -> int:
    """``Psi (1 - 1/N) / 2`` rounded down to a multiple of N (at least N): what each of
    stages 2 and 3 may spend on buffers. See [Note: stage order]."""
    if world <= 1:
        return 0
    slack = psi * (world - 1) // (2 * world)
    return max(world, slack // world * world)


BUCKET_ELEMENTS = 2**23
"""C_B when the configuration leaves it to the engine (then capped: [Note: stage order])."""
PREFETCH_ELEMENTS = 2**25
PERSISTENCE_ELEMENTS = 2**16


def budgets(
    psi: int,
    world: int,
    bucket_elements: int | None = None,
    prefetch_elements: int | None = None,
    persistence_elements: int | None = None,
) -> Budgets:
    """The sizes for a model of ``psi`` trainable elements at data-parallel degree
    ``world``: a configured size is used as given; one left to the engine (None) is the
    default capped so that no stage outgrows the one below it."""
    slack = stage_slack(psi, world)

    def pick(given: int | None, default: int) -> int:
        if given is not None:
            return given
        return min(default, slack) if slack else default

    persistent_total = slack if persistence_elements is None and slack else None
    return Budgets(
        unit_elements=pick(bucket_elements, BUCKET_ELEMENTS),
        prefetch_elements=pick(prefetch_elements, PREFETCH_ELEMENTS),
        persistence_elements=pick(persistence_elements, PERSISTENCE_ELEMENTS),
        persistent_total=persistent_total,
    )


@dataclass
class Layout:
    """The parameters of each unit, trainable units first (see [Note: frozen units] in
    flat.py), and at stage 3 the module groups whose forward gathers them."""

    chunks: list[NamedParams]
    budgets: Budgets
    groups: list[Group] | None = None
    """Stage 3: the gathered module groups (partition.py); None at stages 0-2."""
    group_units: list[list[int]] | None = None
    """Stage 3: per group, the indices of its units."""


def plan_layout(
    module: nn.Module,
    *,
    stage: int,
    world: int,
    bucket_elements: int | None = None,
    prefetch_elements: int | None = None,
    persistence_elements: int | None = None,
    stage3_grouping: str = "blocks",
    opt_group: dict[int, int] | None = None,
    stage3_leaf_modules: Sequence[str] = KNOWN_MOE_LEAVES,
) -> Layout:
    """Cut ``module``'s parameters into units as the engine will; ``world``: the
    data-parallel degree N_d (budgets follow it at every stage, so that all stages cut a
    model alike). Only inspects the module."""
    trainable = trainable_parameters(module)
    if not trainable:
        raise ValueError("the module has no trainable parameters (none with requires_grad)")
    psi = sum(p.numel() for _, p in trainable)
    sizes = budgets(psi, world, bucket_elements, prefetch_elements, persistence_elements)
    cap = sizes.unit_elements
    if stage < 3:
        return Layout(_reverse_order_chunks(module, cap, opt_group), sizes)
    groups = build_groups(module, stage3_grouping, cap, stage3_leaf_modules)
    chunks: list[NamedParams] = []
    per_group: list[list[int]] = [[] for _ in groups]
    for frozen in (False, True):
        for group, indices in zip(groups, per_group, strict=True):
            mine = [(n, p) for n, p in group.params if p.requires_grad != frozen]
            for chunk in split_into_units(mine, cap, frozen_key(opt_group, mine)):
                indices.append(len(chunks))
                chunks.append(chunk)
    return Layout(chunks, sizes, groups, per_group)


def _reverse_order_chunks(
    module: nn.Module, cap: int, opt_group: dict[int, int] | None
) -> list[NamedParams]:
    """Stages 0-2: parameters in reverse registration order (about the order backward
    finishes them), trainable ones first, packed into units of at most ``cap``."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    params = list(module.parameters())
    trainable = [(names[id(p)], p) for p in reversed(params) if p.requires_grad]
    frozen = [(names[id(p)], p) for p in reversed(params) if not p.requires_grad]
    keys = frozen_key(opt_group, frozen)
    return split_into_units(trainable, cap, keys) + split_into_units(frozen, cap, keys)


def unit_sizes(layout: Layout, shard_world: int) -> list[tuple[int, int]]:
    """(elements, padded elements) of each trainable unit of ``layout``."""
    out = []
    for chunk in layout.chunks:
        if chunk[0][1].requires_grad:
            n = sum(p.numel() for _, p in chunk)
            out.append((n, padded_size(n, shard_world)))
    return out
