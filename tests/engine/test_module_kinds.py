"""Models built from torch's own layers train alike at every stage: recurrent layers
(which keep their own list of weight tensors), attention and encoder layers, batch norm
(buffers updated in forward), a weight-norm parametrization (weights computed from other
parameters at every forward), a lazy layer once materialised, and complex and float64
buffers (kept as built, as DDP keeps them). Stages 1-3 give stage
0's losses (rtol 1e-5); a lazy layer before its first forward is refused by name."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrizations

import zeroservice
from tests.engine.harness import run_engine
from zeroservice import ConfigError
from zeroservice.activations import checkpointed_modules
from zeroservice.construct import check_materialised, check_no_gradient_hooks
from zeroservice.launch import run_local
from zeroservice.precision import cast_floating

STAGES = (0, 1, 2, 3)


class _Head(nn.Module):
    def __init__(self, body: nn.Module, width: int):
        super().__init__()
        self.body, self.head = body, nn.Linear(width, 1)

    def forward(self, x):
        out = self.body(x)
        return self.head(out[0] if isinstance(out, tuple) else out).pow(2).mean()


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x)[0]


class _ConvNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm = nn.Conv1d(8, 8, 3, padding=1), nn.BatchNorm1d(8)

    def forward(self, x):
        return torch.relu(self.norm(self.conv(x.transpose(1, 2)))).transpose(1, 2)


class _Rotary(nn.Module):
    """A rotary embedding kept as a complex buffer (Meta's Llama: ``freqs_cis``) beside a
    float64 one: stage 3 cast both to float32, losing the rotation's imaginary part."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        angle = torch.outer(torch.arange(5.0), 1.0 / 10000 ** (torch.arange(8.0) / 8))
        freqs = torch.polar(torch.ones_like(angle), angle)
        self.register_buffer("freqs_cis", freqs, persistent=False)
        self.register_buffer("offset", torch.tensor([123456.789012345], dtype=torch.float64))

    def forward(self, x):
        rotated = torch.view_as_complex(self.inp(x).reshape(*x.shape[:-1], 8, 2)) * self.freqs_cis
        shift = (self.offset - 123456.789012345).float()  # 0 in float64, not in float32
        return torch.tanh(torch.view_as_real(rotated).flatten(-2)) + shift


def _lazy() -> nn.Module:
    model = _Head(nn.Sequential(nn.LazyLinear(8), nn.Tanh()), 8)
    model(torch.zeros(1, 5, 8))  # materialised by a first forward
    return model


MODELS = {
    "lstm": lambda: _Head(nn.LSTM(8, 16, num_layers=2, batch_first=True), 16),
    "gru": lambda: _Head(nn.GRU(8, 16, batch_first=True), 16),
    "encoder": lambda: _Head(
        nn.TransformerEncoderLayer(8, 2, 32, dropout=0.0, batch_first=True), 8
    ),
    "attention": lambda: _Head(_Attention(), 8),
    "conv-batchnorm": lambda: _Head(_ConvNorm(), 8),
    "weight-norm": lambda: _Head(parametrizations.weight_norm(nn.Linear(8, 8)), 8),
    "lazy": _lazy,
    "complex-buffer": lambda: _Head(_Rotary(), 16),
}


def _batches(step: int, accum: int) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(10 * step + dist.get_rank())
    return [(torch.randn(4, 5, 8, generator=g),)]


def _losses(kind: str, stage: int) -> list[float]:
    torch.manual_seed(0)
    engine = zeroservice.initialize(
        MODELS[kind](), {"stage": stage}, lambda ps: torch.optim.AdamW(ps, lr=1e-2)
    )
    losses = run_engine(engine, _batches, 3, keep_state=False).losses
    engine.close()
    return losses


def _all() -> dict[tuple[str, int], list[float]]:
    return {(kind, stage): _losses(kind, stage) for kind in MODELS for stage in STAGES}


@functools.cache
def _results() -> list[dict[tuple[str, int], list[float]]]:
    return run_local(_all, 2)


@pytest.mark.parametrize("kind", MODELS)
def test_every_stage_trains_torch_layers_as_stage_0(kind):
    for per_rank in _results():
        reference = torch.tensor(per_rank[(kind, 0)])
        assert reference[-1] != reference[0]
        for stage in STAGES[1:]:
            got = torch.tensor(per_rank[(kind, stage)])
            torch.testing.assert_close(got, reference, rtol=1e-5, atol=0)


def test_a_training_dtype_casts_floating_tensors_and_leaves_the_others():
    """As ``Module.bfloat16()``: ``module.to`` would make a complex buffer real."""
    model = _Rotary()
    model.register_buffer("count", torch.zeros(2, dtype=torch.int64))
    cast_floating(model, torch.float32)
    assert (model.freqs_cis.dtype, model.offset.dtype) == (torch.complex64, torch.float64)
    cast_floating(model, torch.bfloat16)
    assert model.inp.weight.dtype == model.offset.dtype == torch.bfloat16
    assert (model.freqs_cis.dtype, model.count.dtype) == (torch.complex64, torch.int64)


def test_a_lazy_layer_before_its_first_forward_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"parameters 0\.weight, 0\.bias are not initialised"):
        check_materialised(nn.Sequential(nn.LazyLinear(4)))
    check_materialised(nn.Sequential(nn.Linear(4, 4)))


def test_a_gradient_hook_on_a_parameter_is_refused_at_stage_3_by_name():
    """Stage 3's modules compute with gathered copies: a hook on the parameter itself
    would never run (stages 0-2 run it: the parameters stay what autograd sees)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    check_no_gradient_hooks(model)
    model[1].weight.register_hook(lambda g: 3 * g)
    with pytest.raises(ConfigError, match=r"stage: 3 .* 1\.weight carry gradient hooks"):
        check_no_gradient_hooks(model)
    other = nn.Linear(4, 4)
    other.bias.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(ConfigError, match=r"bias carry gradient hooks"):
        check_no_gradient_hooks(other)


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.proj = parametrizations.weight_norm(nn.Linear(8, 8))


def test_activation_checkpointing_takes_the_outermost_lists_items_as_blocks():
    """A block's own list (its experts) is recomputed with the block, and a weight-norm
    parametrization's list computes a weight: neither is checkpointed on its own."""
    model = nn.Module()
    model.blocks = nn.ModuleList(_Experts() for _ in range(3))
    model.norm = parametrizations.weight_norm(nn.Linear(8, 8))
    assert [name for name, _ in checkpointed_modules(model)] == ["blocks.0", "blocks.1", "blocks.2"]
    assert checkpointed_modules(_Experts().proj) == []
    # Items that are containers are never called: their items are the blocks.
    model.blocks = nn.ModuleList([nn.ModuleDict({"attn": _Experts(), "mlp": nn.Linear(8, 8)})])
    model.blocks.append(nn.ModuleList([nn.ModuleDict({"x": nn.Linear(8, 8)})]))
    names = [name for name, _ in checkpointed_modules(model)]
    assert names == ["blocks.0.attn", "blocks.0.mlp", "blocks.1.0.x"]
    root = nn.ModuleList(_Experts() for _ in range(2))  # the root itself a list
    assert [name for name, _ in checkpointed_modules(root)] == ["0", "1"]


def _wrapped_refusals() -> dict[str, str]:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    def inner_fsdp() -> nn.Module:
        model = _Head(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), 8)
        fully_shard(model.body)
        return model

    wrappers = {
        "ddp": lambda: DDP(_Head(nn.Linear(8, 8), 8)),
        "data-parallel": lambda: nn.DataParallel(_Head(nn.Linear(8, 8), 8)),
        "inner-ddp": lambda: _Head(DDP(nn.Linear(8, 8)), 8),
        "inner-fsdp": inner_fsdp,
    }
    out = {}
    for name, build in wrappers.items():
        try:
            zeroservice.initialize(build(), {"stage": 1}, lambda ps: torch.optim.SGD(ps, lr=0.1))
            out[name] = "accepted"
        except ConfigError as exc:
            out[name] = str(exc)
    return out


def test_a_model_in_another_data_parallel_wrapper_is_refused_by_name():
    """DDP, DataParallel or FSDP around the model (or inside it) would reduce or shard
    what the engine reduces and shards: refused before anything is built."""
    r = run_local(_wrapped_refusals, 2)[0]
    assert r["ddp"].startswith("model: the model is a DistributedDataParallel"), r
    assert r["data-parallel"].startswith("model: the model is a DataParallel"), r
    assert r["inner-ddp"].startswith("model: body is a DistributedDataParallel"), r
    assert r["inner-fsdp"].startswith("model: body is a FSDP"), r
    assert all("pass the bare module" in m for m in r.values()), r
