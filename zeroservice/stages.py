"""What each ZeRO-DP stage keeps resident and when it communicates.

The stage decides policy only; the flat units, reducer and optimizer carry it out.

| stage | master + optimizer | grads kept | gradient collective            | after step     |
|-------|--------------------|------------|--------------------------------|----------------|
| 0     | full               | full       | all-reduce, last micro-batch   | copy to params |
| 1     | shard (1/N)        | full       | reduce-scatter, last micro     | all-gather     |
| 2     | shard (1/N)        | shard      | reduce-scatter, every micro    | all-gather     |
| 3     | shard (1/N)        | shard      | reduce-scatter, every micro    | nothing        |

Stage 2 launches each unit's reduce-scatter as soon as backward has finished it.
Stage 3 also keeps only a shard of the parameters; they are gathered in forward and
again in backward, group by group (gather.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagePolicy:
    stage: int
    shard_world: int
    """Ranks the master weights and optimizer states are split over (1 at stage 0)."""
    keep_full_grads: bool
    """A full-size gradient buffer per unit stays resident (stages 0 and 1)."""
    reduce_every_micro_batch: bool
    """Gradients leave the rank after every micro-batch (stage 2) instead of only the last."""
    partitions_params: bool = False
    """Only a shard of the parameters persists (stage 3)."""

    @property
    def grad_collective(self) -> str:
        return "all_reduce" if self.shard_world == 1 else "reduce_scatter"

    @property
    def gathers_params(self) -> bool:
        return self.shard_world > 1


def policy_for(stage: int, world_size: int) -> StagePolicy:
    if stage == 0:
        return StagePolicy(0, 1, keep_full_grads=True, reduce_every_micro_batch=False)
    if stage == 1:
        return StagePolicy(1, world_size, keep_full_grads=True, reduce_every_micro_batch=False)
    if stage == 2:
        return StagePolicy(2, world_size, keep_full_grads=False, reduce_every_micro_batch=True)
    if stage == 3:
        return StagePolicy(
            3,
            world_size,
            keep_full_grads=False,
            reduce_every_micro_batch=True,
            partitions_params=True,
        )
    raise ValueError(f"stage: {stage} is not a supported ZeRO stage (0, 1, 2 or 3)")
