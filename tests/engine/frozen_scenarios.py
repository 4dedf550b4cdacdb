"""A LoRA-style model in spawned ranks: a frozen base (embedding and linear layers)
under trainable low-rank adapters, each rank built from its own seed so that a missing
broadcast of the frozen weights would show."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zeroservice
from tests.engine import harness
from zeroservice.config import ZeroConfig

VOCAB, SEQ, DIM = 64, 16, 32


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update ``x A^T B^T``."""

    def __init__(self, d_in: int, d_out: int, rank: int = 4):
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, d_in) * 0.1)
        self.b = nn.Parameter(torch.randn(d_out, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.a), self.b)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)  # trainable, beside the frozen base
        self.lin = LoRALinear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x)))


class LoRANet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM).requires_grad_(False)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = LoRALinear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).view(-1, VOCAB), targets.reshape(-1))


def frozen_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if not p.requires_grad]


def lora_vs_ddp(stage: int, precision: str = "fp32", steps: int = 6, save: str = "") -> dict:
    """The Adam run's losses, the SGD run's gradients and weights against DDP (rank 0's
    weights broadcast by both), the frozen weights after training, the ledger; with
    ``save`` the SGD engine's checkpoint is written there."""
    rank = dist.get_rank()
    batches = harness.token_batches(VOCAB, SEQ, seed=3)
    config = ZeroConfig(stage=stage, precision=precision, bucket_elements=2048)

    def runs(optimizer, capture: bool):
        torch.manual_seed(100 + rank)  # every rank starts from different weights
        model = LoRANet()
        ref = harness.run_ddp(copy.deepcopy(model), optimizer, batches, steps, capture=capture)
        engine = zeroservice.initialize(model, config, optimizer)
        run = harness.run_engine(engine, batches, steps, reference=ref if capture else None)
        return engine, run, ref

    _, adam, adam_ref = runs(lambda ps: torch.optim.AdamW(ps, lr=1e-2), False)
    engine, sgd, sgd_ref = runs(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), True)
    torch.manual_seed(100)
    initial = {n: p.detach().clone() for n, p in LoRANet().named_parameters()}
    if save:
        engine.save_checkpoint(save)
    ledger = engine.memory_ledger()
    names = frozen_names(LoRANet())
    return {
        "losses": adam.losses,
        "ref_losses": adam_ref.losses,
        "grad_ratio": sgd.grad_ratio,
        "weight_ratio": harness.weight_ratio(sgd.state, sgd_ref.state),
        "frozen_after": {n: sgd.state[n] for n in names},
        "frozen_rank0": {n: initial[n] for n in names},
        "trained": {n: sgd.state[n] for n in ("head.a", "blocks.0.norm.weight")},
        "trained_rank0": {n: initial[n] for n in ("head.a", "blocks.0.norm.weight")},
        "ledger": ledger.as_dict(),
        "frozen_units": [(u.numel, u.padded_numel) for u in engine.units if u.frozen],
        "trainable_units": len(engine.trainable_units),
        "optimizer_params": sum(len(g["params"]) for g in engine.optimizer.optimizer.param_groups),
        "input": batches(steps, 1)[0],
        "engine_loss": float(engine(*batches(steps, 1)[0])),
    }
