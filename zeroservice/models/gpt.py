"""A GPT-2-style decoder: the reference model of tests, benchmarks and the demo."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel import (
    ColumnParallelLinear,
    MPGroup,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from .tiled_head import TiledHead


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
    vocab_tiles: int = 1
    """The output head and the loss computed in this many vocabulary tiles, so that the
    whole logits never exist (see [Note: vocabulary tiles] in tiled_head.py); 1: at
    once. Without model parallelism only (which splits the vocabulary already)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "dim", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_head:
            raise ValueError(f"dim: {self.dim} is not divisible by n_head {self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: must be in [0, 1), got {self.dropout}")
        if not 1 <= self.vocab_tiles <= self.vocab_size:
            raise ValueError(
                f"vocab_tiles: must be in [1, vocab_size {self.vocab_size}], got {self.vocab_tiles}"
            )

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
        """Training FLOPs per token: 6 per parameter that multiplies in each token's step
        (the position table and an untied token embedding are looked up, not
        multiplied; a tied embedding is the head's matmul), plus the attention term
        (12 * layers * dim * seq)."""
        lookups = self.seq_len * self.dim + (0 if self.tie_weights else self.vocab_size * self.dim)
        matmuls = self.num_params() - lookups
        return 6 * matmuls + 12 * self.n_layer * self.dim * self.seq_len


def _tp(mp: MPGroup | None) -> MPGroup | None:
    return mp if mp is not None and mp.size > 1 else None


class CausalSelfAttention(nn.Module):
    """Heads split across MP ranks when ``mp`` has more than one rank (column-parallel
    qkv, row-parallel output projection)."""

    def __init__(self, cfg: GPTConfig, mp: MPGroup | None = None):
        super().__init__()
        tp = _tp(mp)
        t = tp.size if tp is not None else 1
        if cfg.n_head % t:
            raise ValueError(
                f"n_head: {cfg.n_head} is not divisible by the model-parallel degree {t}"
            )
        self.n_head, self.local_dim = cfg.n_head // t, cfg.dim // t
        d = cfg.dim
        if tp is None:
            self.qkv: nn.Module = nn.Linear(d, 3 * d, bias=cfg.bias)
            self.proj: nn.Module = nn.Linear(d, d, bias=cfg.bias)
        else:
            self.qkv = ColumnParallelLinear(d, 3 * d, tp, bias=cfg.bias, groups=3)
            self.proj = RowParallelLinear(d, d, tp, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        c = self.local_dim
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, mp: MPGroup | None = None):
        super().__init__()
        tp = _tp(mp)
        d, f = cfg.dim, cfg.mlp_ratio * cfg.dim
        if tp is None:
            self.fc: nn.Module = nn.Linear(d, f, bias=cfg.bias)
            self.proj: nn.Module = nn.Linear(f, d, bias=cfg.bias)
        else:
            self.fc = ColumnParallelLinear(d, f, tp, bias=cfg.bias)
            self.proj = RowParallelLinear(f, d, tp, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, mp: MPGroup | None = None):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg, mp)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg, mp)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx, targets)`` returns the mean loss.

    With ``mp`` (a model-parallel group of t > 1 ranks) it is tensor parallel,
    Megatron-style: heads, MLP features and the vocabulary are split t ways (see
    zeroservice/tensor_parallel.py); layer norms, position embeddings and row-parallel
    biases are replicated. For the same seed every MP degree starts from the same
    weights (each rank holds its slice of them)."""

    def __init__(self, cfg: GPTConfig, mp: MPGroup | None = None):
        super().__init__()
        self.cfg = cfg
        self.mp = tp = _tp(mp)
        if tp is not None and cfg.vocab_tiles > 1:
            raise ValueError(
                f"vocab_tiles: {cfg.vocab_tiles} with model parallelism; the vocabulary is "
                "split over the model-parallel ranks already (set vocab_tiles to 1)"
            )
        if tp is None:
            self.wte: nn.Module = nn.Embedding(cfg.vocab_size, cfg.dim)
        else:
            self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.dim, tp)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, mp) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.dim)
        if tp is not None:
            self.head: nn.Module = ColumnParallelLinear(cfg.dim, cfg.vocab_size, tp, bias=False)
        elif cfg.vocab_tiles > 1:
            self.head = TiledHead(cfg.dim, cfg.vocab_size, cfg.vocab_tiles)
        else:
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
            if isinstance(m, ColumnParallelLinear | RowParallelLinear):
                std_tp = scaled if name.endswith(("attn.proj", "mlp.proj")) else 0.02

                def draw(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
                    nn.init.normal_(weight, std=std_tp)
                    if bias is not None:
                        nn.init.zeros_(bias)

                m.init_from_full(draw)
            elif isinstance(m, VocabParallelEmbedding):
                m.init_from_full(partial(nn.init.normal_, std=0.02))
            elif isinstance(m, TiledHead):
                nn.init.normal_(m.weight, std=0.02)
            elif isinstance(m, nn.Linear):
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
        if targets is not None and isinstance(self.head, TiledHead):
            return self.head(self.ln_f(x), targets)
        logits = self.head(self.ln_f(x))
        if self.mp is not None:
            return self._parallel_output(logits, targets)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def _parallel_output(self, logits: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        """The loss from vocabulary-split logits, or the whole logits gathered."""
        mp = self.mp
        assert mp is not None
        local = logits.shape[-1]
        if targets is not None:
            return vocab_parallel_cross_entropy(
                logits.reshape(-1, local), targets.reshape(-1), mp.rank * local, mp
            )
        gathered = mp.all_gather_flat(logits.detach().reshape(-1).contiguous())
        parts = gathered.view(mp.size, *logits.shape)
        return torch.cat(list(parts), dim=-1)
