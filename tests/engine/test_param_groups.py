"""Two optimizer param groups (own lr and weight decay) train like DDP at every stage."""

from __future__ import annotations

import functools
import re

import pytest
import torch

from tests.engine.param_group_scenarios import (
    GroupSpec,
    factory_parity,
    load_groups,
    mp_two_groups,
    parity,
    rate_changed_outside,
    refused_setup,
    save_groups,
    two_groups,
)
from zeroservice.launch import run_local
from zeroservice.optim import group_of_params

SPECS = {
    **{f"adamw-stage{s}": GroupSpec(stage=s) for s in range(4)},
    **{f"sgd-stage{s}": GroupSpec(stage=s, optimizer="sgd") for s in range(4)},
    "adamw-offload-stage2": GroupSpec(stage=2, offload=True),
}


@functools.cache
def _results() -> dict[str, dict]:
    per_rank = run_local(parity, 2, list(SPECS.values()))
    return dict(zip(SPECS, per_rank[0], strict=True))


@pytest.mark.parametrize("name", list(SPECS))
def test_two_groups_match_ddp(name):
    r = _results()[name]
    torch.testing.assert_close(
        torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=1e-5, atol=0
    )
    assert [wd for wd, _ in r["groups"]] == [0.1, 0.0]
    assert r["mixed_units"] == 0
    if SPECS[name].optimizer == "sgd":
        for key, ref in r["ref_state"].items():
            torch.testing.assert_close(r["state"][key], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("saved,loaded", [(1, 3), (3, 0), (2, 2)])
def test_groups_survive_resharding(tmp_path, saved, loaded):
    path = str(tmp_path / "ckpt")
    before = run_local(save_groups, 2, GroupSpec(stage=saved, optimizer="sgd"), path)[0]
    after = run_local(load_groups, 1, GroupSpec(stage=loaded, optimizer="sgd"), path)[0]
    assert len(after) == len(before) == 2
    for b, a in zip(before, after, strict=True):
        assert (a["lr"], a["weight_decay"]) == (b["lr"], b["weight_decay"])
        assert a["states"].keys() == b["states"].keys()
        for key, value in b["states"].items():
            torch.testing.assert_close(a["states"][key], value, rtol=0, atol=0)


def _named(model):
    return [(n, p) for n, p in model.named_parameters()]


def test_groups_must_cover_every_parameter_once():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    ps = _named(model)
    with pytest.raises(ValueError, match=r"leave out \['0.bias', '1.weight'"):
        group_of_params(lambda _: torch.optim.SGD([ps[0][1]], lr=0.1), ps)

    def twice(_):
        opt = torch.optim.SGD([{"params": [ps[0][1]]}, {"params": [p for _, p in ps[1:]]}], lr=1)
        opt.param_groups[1]["params"].append(ps[0][1])  # torch checks only at construction
        return opt

    with pytest.raises(ValueError, match="0.weight is listed in param groups 0 and 1"):
        group_of_params(twice, ps)
    _, group = group_of_params(two_groups("adamw"), ps)
    assert [group[id(p)] for _, p in ps] == [0, 1, 0, 1]


@pytest.mark.parametrize(
    "factory",
    [
        lambda ps: torch.optim.Adafactor(ps),
        lambda ps: torch.optim.LBFGS(ps),
        lambda ps: torch.optim.SparseAdam(ps),
    ],
    ids=["Adafactor", "LBFGS", "SparseAdam"],
)
def test_an_optimizer_that_is_not_elementwise_is_refused_by_name(factory):
    ps = _named(torch.nn.Sequential(torch.nn.Linear(3, 3)))
    name = type(factory([p for _, p in ps])).__name__
    with pytest.raises(ValueError, match=f"optimizer: {name} updates each element from others"):
        group_of_params(factory, ps)
    group_of_params(lambda p: torch.optim.RMSprop(p, momentum=0.9), ps)


@pytest.mark.parametrize("stage", (1, 3))
def test_two_groups_with_model_parallelism(stage):
    """MP = 2 × DP = 1 trains like MP = 1 × DP = 2 with the same two groups."""
    ref, tp = run_local(mp_two_groups, 2, [stage, stage], [1, 2])[0]
    torch.testing.assert_close(torch.tensor(tp), torch.tensor(ref), rtol=1e-5, atol=0)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_rate_changed_outside_the_engine_is_refused(tmp_path, stage):
    """The engine sets every group's rate each step from the factory's and lr_schedule;
    a torch scheduler on the inner optimizer would be overwritten without a word."""
    spec = GroupSpec(stage=stage, optimizer="sgd")
    r = run_local(rate_changed_outside, 1, spec, str(tmp_path / "ckpt"))[0]
    assert r["refused"].startswith(
        "optimizer: param group 0's lr was changed outside the engine (to "
    ), r["refused"]
    assert "configure the schedule there" in r["refused"]
    assert r["retried"]  # the refusal left the step to be taken again
    assert len(r["resumed"]) == 2


FACTORY_STAGES = [0, 1, 2, 3]
FACTORY_KINDS = ["scaled", "hooked", "adagrad"]


@functools.cache
def _factory_results() -> dict[tuple[int, str], dict]:
    per_rank = run_local(factory_parity, 2, FACTORY_STAGES, FACTORY_KINDS)
    return {(r["stage"], r["kind"]): r for r in per_rank[0]}


@pytest.mark.parametrize("stage", FACTORY_STAGES)
@pytest.mark.parametrize("kind", FACTORY_KINDS)
def test_what_the_factory_sets_up_trains_as_under_ddp(stage, kind):
    """A constructor argument kept in ``defaults`` and a step hook registered in the
    factory reach the optimizer the engine rebuilds (see [Note: what the rebuild
    keeps]); without them its losses are those of plain SGD. Adagrad's constructor
    fills its state, which is not mistaken for state set in the factory."""
    r = _factory_results()[(stage, kind)]
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref"]), rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "kind,message",
    [
        ("attribute", r"ScaledSGD's attribute 'scale' is 3.0 .* but 1.0 when rebuilt"),
        ("state", r"already holds state for 28 parameters \(momentum_buffer\)"),
        ("set-after", r"has an attribute 'clip' that its constructor does not set"),
        ("state-dict-hook", r"_optimizer_state_dict_post_hooks registered"),
        ("lr-scheduler", r"has an attribute '\w+' that its constructor does not set"),
    ],
)
def test_what_a_rebuild_would_lose_is_refused_by_name(kind, message):
    (got,) = run_local(refused_setup, 1, kind)
    assert re.search(message, got), got
