"""The parameters as initialize planned them (see planned_params.py).

Which parameters train is fixed at initialize ([Note: the trainable set]): a
requires_grad flipped afterwards is refused by name at the next training forward,
before anything runs, where it used to go on training a parameter frozen since and
leave one unfrozen since as it was. A checkpoint loads into an engine with more frozen;
one whose parameter was frozen at the save is refused by name where that parameter is
trainable now.

A parameter cut off from the engine's buffers ([Note: parameters the engine holds]): a
module converted after initialize (``.bfloat16()``, ``.double()``), a new
``nn.Parameter`` assigned, ``param.data`` re-pointed, a module replaced (a new head) or
a module or parameter added. Each used to train on with weights
the optimizer never updated (stages 0-2: the losses stopped improving, every step
reported success); each is refused by name before the forward runs, and the engine
trains on once the module is put back.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zeroservice
from tests.engine.harness import mean_over_ranks
from zeroservice.checkpoint import CheckpointMismatch
from zeroservice.launch import run_local

STAGES = (0, 1, 2, 3)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


def _engine(stage: int, head_trainable: bool = True, seed: int = 0) -> zeroservice.Engine:
    torch.manual_seed(seed)
    model = _Net()
    model.head.weight.requires_grad_(head_trainable)
    return zeroservice.initialize(
        model, {"stage": stage}, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
    )


def _train(engine: zeroservice.Engine, step: int) -> float:
    x, y = _batch(step)
    loss = F.cross_entropy(engine(x), y)
    engine.backward(loss)
    engine.step()
    return mean_over_ranks(loss.item())


def _flips() -> dict:
    out = {}
    for stage in STAGES:
        for flip in ("freeze", "unfreeze"):
            engine = _engine(stage, head_trainable=flip == "freeze")
            head = engine.module.head.weight
            losses = [_train(engine, 0)]
            launched = engine.comm_ledger().launched
            head.requires_grad_(not head.requires_grad)
            try:
                _train(engine, 1)
                refused = None
            except RuntimeError as e:
                refused = str(e)
            nothing_ran = engine.micro_steps == 0 and engine.comm_ledger().launched == launched
            head.requires_grad_(not head.requires_grad)  # restored: trains on
            losses += [_train(engine, s) for s in (1, 2)]
            engine.close()
            plain = _engine(stage, head_trainable=flip == "freeze")
            expected = [_train(plain, s) for s in (0, 1, 2)]
            plain.close()
            out[(stage, flip)] = {
                "refused": refused,
                "nothing_ran": nothing_ran,
                "losses": losses,
                "expected": expected,
            }
    return out


def test_a_flag_flipped_after_initialize_is_refused_before_the_forward_runs():
    out = run_local(_flips, 2, timeout_s=300)[0]
    for (stage, flip), r in out.items():
        assert r["refused"] is not None, (stage, flip)
        said = {"freeze": "frozen", "unfreeze": "unfrozen"}[flip]
        assert f"({said} since: head.weight)" in r["refused"], (stage, flip, r["refused"])
        assert r["nothing_ran"], (stage, flip)
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(r["expected"]), rtol=1e-5, atol=0
        )


def _flipped_before_backward() -> dict:
    """The flag flipped between a forward and its backward: stage 2 failed on a bare
    assertion and stage 3 stepped the weight DDP leaves alone."""
    out = {}
    for stage in STAGES:
        engine = _engine(stage)
        losses = [_train(engine, 0)]
        x, y = _batch(1)
        loss = F.cross_entropy(engine(x), y)
        head = engine.module.head.weight
        head.requires_grad_(False)
        try:
            engine.backward(loss)
            refused = None
        except RuntimeError as e:
            refused = str(e)
        head.requires_grad_(True)
        engine.backward(loss)  # the same forward's graph, once the flag is back
        engine.step()
        losses += [mean_over_ranks(loss.item()), _train(engine, 2)]
        engine.close()
        plain = _engine(stage)
        expected = [_train(plain, s) for s in (0, 1, 2)]
        plain.close()
        out[stage] = {"refused": refused, "losses": losses, "expected": expected}
    return out


def test_a_flag_flipped_between_forward_and_backward_is_refused_and_nothing_lost():
    for stage, r in run_local(_flipped_before_backward, 2, timeout_s=300)[0].items():
        assert r["refused"] is not None, stage
        assert r["refused"].startswith("backward: requires_grad changed after initialize ("), r
        assert "frozen since: head.weight" in r["refused"], r["refused"]
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(r["expected"]), rtol=1e-5, atol=0
        )


def _reload(root: str) -> dict:
    out = {}
    for stage in STAGES:
        for saved_trainable in (True, False):
            path = os.path.join(root, f"s{stage}-{saved_trainable}")
            engine = _engine(stage, head_trainable=saved_trainable)
            _train(engine, 0)
            engine.save_checkpoint(path)
            engine.wait_for_save()
            saved = {k: v.clone() for k, v in engine.state_dict().items()}
            engine.close()
            other = _engine(stage, head_trainable=not saved_trainable, seed=1)
            before = {k: v.clone() for k, v in other.state_dict().items()}
            try:
                other.load_checkpoint(path)
                refused = None
            except CheckpointMismatch as e:
                refused = str(e)
            loaded = {k: v.clone() for k, v in other.state_dict().items()}
            _train(other, 1)
            after = other.state_dict()
            other.close()
            out[(stage, saved_trainable)] = {
                "refused": refused,
                "loaded_saved": all(torch.equal(loaded[k], saved[k]) for k in saved),
                "unchanged": all(torch.equal(loaded[k], before[k]) for k in before),
                "head_moved": not torch.equal(after["head.weight"], loaded["head.weight"]),
            }
    return out


def test_a_checkpoint_loads_with_more_frozen_and_is_refused_by_name_with_less(tmp_path):
    out = run_local(functools.partial(_reload, str(tmp_path)), 2, timeout_s=300)[0]
    for stage in STAGES:
        frozen_now = out[(stage, True)]
        assert frozen_now["refused"] is None and frozen_now["loaded_saved"], stage
        assert not frozen_now["head_moved"], stage  # frozen: the step leaves it alone
        unfrozen_now = out[(stage, False)]
        assert unfrozen_now["refused"] is not None, stage
        assert "head.weight was frozen" in unfrozen_now["refused"], unfrozen_now["refused"]
        assert "no exp_avg" in unfrozen_now["refused"], unfrozen_now["refused"]
        assert unfrozen_now["unchanged"], stage  # the engine kept what it had
        assert unfrozen_now["head_moved"], stage  # and trains on


def _frozen_for_evaluation() -> bool:
    engine = _engine(1)
    _train(engine, 0)
    params = list(engine.module.parameters())
    for p in params:
        p.requires_grad_(False)
    with torch.no_grad():
        engine(_batch(1)[0])
    for p in params:
        p.requires_grad_(True)
    _train(engine, 1)
    engine.close()
    return True


def test_flags_are_not_read_outside_training_forwards():
    """An evaluation under torch.no_grad with every parameter frozen is not refused."""
    assert all(run_local(_frozen_for_evaluation, 2, timeout_s=120))


def _cut_off(how: str, stage: int) -> dict:
    engine = _engine(stage)
    head = engine.module.head
    _train(engine, 0)
    launched = engine.comm_ledger().launched
    weight, data = head.weight, head.weight.data
    if how == "converted":
        engine.module.double()
    elif how == "replaced":
        head.weight = nn.Parameter(weight.detach().clone())
    elif how == "module replaced":  # a new head: the old one would be stepped instead
        engine.module.head = nn.Linear(16, 4)
    elif how == "module added":
        engine.module.body.append(nn.Linear(16, 16))
    elif how == "parameter added":
        engine.module.temperature = nn.Parameter(torch.ones(()))
    else:  # re-pointed
        weight.data = weight.detach().clone()
    try:
        x = _batch(1)[0]
        engine(x.to(next(engine.module.parameters()).dtype))
        refused = None
    except RuntimeError as e:
        refused = str(e)
    nothing_ran = engine.micro_steps == 0 and engine.comm_ledger().launched == launched
    restored = None
    if how != "converted":  # put back as initialize left it, the engine trains on
        if how == "replaced":
            head.weight = weight
        elif how == "module replaced":
            engine.module.head = head
        elif how == "module added":
            del engine.module.body[-1]
        elif how == "parameter added":
            del engine.module.temperature
        else:
            weight.data = data
        restored = _train(engine, 1)
    engine.close()
    return {"refused": refused, "nothing_ran": nothing_ran, "restored": restored}


def _cut_offs() -> dict:
    return {
        (how, stage): _cut_off(how, stage)
        for stage in STAGES
        for how in ("converted", "replaced", "re-pointed")
        + ("module replaced", "module added", "parameter added")
        if not (how == "re-pointed" and stage == 3)  # stage 3 re-points them itself
    }


def test_a_parameter_cut_off_from_the_engine_is_refused_before_the_forward_runs():
    out = run_local(_cut_offs, 2, timeout_s=300)[0]
    said = {
        "converted": "torch.float64 on cpu, was torch.float32 on cpu",
        "replaced": "head.weight replaced after initialize by another parameter",
        "re-pointed": "head.weight no longer view the engine's buffers",
        "module replaced": "forward: head replaced or added after initialize",
        "module added": "forward: body.4 replaced or added after initialize",
        "parameter added": "forward: temperature replaced or added after initialize",
    }
    for (how, stage), r in out.items():
        assert r["refused"] is not None, (how, stage)
        assert said[how] in r["refused"], (how, stage, r["refused"])
        assert r["nothing_ran"], (how, stage)
        if how != "converted":
            assert r["restored"] is not None, (how, stage)


def _hooked_later(stage: int, kind: str) -> dict:
    engine = _engine(stage)
    head = engine.module.head.weight
    before = head.detach().clone() if stage < 3 else None
    launched = engine.comm_ledger().launched
    if kind == "tensor":
        handle = head.register_hook(torch.zeros_like)
    else:
        handle = head.register_post_accumulate_grad_hook(lambda p: None)
    try:
        _train(engine, 0)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    out = {"refused": refused}
    if stage < 3 and kind == "tensor":  # the hook ran: a zero gradient, weight decay only
        out["decayed_only"] = torch.equal(head.detach(), before * (1 - 1e-2 * 0.1))
    if refused is not None:
        out["nothing_ran"] = engine.micro_steps == 0 and engine.comm_ledger().launched == launched
        handle.remove()
        out["losses"] = [_train(engine, s) for s in (0, 1)]
        plain = _engine(stage)
        out["expected"] = [_train(plain, s) for s in (0, 1)]
        plain.close()
    engine.close()
    return out


def _hooks_later() -> dict:
    return {
        (stage, kind): _hooked_later(stage, kind) for stage in STAGES for kind in ("tensor", "post")
    }


def test_a_gradient_hook_registered_after_initialize_is_refused_where_it_would_not_run():
    """Stage 3 computes with gathered copies: a hook registered on a parameter after
    initialize would never run (it used to be skipped without a word, so a gradient
    zeroed at stages 0-2 trained whole at stage 3). Stages 0-2 run a tensor hook; a
    post-accumulate hook registered after initialize would run after the engine's own
    had reduced (or staged and freed) the gradient, so it is refused there too."""
    out = run_local(_hooks_later, 2, timeout_s=300)[0]
    for (stage, kind), r in out.items():
        if stage < 3 and kind == "tensor":
            assert r["refused"] is None, (stage, kind, r["refused"])
            assert r["decayed_only"], stage
            continue
        assert r["refused"] is not None, (stage, kind)
        if stage < 3:
            assert (
                "head.weight carry post-accumulate gradient hooks registered after"
                in (r["refused"])
            )
        else:
            assert "head.weight carry gradient hooks registered after initialize" in r["refused"]
        assert r["nothing_ran"], kind
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(r["expected"]), rtol=1e-5, atol=0
        )
