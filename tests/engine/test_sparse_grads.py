"""A model whose embedding makes sparse gradients (``nn.Embedding(sparse=True)``) trains
at every stage as the same model with dense ones: see [Note: sparse gradients] in
reduce.py."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroservice
from tests.engine.harness import run_engine
from zeroservice.launch import run_local

STAGES = (0, 1, 2, 3)
STEPS = 4


class _Bag(nn.Module):
    """An embedding larger than the bucket (reduced in pieces), a small one, a head."""

    def __init__(self, sparse: bool):
        super().__init__()
        self.big = nn.Embedding(600, 16, sparse=sparse)
        self.small = nn.Embedding(40, 16, sparse=sparse)
        self.head = nn.Linear(16, 1)

    def forward(self, big, small):
        return self.head(torch.tanh(self.big(big) + self.small(small))).pow(2).mean()


def _batches(step: int, accum: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    # Repeated indices: a sparse gradient then holds several rows for one index.
    big = torch.randint(0, 30, (4, 6), generator=g) * 20
    return [(big, torch.randint(0, 40, (4, 6), generator=g))]


def _losses(stage: int, sparse: bool) -> list[float]:
    torch.manual_seed(0)
    engine = zeroservice.initialize(
        _Bag(sparse),
        {"stage": stage, "bucket_elements": 4096},
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    )
    losses = run_engine(engine, _batches, STEPS, keep_state=False).losses
    engine.close()
    return losses


def _all() -> dict[tuple[int, bool], list[float]]:
    return {(s, sparse): _losses(s, sparse) for s in STAGES for sparse in (False, True)}


@functools.cache
def _results() -> list[dict[tuple[int, bool], list[float]]]:
    return run_local(_all, 2)


@pytest.mark.parametrize("stage", STAGES)
def test_sparse_gradients_train_as_dense_ones(stage):
    for per_rank in _results():
        dense, sparse = per_rank[(stage, False)], per_rank[(stage, True)]
        torch.testing.assert_close(torch.tensor(sparse), torch.tensor(dense), rtol=1e-5, atol=0)
        assert dense[-1] < dense[0]  # the run trains
