"""A forward that changes its own weights in place (``nn.Embedding(max_norm=...)``, or
any module writing a parameter under no_grad) trains as DDP does at stage 0 in fp32,
and is refused by name elsewhere, before anything of the micro-batch is reduced (see
[Note: a forward that writes its weights] in zeroservice/forward_writes.py)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroservice
from tests.engine.harness import run_ddp, run_engine
from zeroservice.forward_writes import between_steps_reason, watch_reason
from zeroservice.launch import run_local


class _Renormed(nn.Module):
    """Looks rows up in an embedding that renormalises them in place."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 8, max_norm=1.0)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.emb((x[..., 0].abs() * 10).long() % 32)).pow(2).mean()


class _Decaying(nn.Module):
    """Shrinks one of its weights by hand in every forward."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        with torch.no_grad():
            self.inner.weight.mul_(0.99)
        return self.out(torch.tanh(self.inner(x.to(self.inner.weight.dtype)))).pow(2).mean()


MODELS = {"renormed": _Renormed, "decaying": _Decaying}


def _batches(step: int, accum: int) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(10 * step + dist.get_rank())
    return [(torch.randn(4, 5, 8, generator=g),)]


def _adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-2)


def _train(kind: str, config: dict) -> dict:
    torch.manual_seed(0)
    model = MODELS[kind]()
    out: dict = {}
    if config == {"stage": 0}:
        out["ddp"] = run_ddp(copy.deepcopy(model), _adamw, _batches, 3).losses
    engine = zeroservice.initialize(model, config, _adamw)
    before = engine.comm_ledger().launched
    try:
        out["losses"] = run_engine(engine, _batches, 3, keep_state=False).losses
    except RuntimeError as exc:
        out["error"] = str(exc)
        out["collectives_after_forward"] = engine.comm_ledger().launched - before
        out["micro_steps"] = engine.micro_steps
    engine.close()
    return out


CONFIGS = {
    "stage0": {"stage": 0},
    "stage1": {"stage": 1},
    "stage2": {"stage": 2},
    "stage3": {"stage": 3},
    "stage0-bf16": {"stage": 0, "precision": "bf16"},
}


def _all() -> dict[tuple[str, str], dict]:
    return {(k, c): _train(k, cfg) for k in MODELS for c, cfg in CONFIGS.items()}


@functools.cache
def _results() -> dict[tuple[str, str], dict]:
    return run_local(_all, 2, timeout_s=300)[0]


@pytest.mark.parametrize("kind", MODELS)
def test_stage_0_in_fp32_keeps_each_ranks_writes_as_ddp_does(kind):
    r = _results()[(kind, "stage0")]
    assert "error" not in r, r
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ddp"]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("config", ["stage1", "stage2", "stage0-bf16"])
def test_a_forward_writing_a_weight_is_refused_by_name_before_any_reduction(kind, config):
    r = _results()[(kind, config)]
    name = "emb.weight" if kind == "renormed" else "inner.weight"
    assert r["error"].startswith(f"backward: the forward changed {name} in place"), r
    assert "Train this model at stage 0 with precision 'fp32'" in r["error"]
    hint = "Embedding with max_norm renormalises the rows it looks up in place"
    assert (hint in r["error"]) == (kind == "renormed"), r["error"]
    why = "masters are the weights" if config == "stage0-bf16" else "one rank's shard"
    assert why in r["error"], r["error"]
    # Refused before the backward: no gradient collective, no micro-batch counted.
    assert r["micro_steps"] == 0
    assert r["collectives_after_forward"] == 0, r


@pytest.mark.parametrize("kind", MODELS)
def test_stage_3_names_the_weight_written_while_gathered(kind):
    """The renorm fails inside autograd (a gathered weight is a custom function's view)
    before the gatherer's own check: the engine raises the gatherer's message."""
    r = _results()[(kind, "stage3")]
    name = "emb.weight" if kind == "renormed" else "inner.weight"
    assert r["error"].startswith("stage 3: a parameter among ["), r
    assert name in r["error"] and "modified in place while gathered" in r["error"], r


def _load_after_initialize(config: dict) -> dict:
    """Pretrained weights loaded into the model after ``initialize``, then trained."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    torch.manual_seed(1)
    pretrained = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).state_dict()
    engine = zeroservice.initialize(model, config, _adamw)
    model.load_state_dict(pretrained)

    def loss(m, batch):
        dtype = next(m.module.parameters()).dtype  # DDP's module, or the engine's
        return m(batch[0].to(dtype)).float().pow(2).mean()

    out: dict = {
        "loaded": {k: torch.equal(v.float(), pretrained[k]) for k, v in engine.state_dict().items()}
    }
    reference = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    reference.load_state_dict(pretrained)
    out["ddp"] = run_ddp(reference, _adamw, _batches, 2, loss_fn=loss).losses
    try:
        out["losses"] = run_engine(engine, _batches, 2, loss_fn=loss, keep_state=False).losses
    except RuntimeError as exc:
        out["error"] = str(exc)
    # After a refusal the engine trains on (from its masters).
    out["after"] = run_engine(engine, _batches, 1, loss_fn=loss, keep_state=False).losses
    engine.close()
    return out


LOADS = {
    "stage1": {"stage": 1},
    "stage2-bf16": {"stage": 2, "precision": "bf16"},
    "stage0-offload": {"stage": 0, "offload_optimizer": True},
}


def _loads() -> dict[str, dict]:
    return {name: _load_after_initialize(cfg) for name, cfg in LOADS.items()}


@functools.cache
def _load_results() -> dict[str, dict]:
    return run_local(_loads, 2, timeout_s=300)[0]


def test_weights_loaded_after_initialize_are_kept_where_the_parameters_are_the_masters():
    """At stage 1 in fp32 each rank's shard of the parameters is its master: a load made
    alike on every rank is what trains."""
    r = _load_results()["stage1"]
    assert "error" not in r, r
    assert all(r["loaded"].values()), r["loaded"]
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ddp"]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", ["stage2-bf16", "stage0-offload"])
def test_weights_loaded_after_initialize_are_refused_where_a_master_is_apart(name):
    """With bf16 or an offloaded optimizer the next step would write the masters (the
    weights before the load) back: the first forward refuses it by name instead."""
    r = _load_results()[name]
    assert r["error"].startswith("forward: 0.weight, 0.bias, 2.weight, 2.bias changed"), r
    assert "since its last step" in r["error"] and "masters are the weights" in r["error"]
    assert "Load weights before initialize" in r["error"]
    assert len(r["after"]) == 1


def test_what_is_watched_follows_where_a_write_could_be_kept():
    assert watch_reason(0, 1, "fp32", offload=False) is None
    assert watch_reason(1, 1, "fp32", offload=False) is None  # one rank: its shard is all
    assert watch_reason(3, 2, "fp32", offload=False) is None  # the gatherer checks
    assert "one rank's shard" in (watch_reason(1, 2, "fp32", offload=False) or "")
    assert "one rank's shard" in (watch_reason(2, 4, "bf16", offload=False) or "")
    assert "'bf16' precision's fp32 masters" in (watch_reason(0, 1, "bf16", offload=False) or "")
    assert "offloaded optimizer's masters" in (watch_reason(1, 1, "fp32", offload=True) or "")
    assert between_steps_reason(1, "fp32", offload=False) is None  # the masters are shards
    assert between_steps_reason(3, "bf16", offload=False) is None  # refused as a load
    assert "masters are the weights" in (between_steps_reason(2, "fp16", offload=False) or "")


def _write_between_steps(where: str) -> dict:
    """Weight clipping after each step, as a WGAN's critic does, at stage 3."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    engine = zeroservice.initialize(model, {"stage": 3}, _adamw)
    train = functools.partial(
        run_engine, engine, _batches, 1, loss_fn=lambda m, b: m(b[0]).pow(2).mean()
    )
    out: dict = {"losses": train(keep_state=False).losses}
    with torch.no_grad():
        for p in engine.module.parameters():
            p.clamp_(-0.05, 0.05)
    try:
        if where == "forward":
            train(keep_state=False)
        else:
            engine.state_dict()
    except RuntimeError as exc:
        out["error"] = str(exc)
    out["after"] = train(keep_state=False).losses  # refused once
    engine.close()
    return out


@pytest.mark.parametrize("where", ["forward", "state_dict"])
def test_a_write_to_a_stage_3_placeholder_between_steps_is_refused_by_name(where):
    """The write lands on an empty placeholder: training on would ignore it silently."""
    r = run_local(_write_between_steps, 2, where, timeout_s=120)[0]
    assert r["error"].startswith(f"{where}: 0.weight, 0.bias, 2.weight and 1 more were written"), r
    assert "empty placeholders outside a forward" in r["error"] and len(r["after"]) == 1
