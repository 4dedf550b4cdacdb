"""Stage 3's debug check that every rank gathers the same unit at the same point.

[Note: rank-divergent control flow]
Stage 3 needs every rank to gather the same units in the same order: a rank that
skips a block issues the next block's all-gather while its peers issue this one's,
and when the two units have the same size the collective succeeds and hands each
rank a shard of the wrong unit, silently. With ``stage3_check_gathers`` every gather
is preceded by one all-reduce of (index, -index) under MAX, on a gloo group of its own
(so it never interleaves with the ring's point-to-point traffic on the engine's group;
named by an id agreed over the engine's group, so that old ranks and newcomers of a
grow meet in it: ``own_gloo_group``): the ranks agree exactly when the result is
(index, -index) everywhere; if not, each rank learns every rank's unit and raises the
same error naming them.

Without the debug mode, ``GatherDigest`` keeps the divergence from going unnoticed at
a small fixed cost: each rank folds the index of every gather it issues (forward,
backward, prefetch, persistent) into an order-sensitive running hash, and once per
optimizer step, before anything is applied, the ranks compare hashes with one
all-reduce of (h, -h) under MAX on the engine's group. On a mismatch every rank
raises and the engine discards the step's gradients; the debug mode then names the
units at the first divergent gather.

The usual cause, a Mixture-of-Experts router that sends each rank's tokens to
different experts, is caught earlier, before it can break a collective: its forward
gathers every expert on all ranks alike (the layer is one group), but only the
experts a rank's tokens picked have their weights read, and backward gathers and
reduces exactly what was read (see [Note: leaf modules] in leaf_modules.py). So after
every forward that builds a graph, ``ForwardReads`` sums over the ranks, per unit,
whether the forward read it (one all-reduce of an int32 per unit); a unit outside the
leaf modules read on some ranks but not all raises the same ``ConfigError`` on every
rank, naming the parameters and the class to put in ``stage3_leaf_modules``, before
any backward collective is issued. Without it, the backward's collectives diverged:
gloo aborted the process ("collective mismatch") or NCCL waited, and the per-step
check came too late to say why.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .config import ConfigError
from .flat import FlatUnit
from .interrupt import Interrupt
from .leaf_modules import suggested_leaves
from .naming import some_names


class GatherCheck:
    """Consensus on the unit each gather fetches. See [Note: rank-divergent control flow]."""

    def __init__(self, group: dist.ProcessGroup | None, units: list[FlatUnit]):
        self.size = dist.get_world_size(group)
        self.group = own_gloo_group(group)
        self.units = units
        self.checked = 0
        """Gathers confirmed so far."""

    def agree(self, index: int) -> None:
        """Return when every rank gathers unit ``index`` now; raise naming them otherwise."""
        probe = torch.tensor([index, -index], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]
        self.group.allreduce([probe], options).wait()
        if probe.tolist() == [index, -index]:
            self.checked += 1
            return
        seen = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self.group.allgather([seen], [torch.tensor([index])]).wait()
        ranks = "; ".join(f"rank {r}: {self._describe(int(i))}" for r, i in enumerate(seen))
        raise RuntimeError(
            "stage 3: ranks gather different units (rank-divergent control flow) - "
            f"{ranks}. Every rank must run the same modules in the same order at stage 3: "
            "name a module whose parts ranks use differently (a Mixture-of-Experts layer) "
            "in stage3_leaf_modules, or train the model at stage 0-2"
        )

    def _describe(self, index: int | None) -> str:
        if index is None or not 0 <= index < len(self.units):
            return f"unit {index}"
        names = [s.names[0] for s in self.units[index].slots]
        shown = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
        return f"unit {index} [{shown}]"


def own_gloo_group(group: dist.ProcessGroup | None) -> Any:
    """A gloo group over ``group``'s ranks, named by a fresh id that the group's first
    rank broadcasts over ``group`` (collective over it). ``dist.new_group`` names a group
    by the groups each process formed before (or by a count over the whole world), so
    ranks that formed different ones, as in a grow (old ranks and newcomers), could
    never meet; an agreed id makes the name theirs alone."""
    token = [uuid.uuid4().hex if dist.get_rank(group) == 0 else None]
    source = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(token, src=source, group=group)
    store = dist.PrefixStore(f"zeroservice/gather-check/{token[0]}/", _default_store())
    size = dist.get_world_size(group)
    return dist.ProcessGroupGloo(store, dist.get_rank(group), size, dist.default_pg_timeout)


def _default_store() -> dist.Store:
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


_MODULUS = 2**61 - 1
_MULTIPLIER = 1_000_003


class GatherDigest:
    """Per-step consensus on the sequence of gathers. See [Note: rank-divergent control
    flow]: a running hash of the unit indices issued, compared across ranks by ``check``."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        interrupt: Interrupt | None = None,
        device: torch.device | None = None,
    ):
        self.group = group
        """The engine's data-parallel group: at the step nothing else is in flight on it
        (backward's gathers and reductions are done, the next forward's not begun), as
        for the gradient norm's all-reduce, so it needs no group of its own (the debug
        check's, ``own_gloo_group``, holds a connection to every peer)."""
        self.interrupt = interrupt
        """The engine's: a rank whose peer is lost during the comparison gives it up
        (see [Note: interrupting a collective] in interrupt.py)."""
        self.device = device
        """Where the probe lives: the units' device (an NCCL group takes no host tensor)."""
        self.value = 0
        """The hash of the gathers issued since the last check (0: none)."""

    def add(self, index: int) -> None:
        """Fold one issued gather of unit ``index`` into the hash (same on every rank for
        the same sequence: integer arithmetic only)."""
        self.value = (self.value * _MULTIPLIER + index + 1) % _MODULUS

    def check(self) -> None:
        """Compare this rank's hash with every rank's and reset it; raise on every rank
        when they differ."""
        value, self.value = self.value, 0
        probe = torch.tensor([value, -value], dtype=torch.int64, device=self.device)
        _all_reduce(probe, dist.ReduceOp.MAX, self.group, self.interrupt)
        if probe.tolist() == [value, -value]:
            return
        raise RuntimeError(
            "stage 3: ranks issued different parameter gathers this step (rank-divergent "
            "control flow: e.g. a Mixture-of-Experts router sending each rank's tokens to "
            "different experts, or a branch taken on some ranks only), so some ranks may "
            "have received another unit's shard of the same size. The step's gradients "
            "were discarded and the weights are unchanged. Set stage3_check_gathers=True "
            "(or ZEROSERVICE_CHECK_GATHERS=1) to name the units at the first divergent "
            "gather. Name the module whose parts ranks use differently (the MoE layer, "
            "e.g. MixtralSparseMoeBlock) in stage3_leaf_modules, or train the model at "
            "stage 0-2"
        )


class ForwardReads:
    """Per-forward consensus on the units a forward read. See [Note: rank-divergent
    control flow]."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        root: nn.Module,
        units: list[FlatUnit],
        exempt: Collection[int],
        interrupt: Interrupt | None = None,
    ):
        self.group, self.root, self.units, self.interrupt = group, root, units, interrupt
        self.size = dist.get_world_size(group)
        self.exempt = set(exempt)
        """Units of leaf modules, whose backward is the same on every rank whatever was read."""

    def check(self, read: Collection[int]) -> None:
        """Return when every rank's forward read the same units outside the leaf
        modules; otherwise raise the same ConfigError on every rank."""
        counts = torch.zeros(len(self.units), dtype=torch.int32, device=self.units[0].flat.device)
        if read:
            counts[torch.tensor(sorted(read), device=counts.device)] = 1
        _all_reduce(counts, dist.ReduceOp.SUM, self.group, self.interrupt)
        split = [
            i
            for i in torch.nonzero((counts > 0) & (counts < self.size)).flatten().tolist()
            if i not in self.exempt
        ]
        if not split:
            return
        names = [slot.names[0] for i in split for slot in self.units[i].slots]
        leaves = suggested_leaves(self.root, names)
        raise ConfigError(
            f"stage 3: this forward read {some_names(names)} on some ranks but not all "
            f"(on {int(counts[split[0]])} of {self.size}: rank-divergent control flow, such "
            "as a Mixture-of-Experts router sending each rank's tokens to different "
            "experts). Backward would gather and reduce them on those ranks only, and the "
            "ranks' collectives would no longer match. Make the module that routes one "
            f"leaf: stage3_leaf_modules={leaves!r} (docs/configuration.md), or train the "
            "model at stage 0-2"
        )


def _all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType,
    group: dist.ProcessGroup | None,
    interrupt: Interrupt | None,
) -> None:
    """One all-reduce on the engine's group, given up if a peer is lost (see [Note:
    interrupting a collective] in interrupt.py)."""
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    assert work is not None
    if interrupt is not None:
        interrupt.run(work.wait)
    else:
        work.wait()
