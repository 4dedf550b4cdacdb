"""A parameter used by more than one checkpointed call: its gradient is accumulated once
per recomputation (see [Note: gradients of a shared parameter] in
zeroservice/activations.py), and its unit must be reduced after the last of them."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import zeroservice
from tests.engine import harness
from zeroservice.config import ZeroConfig

WIDTH = 32


class _Shared(nn.Module):
    """Blocks in a ModuleList (the engine checkpoints each), used in ways that make one
    parameter's gradient arrive more than once in a backward, or held in ways that put
    a block's weights in a group that is not the block:

    - ``called-twice``: block 0 runs before and after block 1;
    - ``tied-across-blocks``: block 2's weight is block 0's;
    - ``tied-outside``: block 0's weight is also an output projection's, outside the blocks;
    - ``keyword-call``: block 0 is also called with a keyword input, which is not
      checkpointed (its graph is recorded as usual);
    - ``listed-twice``: the list holds one block at places 0 and 2 (ALBERT's sharing);
    - ``list-of-lists``: the list's items are lists of blocks, never called themselves;
    - ``list-of-dicts``: the list's items are nn.ModuleDicts of blocks, likewise;
    - ``size-grouped-list``: ``stage3_grouping="size"`` makes the whole list one group,
      so at stage 3 no block is a group of its own (their weights are read on demand);
    - ``weight-read``: the root's forward also multiplies by block 0's weight directly;
    - ``penalty``: the loss adds a weight penalty over ``self.parameters()``, so every
      block's weights are used once more outside the checkpointed calls.
    """

    def __init__(self, kind: str, user_reentrant: bool = False):
        super().__init__()
        self.kind, self.user_reentrant = kind, user_reentrant
        count = 2 if kind == "called-twice" else 3
        layers = [nn.Linear(WIDTH, WIDTH) for _ in range(count)]
        if kind == "listed-twice":
            layers[2] = layers[0]
        if kind == "list-of-lists":
            self.blocks = nn.ModuleList([nn.ModuleList(layers[:2]), nn.ModuleList(layers[2:])])
        elif kind == "list-of-dicts":
            first, second = nn.ModuleDict({"a": layers[0], "b": layers[1]}), nn.ModuleDict()
            second["a"] = layers[2]
            self.blocks = nn.ModuleList([first, second])
        else:
            self.blocks = nn.ModuleList(layers)
        self.order = layers
        """The blocks in call order (a plain list: not registered again)."""
        self.proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.head = nn.Linear(WIDTH, 1)
        if kind == "tied-across-blocks":
            layers[2].weight = layers[0].weight
        if kind == "tied-outside":
            self.proj.weight = layers[0].weight

    def _block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if self.user_reentrant:
            return torch.tanh(checkpoint(self.order[i], x, use_reentrant=True))
        return torch.tanh(self.order[i](x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = (0, 1, 0) if self.kind == "called-twice" else (0, 1, 2)
        for i in order:
            x = self._block(i, x)
        if self.kind == "keyword-call":
            x = torch.tanh(self.order[0](input=x))
        if self.kind == "weight-read":
            x = x + torch.tanh(nn.functional.linear(x, self.order[0].weight))
        x = self.proj(x)
        loss = self.head(x).pow(2).mean()
        if self.kind == "penalty":
            loss = loss + 1e-2 * sum(p.pow(2).sum() for p in self.parameters())
        return loss


KINDS = (
    "called-twice",
    "tied-across-blocks",
    "tied-outside",
    "keyword-call",
    "listed-twice",
    "list-of-lists",
    "list-of-dicts",
    "size-grouped-list",
    "weight-read",
    "penalty",
)


def _batches(step: int, accum: int) -> list[tuple]:
    g = torch.Generator().manual_seed(100 * step + 10 * accum + dist.get_rank())
    return [(torch.randn(4, WIDTH, generator=g),) for _ in range(accum)]


def _config(stage: int, accum: int, kind: str = "") -> ZeroConfig:
    size_grouped = kind == "size-grouped-list"
    return ZeroConfig(
        stage=stage,
        gradient_accumulation_steps=accum,
        activation_checkpointing=True,
        bucket_elements=4096 if size_grouped else 1024,  # the list: 3 x 1056 elements
        stage3_grouping="size" if size_grouped else "blocks",
        stage3_persistence_elements=0,
    )


def shared_parameters_at(kind: str, stage: int, steps: int = 3, accum: int = 2) -> dict:
    """The engine with activation checkpointing against DDP on the same model without it
    (same arithmetic): Adam losses, SGD gradients every step and SGD weights."""

    def runs(optimizer, capture: bool) -> tuple[harness.Run, harness.Run]:
        torch.manual_seed(5)
        model = _Shared(kind)
        ref = harness.run_ddp(
            copy.deepcopy(model), optimizer, _batches, steps, accum, capture=capture
        )
        engine = zeroservice.initialize(model, _config(stage, accum, kind), optimizer=optimizer)
        run = harness.run_engine(engine, _batches, steps, accum, reference=ref if capture else None)
        engine.close()
        return run, ref

    adam, adam_ref = runs(lambda ps: torch.optim.AdamW(ps, lr=1e-2), False)
    sgd, sgd_ref = runs(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), True)
    return harness.parity_record(adam, adam_ref, sgd, sgd_ref)


def shared_parameters(stages: list[int]) -> dict[tuple[str, int], dict]:
    return {(kind, stage): shared_parameters_at(kind, stage) for kind in KINDS for stage in stages}


def user_reentrant_refused(stages: list[int]) -> dict[int, str]:
    """A block called twice through torch.utils.checkpoint(use_reentrant=True): the
    engine cannot foresee the second gradient, and says so instead of losing it."""
    out = {}
    for stage in stages:
        torch.manual_seed(5)
        engine = zeroservice.initialize(
            _Shared("called-twice", user_reentrant=True),
            ZeroConfig(stage=stage, bucket_elements=1024, stage3_persistence_elements=0),
            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        )
        (x,) = _batches(0, 1)[0]
        try:
            engine.backward(engine(x.requires_grad_()))
            out[stage] = ""
        except RuntimeError as e:
            out[stage] = str(e)
        engine.close()
    return out
