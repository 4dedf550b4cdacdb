"""The boundary between the engine and its checkpoints: what a save reads and a load
writes (``ShardedState``, built by the engine), and what a load hands back for the
engine to apply (``Counters`` in ``LoadResult``). checkpoint/ never sees the engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..flat import FlatUnit


@dataclass
class Counters:
    """The engine's step counters, saved in the manifest and returned by a load."""

    global_steps: int
    applied_steps: int
    loss_scaler: dict[str, Any] | None = None


@dataclass
class ShardedState:
    """This rank's share of the training state, by reference: a load writes into these
    tensors (masters, optimizer states, frozen shards, buffers) and nothing else."""

    units: list[FlatUnit]
    """Every unit: the trainable ones first, then the frozen ones (their values are saved
    as masters)."""
    masters: Sequence[torch.Tensor]
    """The fp32 master of each trainable unit: this rank's shard (the whole unit when
    ``whole``)."""
    optimizer: torch.optim.Optimizer
    """The optimizer over the masters: its per-element states and param groups."""
    module: nn.Module
    """The model: its persistent buffers are saved by rank 0 and loaded by every rank
    (each rank's own, where ``rank_buffers``)."""
    whole: bool
    """Masters hold whole units (stage 0): rank 0 alone writes them."""
    rank: int
    world: int
    group: dist.ProcessGroup | None
    """The data-parallel group every rank of the checkpoint belongs to."""
    counters: Counters
    pending_micro_steps: int
    """Micro-batches accumulated since the last step: a save or load needs none."""
    description: dict[str, Any] = field(default_factory=dict)
    """Manifest fields about the run (stage, precision, mp, mp_rank, psi)."""
    base_lrs: list[float] = field(default_factory=list)
    """Each optimizer group's base rate, the factory's (the schedule multiplies it)."""
    rank_buffers: bool = False
    """Every rank saves its own buffers and loads its own where the checkpoint has them
    (rank 0's otherwise): they differ by rank when the engine does not broadcast them
    (``broadcast_buffers=False``, BatchNorm statistics per rank)."""
