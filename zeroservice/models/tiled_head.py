"""The output head and its cross-entropy in vocabulary tiles (``GPTConfig.vocab_tiles``).

[Note: vocabulary tiles]
``F.cross_entropy(head(x).float())`` holds the whole logits (tokens x vocabulary), their
log-softmax for its backward, and in backward three tensors of that size at its first
node and the logits' gradient at the head's: on the 106 M GPT (vocabulary 32000, 512
tokens a rank) each is 62.5 MiB. ``TiledHead`` computes the same loss one slice of the
vocabulary at a time: the forward keeps a running log-sum-exp and the target's logit
per token, and saves only those (and the head's input and weight, which the head's
own backward saves anyway); its backward computes each slice's logits again, turns
them into that slice's softmax gradient, and adds its products into the input's
gradient (in fp32) and writes them into the weight's. Nothing of tokens x vocabulary
exists beyond one tile, for one more product of the head per step (the recomputed
logits). Under ZeRO stage 3 the weight is gathered whole for the head, as for a
Linear. The loss is the same function of the same logits: equal to the untiled one
up to float rounding (the log-sum-exp is accumulated tile by tile).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
"""Targets equal to it count for nothing, as in ``F.cross_entropy``."""


def tile_bounds(vocab: int, tiles: int) -> list[tuple[int, int]]:
    """``tiles`` slices of ``range(vocab)``, as equal as whole rows allow (the last may
    be shorter)."""
    width = -(-vocab // tiles)
    return [(start, min(start + width, vocab)) for start in range(0, vocab, width)]


def _accumulation_dtype(hidden: torch.Tensor) -> torch.dtype:
    """fp32 for 16-bit and fp32 inputs (as ``.float()`` before the loss), else theirs."""
    return torch.promote_types(hidden.dtype, torch.float32)


class _TiledCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``, a tile at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, tiles: int):
        n, acc = hidden.shape[0], _accumulation_dtype(hidden)
        running_max = torch.full((n,), -math.inf, dtype=acc, device=hidden.device)
        running_sum = torch.zeros(n, dtype=acc, device=hidden.device)
        target_logit = torch.zeros(n, dtype=acc, device=hidden.device)
        for start, end in tile_bounds(weight.shape[0], tiles):
            logits = (hidden @ weight[start:end].t()).to(acc)
            tile_max = torch.maximum(running_max, logits.amax(dim=1))
            running_sum.mul_(torch.exp(running_max - tile_max))
            running_sum.add_(torch.exp(logits - tile_max[:, None]).sum(dim=1))
            running_max = tile_max
            inside = (targets >= start) & (targets < end)
            rows = inside.nonzero().squeeze(1)
            target_logit[rows] = logits[rows, targets[rows] - start]
            del logits
        log_sum_exp = running_max + running_sum.log()
        valid = targets != IGNORE_INDEX
        count = valid.sum()
        loss = torch.where(valid, log_sum_exp - target_logit, 0.0).sum() / count
        ctx.tiles = tiles
        ctx.save_for_backward(hidden, weight, targets, log_sum_exp, count)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets, log_sum_exp, count = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = _accumulation_dtype(hidden)
        scale = (grad_loss / count).to(acc)
        valid = (targets != IGNORE_INDEX).to(acc) * scale
        grad_hidden = (
            torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if want_hidden else None
        )
        grad_weight = torch.empty_like(weight) if want_weight else None
        for start, end in tile_bounds(weight.shape[0], ctx.tiles):
            w = weight[start:end]
            # The softmax's gradient, in place: exp(logits - lse) - one_hot, times scale.
            grad = (hidden @ w.t()).to(acc).sub_(log_sum_exp[:, None]).exp_()
            rows = ((targets >= start) & (targets < end)).nonzero().squeeze(1)
            grad[rows, targets[rows] - start] -= 1.0
            grad.mul_(valid[:, None])
            grad = grad.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden.add_(grad @ w)
            if grad_weight is not None:
                torch.mm(grad.t(), hidden, out=grad_weight[start:end])
            del grad
        out_hidden = grad_hidden.to(hidden.dtype) if grad_hidden is not None else None
        return out_hidden, grad_weight, None, None


def tiled_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, tiles: int
) -> torch.Tensor:
    """``F.cross_entropy((hidden @ weight.T).float(), targets)`` (mean, ignoring
    ``IGNORE_INDEX``) in ``tiles`` vocabulary tiles. ``hidden``: (tokens, dim);
    ``weight``: (vocabulary, dim); ``targets``: (tokens,). See [Note: vocabulary tiles]."""
    if tiles < 1:
        raise ValueError(f"tiles: must be >= 1, got {tiles}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}: expected "
            "(tokens, dim) and (vocabulary, dim)"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)}: expected ({hidden.shape[0]},)")
    vocab = weight.shape[0]
    outside = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= vocab))
    if bool(outside.any()):
        bad = targets[outside][0].item()
        raise ValueError(f"targets: {bad} is not a token of the vocabulary [0, {vocab})")
    return _TiledCrossEntropy.apply(hidden, weight, targets, tiles)


class TiledHead(nn.Module):
    """A bias-free output head (``weight``: vocabulary x dim, as ``nn.Linear``'s) whose
    ``forward(x, targets)`` is the mean cross-entropy, computed in ``tiles`` vocabulary
    tiles; without targets it returns the logits, whole."""

    def __init__(self, dim: int, vocab_size: int, tiles: int):
        super().__init__()
        if not 1 <= tiles <= vocab_size:
            raise ValueError(f"vocab_tiles: must be in [1, {vocab_size}], got {tiles}")
        self.tiles = tiles
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s, drawing as many random numbers: a GPT draws the same weights
        with or without tiles (``GPT.initializer`` then sets GPT-2's)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight
        if targets is None:
            return F.linear(x, weight)
        return tiled_cross_entropy(
            x.reshape(-1, x.shape[-1]), weight, targets.reshape(-1), self.tiles
        )

    def extra_repr(self) -> str:
        return f"dim={self.weight.shape[1]}, vocab_size={self.weight.shape[0]}, tiles={self.tiles}"
