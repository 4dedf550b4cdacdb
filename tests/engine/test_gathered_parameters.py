"""``engine.gathered_parameters()``: whole weights between steps at every stage (see
[Note: gathered parameters] in zeroservice/gathered.py). An EMA of the weights kept
through it equals the same EMA under DDP; a change made by ``modifier_rank`` trains as
the same change under DDP; without one, a stage-3 write is refused and loses nothing."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroservice
from zeroservice.launch import run_local

from .harness import mean_over_ranks, weight_ratio

STAGES = (0, 1, 2, 3)
STEPS = 4
CONFIG = {"bucket_elements": 1024}


class _Net(nn.Module):
    """Three layers of distinct sizes, so that at bucket_elements 1024 each forms its
    own units: gathering ``head`` alone leaves ``embed``'s placeholders empty."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 64)
        self.mid = nn.Linear(64, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x, y):
        h = torch.tanh(self.mid(torch.tanh(self.embed(x))))
        return nn.functional.cross_entropy(self.head(h).float(), y)


def _net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _batch(step: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(6, 8, generator=g).to(dtype), torch.randint(0, 4, (6,), generator=g)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def _ema_update(ema: dict[str, torch.Tensor], model: nn.Module) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            ema.setdefault(name, p.detach().float().clone()).lerp_(p.float(), 0.3)


def _halve_head(model: nn.Module, factor: float) -> None:
    with torch.no_grad():
        model.head.weight.mul_(factor)


def _ddp_run() -> dict:
    """The reference: an EMA after every step, the head halved after step 1."""
    model = _net()
    ddp, ema, losses = DDP(model), {}, []
    opt = _sgd(model.parameters())
    for step in range(STEPS):
        loss = ddp(*_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(mean_over_ranks(loss.item()))
        _ema_update(ema, model)
        if step == 1:
            _halve_head(model, 0.5)
    return {"losses": losses, "ema": ema}


def _engine_run(stage: int, extra: dict) -> dict:
    model = _net()
    engine = zeroservice.initialize(model, {"stage": stage, **CONFIG, **extra}, _sgd)
    dtype = torch.bfloat16 if extra.get("precision") == "bf16" else torch.float32
    ema: dict[str, torch.Tensor] = {}
    losses, masters_kept = [], None
    for step in range(STEPS):
        loss = engine(*_batch(step, dtype))
        engine.backward(loss)
        engine.step()
        losses.append(mean_over_ranks(loss.item()))
        with engine.gathered_parameters():
            _ema_update(ema, model)
        if step == 1:
            before = [m.detach().clone() for m in engine.optimizer.masters]
            # Rank 0's write is overwritten by the modifier's.
            with engine.gathered_parameters(model.head, modifier_rank=1):
                _halve_head(model, 0.5 if engine.dp_rank == 1 else 3.0)
            masters_kept = _masters_outside_head(engine, before)
    empty = [p.numel() == 0 for p in model.parameters()]
    engine.close()
    return {"losses": losses, "ema": ema, "empty": empty, "masters_kept": masters_kept}


def _masters_outside_head(engine, before: list[torch.Tensor]) -> bool:
    """On every rank, every master element outside the head's weight kept its fp32
    value exactly."""
    kept = True
    units, masters = engine.trainable_units, engine.optimizer.masters
    for unit, master, was in zip(units, masters, before, strict=True):
        keep = torch.ones(unit.padded_numel, dtype=torch.bool)
        for slot in unit.slots:
            if "head.weight" in slot.names:
                keep[slot.offset : slot.offset + slot.numel] = False
        if master.numel() != keep.numel():  # a shard of the unit
            keep = engine.comm.chunk(keep)
        kept = kept and torch.equal(master.detach()[keep], was[keep])
    everywhere = torch.tensor([int(kept)])
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
    return bool(everywhere.item())


def _all_runs() -> dict:
    out: dict = {"ddp": _ddp_run()}
    for stage in STAGES:
        out[stage, "fp32"] = _engine_run(stage, {})
        out[stage, "bf16"] = _engine_run(stage, {"precision": "bf16"})
    out[2, "host-copy"] = _engine_run(2, {"redundancy": "host-copy"})
    return out


@functools.cache
def _runs() -> dict:
    return run_local(_all_runs, 2, timeout_s=240)[0]


@pytest.mark.parametrize("stage", STAGES)
def test_an_ema_kept_through_gathered_parameters_equals_ddps(stage):
    ref, got = _runs()["ddp"], _runs()[stage, "fp32"]
    assert weight_ratio(got["ema"], ref["ema"]) <= 1.0
    assert got["empty"] == [stage == 3] * 6  # stage 3: placeholders empty again


@pytest.mark.parametrize("variant", [(s, "fp32") for s in STAGES] + [(2, "host-copy")])
def test_the_modifier_ranks_write_trains_as_the_same_write_under_ddp(variant):
    ref, got = _runs()["ddp"], _runs()[variant]
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("stage", STAGES)
def test_a_write_in_bf16_keeps_the_fp32_masters_of_what_it_left_alone(stage):
    got = _runs()[stage, "bf16"]
    assert got["masters_kept"] is True
    # The head halved: the loss after the write moves as DDP's does (bf16 tolerance).
    torch.testing.assert_close(got["losses"], _runs()["ddp"]["losses"], rtol=3e-2, atol=0)


def _attempt(fn) -> str:
    try:
        fn()
    except (RuntimeError, ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _refusals() -> dict:
    model = _net()
    engine = zeroservice.initialize(model, {"stage": 3, **CONFIG}, _sgd)
    whole = engine.state_dict()
    out: dict = {}

    def write_without_modifier():
        with engine.gathered_parameters():
            _halve_head(model, 0.5)

    out["write"] = _attempt(write_without_modifier)
    out["unchanged"] = all(torch.equal(v, whole[k]) for k, v in engine.state_dict().items())

    def subset():
        with engine.gathered_parameters([model.head.weight]):
            out["subset"] = (model.head.weight.shape, model.embed.weight.numel())

    subset()

    def forward_inside():
        with engine.gathered_parameters():
            engine(*_batch(0))

    out["forward"] = _attempt(forward_inside)

    def step_inside():
        engine.backward(engine(*_batch(0)))
        with engine.gathered_parameters():
            engine.step()

    out["step"] = _attempt(step_inside)
    out["modify_mid_step"] = _attempt(
        lambda: engine.gathered_parameters(modifier_rank=0).__enter__()
    )
    engine.step()

    def nested():
        with engine.gathered_parameters(), engine.gathered_parameters():
            pass

    out["nested"] = _attempt(nested)
    out["other_module"] = _attempt(lambda: engine.gathered_parameters(nn.Linear(2, 2)))
    out["copy"] = _attempt(lambda: engine.gathered_parameters([torch.zeros(3)]))
    out["kind"] = _attempt(lambda: engine.gathered_parameters("head"))
    out["rank"] = _attempt(lambda: engine.gathered_parameters(modifier_rank=2))
    # After all of it the engine trains on.
    engine.backward(engine(*_batch(1)))
    out["trains"] = engine.step().applied
    engine.close()
    return out


@functools.cache
def _refused() -> dict:
    return run_local(_refusals, 2, timeout_s=120)[0]


def test_a_stage_3_write_without_modifier_rank_is_refused_and_changes_nothing():
    r = _refused()
    assert r["write"].startswith("RuntimeError: gathered_parameters: head.weight were written")
    assert "modifier_rank" in r["write"]
    assert r["unchanged"]


def test_only_the_units_asked_for_are_gathered():
    assert _refused()["subset"] == (torch.Size([4, 32]), 0)


@pytest.mark.parametrize(
    ("key", "start"),
    [
        ("forward", "RuntimeError: forward: inside engine.gathered_parameters() at stage 3"),
        ("step", "RuntimeError: step: inside engine.gathered_parameters()"),
        ("modify_mid_step", "RuntimeError: gathered_parameters(modifier_rank=...): the engine"),
        ("nested", "RuntimeError: gathered_parameters: already inside"),
        ("other_module", "ValueError: gathered_parameters: the module given (Linear) is not"),
        ("copy", "ValueError: gathered_parameters: params[0] (shape (3,)) is not a parameter"),
        ("kind", "TypeError: gathered_parameters: params must be None, a module"),
        ("rank", "ValueError: gathered_parameters: modifier_rank must be None or a"),
    ],
)
def test_misuses_are_refused_by_name_and_the_engine_trains_on(key, start):
    r = _refused()
    assert r[key].startswith(start), r[key]
    assert r["trains"] is True
