"""At stage 3 the model's own state_dict() and load_state_dict() would read and write
empty placeholders: both are refused by name, before and after close(), while
engine.state_dict() returns the whole weights (see [Note: a stage-3 model's own state
dict] in zeroservice/placeholder_state.py)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import zeroservice
from zeroservice.launch import run_local


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))


def _attempt(fn) -> str:
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    return "ok"


def _probe(stage: int) -> dict:
    model = _model()
    whole = {k: v.clone() for k, v in _model().state_dict().items()}
    engine = zeroservice.initialize(model, {"stage": stage}, lambda ps: torch.optim.SGD(ps, lr=0.1))
    out = {
        "engine": {k: torch.equal(v, whole[k]) for k, v in engine.state_dict().items()},
        "save": _attempt(model.state_dict),
        "load": _attempt(lambda: model.load_state_dict(whole)),
        "load_buffers": _attempt(
            lambda: model.load_state_dict({"1.running_mean": torch.ones(16)}, strict=False)
        ),
    }
    engine.close()
    out["save_after_close"] = _attempt(model.state_dict)
    return out


def _both() -> dict[int, dict]:
    return {stage: _probe(stage) for stage in (2, 3)}


@functools.cache
def _results() -> dict[int, dict]:
    return run_local(_both, 2, timeout_s=120)[0]


def test_the_models_own_state_dict_is_refused_by_name_at_stage_3():
    r = _results()[3]
    for key in ("save", "save_after_close"):
        assert r[key].startswith("state_dict: at stage 3 0.weight, 0.bias are empty"), r[key]
        assert "Call engine.state_dict() on every rank" in r[key]


def test_loading_the_models_weights_is_refused_by_name_and_its_buffers_load():
    r = _results()[3]
    assert r["load"].startswith("load_state_dict: at stage 3 0.weight, 0.bias live in shards")
    assert "engine.load_checkpoint(path)" in r["load"]
    assert r["load_buffers"] == "ok"


def test_the_engines_state_dict_is_the_whole_model():
    r = _results()[3]
    assert r["engine"] and all(r["engine"].values()), r["engine"]


@pytest.mark.parametrize("key", ["save", "load", "save_after_close"])
def test_below_stage_3_the_model_keeps_its_own_state_dict(key):
    assert _results()[2][key] == "ok"
