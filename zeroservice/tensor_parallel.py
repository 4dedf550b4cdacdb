"""Megatron-style tensor parallelism: column/row-parallel linears, vocab-parallel
embedding and cross-entropy, over one model-parallel (MP) group.

[Note: tensor parallel]
A column-parallel linear keeps rows ``[r·out/t, (r+1)·out/t)`` of the weight: each MP
rank computes a slice of the output features from the whole input. A row-parallel
linear keeps the matching columns: each rank multiplies its slice of the features
and the partial products are summed by one all-reduce. An MLP or attention block is
column then row: one all-reduce in forward (``_ReduceFromMP``) and one in backward
(``_CopyToMP``, the input gradient of the column layer). The embedding keeps a slice
of the vocabulary (ids outside it give zeros; the all-reduce sums the one non-zero
row) and the loss never gathers the logits: max, sum of exponentials and the target
logit are each all-reduced as (tokens,)-sized vectors.

Parameters sharded across MP ranks carry ``mp_sharded = True``; the engine counts
them once per MP rank in the global gradient norm and everything else (replicated:
layer norms, row-parallel biases, position embeddings) once in all.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import comm
from .interrupt import Interrupt


class MPGroup:
    """The model-parallel group and a ledger of what its collectives moved.

    An engine built over the model attaches its Interrupt to every MPGroup of the
    model (``Engine.interrupt`` then ends their waits too) and detaches it on close: a
    rank whose MP partner left a step part-way would otherwise wait in a tensor-
    parallel all-reduce for the group's timeout, and the group could not re-form."""

    def __init__(self, group: dist.ProcessGroup | None, interrupt: Interrupt | None = None):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.ledger = comm.CommLedger()
        self.comm = comm.Communicator(group, self.ledger, "native", interrupt=interrupt)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.size > 1:
            self.comm.all_reduce(tensor, "mp", op).wait()
        return tensor

    def all_gather_flat(self, chunk: torch.Tensor) -> torch.Tensor:
        """Concatenate equal 1-D chunks of all MP ranks (rank order)."""
        out = torch.empty(chunk.numel() * self.size, dtype=chunk.dtype, device=chunk.device)
        self.comm.chunk(out).copy_(chunk)
        if self.size > 1:
            self.comm.all_gather(out, "activations").wait()
        return out

    def split(self, n: int, what: str) -> int:
        if n % self.size:
            raise ValueError(
                f"{what}: {n} is not divisible by the model-parallel degree {self.size}"
            )
        return n // self.size


def mp_groups_of(module: nn.Module) -> list[MPGroup]:
    """The distinct MPGroups a model's tensor-parallel layers hold."""
    groups = {
        id(g): g for m in module.modules() if isinstance(g := getattr(m, "mp", None), MPGroup)
    }
    return list(groups.values())


def mark_sharded(*params: nn.Parameter, axis: int = 0, groups: int = 1) -> None:
    """Each rank holds a slice of these along ``axis``; with ``groups`` > 1 the axis
    stacks that many tensors (q, k, v), each split on its own. A checkpoint records
    it (``mp_split``), so that an export can put the whole tensor back together."""
    for p in params:
        p.mp_sharded = True  # type: ignore[attr-defined]
        p.mp_split = (axis, groups)  # type: ignore[attr-defined]


def is_mp_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "mp_sharded", False))


def mp_split(param: torch.Tensor) -> tuple[int, int] | None:
    """(axis, groups) of a sharded parameter (see ``mark_sharded``); None: replicated."""
    return getattr(param, "mp_split", None) if is_mp_sharded(param) else None


def merge_mp_slices(slices: list[torch.Tensor], axis: int, groups: int) -> torch.Tensor:
    """The whole tensor from every MP rank's slice, in rank order: the inverse of the
    layers' ``shard``."""
    shape = slices[0].shape
    before, after = shape[:axis], shape[axis + 1 :]
    grouped = [t.reshape(*before, groups, shape[axis] // groups, *after) for t in slices]
    whole = torch.cat(grouped, dim=axis + 1)
    return whole.reshape(*before, shape[axis] * len(slices), *after)


class _CopyToMP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient in backward."""

    @staticmethod
    def forward(ctx, x, mp: MPGroup):
        ctx.mp = mp
        return x

    @staticmethod
    def backward(ctx, grad):
        return ctx.mp.all_reduce(grad.contiguous().clone()), None


class _ReduceFromMP(torch.autograd.Function):
    """All-reduce forward; identity backward."""

    @staticmethod
    def forward(ctx, x, mp: MPGroup):
        return mp.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_mp(x: torch.Tensor, mp: MPGroup) -> torch.Tensor:
    return _CopyToMP.apply(x, mp) if mp.size > 1 else x


def reduce_from_mp(x: torch.Tensor, mp: MPGroup) -> torch.Tensor:
    return _ReduceFromMP.apply(x, mp) if mp.size > 1 else x


def _linear_default_init(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """nn.Linear's own initialisation (the same draws from the same generator)."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1 / math.sqrt(weight.shape[1]) if weight.shape[1] > 0 else 0
        nn.init.uniform_(bias, -bound, bound)


class _ParallelLinear(nn.Module):
    """Shared by the column and row variants: full shape, shard rule, initialisation.

    [Note: sliced initialisation]
    Weights are initialised by drawing the *full* tensor (one layer at a time) and
    keeping this rank's slice, so a model built with any MP degree starts from exactly
    the weights the unsplit model gets from the same seed."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self, in_features: int, out_features: int, mp: MPGroup, bias: bool):
        super().__init__()
        self.mp = mp
        self.in_features, self.out_features = in_features, out_features

    def shard(self, full: torch.Tensor, name: str) -> torch.Tensor:
        raise NotImplementedError

    def reset_parameters(self) -> None:
        self.init_from_full(_linear_default_init)

    def init_from_full(self, init) -> None:
        """Run ``init(full_weight, full_bias)`` on full-size tensors and keep the slices."""
        if self.weight.is_meta:
            return
        device = self.weight.device
        weight = torch.empty(self.out_features, self.in_features, device=device)
        bias = torch.empty(self.out_features, device=device) if self.bias is not None else None
        init(weight, bias)
        with torch.no_grad():
            self.weight.copy_(self.shard(weight, "weight"))
            if self.bias is not None and bias is not None:
                self.bias.copy_(self.shard(bias, "bias"))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, mp={self.mp.size}"


class ColumnParallelLinear(_ParallelLinear):
    """``y[..., slice_r] = x W_rᵀ + b_r``: output features split across MP ranks.

    ``groups`` > 1 splits each of that many stacked outputs (q, k, v) separately, so
    every rank gets whole heads of each."""

    def __init__(
        self, in_features: int, out_features: int, mp: MPGroup, bias: bool = True, groups: int = 1
    ):
        super().__init__(in_features, out_features, mp, bias)
        self.groups = groups
        local = mp.split(out_features // groups, "out_features") * groups
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = nn.Parameter(torch.empty(local)) if bias else None
        mark_sharded(*(p for p in (self.weight, self.bias) if p is not None), groups=groups)
        self.reset_parameters()

    def shard(self, full: torch.Tensor, name: str) -> torch.Tensor:
        per = full.shape[0] // self.groups
        local = per // self.mp.size
        rows = full.reshape(self.groups, per, *full.shape[1:])
        piece = rows[:, self.mp.rank * local : (self.mp.rank + 1) * local]
        return piece.reshape(self.groups * local, *full.shape[1:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_mp(x, self.mp), self.weight, self.bias)


class RowParallelLinear(_ParallelLinear):
    """``y = Σ_r x[..., slice_r] W_rᵀ + b``: input features split, outputs all-reduced."""

    def __init__(self, in_features: int, out_features: int, mp: MPGroup, bias: bool = True):
        super().__init__(in_features, out_features, mp, bias)
        local = mp.split(in_features, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        mark_sharded(self.weight, axis=1)  # the bias is added after the sum: replicated
        self.reset_parameters()

    def shard(self, full: torch.Tensor, name: str) -> torch.Tensor:
        if name == "bias":
            return full
        local = full.shape[1] // self.mp.size
        return full[:, self.mp.rank * local : (self.mp.rank + 1) * local]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_mp(F.linear(x, self.weight), self.mp)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Rows ``[r·V/t, (r+1)·V/t)`` of the embedding; other ids read as zeros, then summed."""

    def __init__(self, num_embeddings: int, dim: int, mp: MPGroup):
        super().__init__()
        self.mp = mp
        self.num_embeddings, self.dim = num_embeddings, dim
        self.local = mp.split(num_embeddings, "vocab_size")
        self.start = mp.rank * self.local
        self.weight = nn.Parameter(torch.empty(self.local, dim))
        mark_sharded(self.weight)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.init_from_full(nn.init.normal_)

    def init_from_full(self, init) -> None:
        """See [Note: sliced initialisation]."""
        if self.weight.is_meta:
            return
        full = torch.empty(self.num_embeddings, self.dim, device=self.weight.device)
        init(full)
        with torch.no_grad():
            self.weight.copy_(full[self.start : self.start + self.local])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_mp(out, self.mp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy over rows of logits split by vocabulary across MP ranks."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, start: int, mp: MPGroup):
        ctx.dtype = logits.dtype
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        global_max = mp.all_reduce(local_max.clone(), dist.ReduceOp.MAX)
        shifted = logits - global_max.unsqueeze(-1)
        local = targets - start
        outside = (local < 0) | (local >= logits.shape[-1])
        safe = local.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
        target_logit = mp.all_reduce(target_logit.masked_fill(outside, 0.0))
        exp = shifted.exp()
        sum_exp = mp.all_reduce(exp.sum(dim=-1))
        loss = (sum_exp.log() - target_logit).mean()
        ctx.save_for_backward(exp, sum_exp, safe, outside)
        return loss

    @staticmethod
    def backward(ctx, grad):
        exp, sum_exp, safe, outside = ctx.saved_tensors
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        softmax[rows, safe] -= (~outside).to(softmax.dtype)
        return softmax.mul_(grad / softmax.shape[0]).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, start: int, mp: MPGroup
) -> torch.Tensor:
    """``logits``: (tokens, V/t) this rank's vocabulary slice starting at ``start``."""
    return _VocabParallelCrossEntropy.apply(logits, targets, start, mp)
