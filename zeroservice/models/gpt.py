"""A GPT-2-style decoder: the reference model of tests, benchmarks and the demo."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 8192
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    dim: int = 256
    mlp_ratio: int = 4
    dropout: float = 0.0
    tie_weights: bool = True
    """Share the token embedding with the output head (GPT-2 does)."""
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "dim", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_head:
            raise ValueError(f"dim: {self.dim} is not divisible by n_head {self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: must be in [0, 1), got {self.dropout}")

    def num_params(self) -> int:
        """Trainable parameters, counting a tied embedding once."""
        d, v, f = self.dim, self.vocab_size, self.dim * self.mlp_ratio
        b = 1 if self.bias else 0
        norms = 2 * 2 * d
        attn = (3 * d * d + 3 * d * b) + (d * d + d * b)
        mlp = (d * f + f * b) + (f * d + d * b)
        block = norms + attn + mlp
        head = 0 if self.tie_weights else v * d
        return v * d + self.seq_len * d + self.n_layer * block + 2 * d + head

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6N plus the attention term (12 * layers * dim * seq)."""
        return 6 * self.num_params() + 12 * self.n_layer * self.dim * self.seq_len


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx, targets)`` returns the mean loss."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.wte.weight
        init = self.initializer(cfg)
        for name, module in self.named_modules():
            init(name, module)

    @staticmethod
    def initializer(cfg: GPTConfig) -> Callable[[str, nn.Module], None]:
        """GPT-2's initialisation, one module at a time (usable for deferred construction):
        normal(0.02) weights, zero biases, output projections scaled by 1/sqrt(2 layers)."""
        scaled = 0.02 / math.sqrt(2 * cfg.n_layer)

        def init(name: str, m: nn.Module) -> None:
            if isinstance(m, nn.Linear):
                std = scaled if name.endswith(("attn.proj", "mlp.proj")) else 0.02
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)

        return init

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds seq_len {self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
