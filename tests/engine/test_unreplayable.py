"""What a checkpointed block's recomputation cannot replay is refused by name (see
[Note: what a recomputation cannot replay] in activations.py).

A transformers decoder passes its key/value cache to every block (``use_cache`` is on by
default): the recomputation appended to it a second time and attended over stale keys,
and GPT-2's losses left DDP's by 2e-3 within three steps. ``initialize`` now turns the
config's cache off with a warning (and GPT-2 trains to the losses of data parallelism
written out by hand at every stage, rtol 1e-5), and a cache passed to a training forward
is refused. A tensor kept by a forward hook inside a block (features for a
distillation loss; transformers' MoE router logits, recorded by replacing the router's
forward during the call) was computed without autograd, so its loss term trained
nothing: such hooks and forwards are refused at the forward.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zeroservice
from tests.engine.harness import ResidualBlocks, average_gradients, mean_over_ranks
from zeroservice.launch import run_local

STAGES = (0, 1, 2, 3)
VOCAB, SEQ = 64, 8


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def _tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randint(0, VOCAB, (2, SEQ), generator=g)


def _by_hand(model: nn.Module, steps: int) -> list[float]:
    """Data parallelism written out: each rank's replica, gradients averaged by hand."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        ids = _tokens(step)
        loss = model(ids, labels=ids).loss
        loss.backward()
        average_gradients(model)
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss.item()))
    return losses


def _checkpointed_gpt2(steps: int) -> dict:
    out: dict = {"expected": _by_hand(_gpt2(), steps)}
    for stage in STAGES:
        model = _gpt2()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine = zeroservice.initialize(
                model,
                {"stage": stage, "activation_checkpointing": True},
                lambda ps: torch.optim.AdamW(ps, lr=1e-2),
            )
        losses = []
        for step in range(steps):
            ids = _tokens(step)
            loss = engine(ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(mean_over_ranks(loss.item()))
        try:
            engine(_tokens(0), labels=_tokens(0), use_cache=True)
            refused = None
        except ValueError as e:
            refused = str(e)
        engine.close()
        out[stage] = {
            "twice": _checkpointed_twice() if stage == 0 else None,
            "losses": losses,
            "warned": [str(w.message) for w in caught if "use_cache" in str(w.message)],
            "use_cache": model.config.use_cache,
            "refused": refused,
        }
    return out


def _checkpointed_twice() -> str | None:
    model = _gpt2()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        zeroservice.initialize(
            model, {"activation_checkpointing": True}, lambda ps: torch.optim.AdamW(ps)
        ).close()
    except zeroservice.ConfigError as e:
        return str(e)
    return None


def test_a_transformers_decoder_trains_checkpointed_without_its_cache():
    pytest.importorskip("transformers")
    out = run_local(functools.partial(_checkpointed_gpt2, 4), 2, timeout_s=300)[0]
    for stage in STAGES:
        r = out[stage]
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(out["expected"]), rtol=1e-5, atol=0
        )
        assert len(r["warned"]) == 1 and "use_cache set to False" in r["warned"][0], stage
        assert r["use_cache"] is False
        assert r["refused"] is not None, stage
        assert "transformer.h.0 is called with a key/value cache" in r["refused"], r["refused"]
        assert "use_cache=False" in r["refused"]
    # Its own gradient checkpointing and the engine's: refused at initialize.
    twice = out[0]["twice"]
    assert twice is not None and "the model checkpoints its own blocks" in twice, twice
    assert "gradient_checkpointing on in transformer, transformer.h.0" in twice, twice


def _kept(how: str, stage: int) -> dict:
    """A distillation-style loss on features an inner module's output gives."""
    torch.manual_seed(0)
    model = ResidualBlocks(lambda: nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)))
    engine = zeroservice.initialize(
        model,
        {"stage": stage, "activation_checkpointing": True},
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    )
    kept: list[torch.Tensor] = []
    inner = model.blocks[1][1]
    if how == "hook":
        handle = inner.register_forward_hook(lambda m, i, o: kept.append(o))
    elif how == "global":
        handle = nn.modules.module.register_module_forward_hook(
            lambda m, i, o: kept.append(o) if m is inner else None
        )
    else:  # a forward replaced on the instance, as transformers records outputs
        original = inner.forward

        def recording(*args):
            kept.append(original(*args))
            return kept[-1]

        inner.forward = recording
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
    launched = engine.comm_ledger().launched
    try:
        engine(x)
        refused = None
    except ValueError as e:
        refused = str(e)
    if how == "replaced":
        del inner.forward
    else:
        handle.remove()
    nothing_ran = engine.comm_ledger().launched == launched and engine.micro_steps == 0
    loss = F.cross_entropy(engine(x), y)  # without the hook: trains on
    engine.backward(loss)
    engine.step()
    engine.close()
    # At stage 3 the forward gathers the root's units before it reaches a block.
    return {"refused": refused, "nothing_ran": nothing_ran or stage == 3}


def _kepts() -> dict:
    return {(how, s): _kept(how, s) for how in ("hook", "global", "replaced") for s in STAGES}


def test_a_tensor_kept_from_inside_a_checkpointed_block_is_refused_by_name():
    out = run_local(_kepts, 2, timeout_s=300)[0]
    for (how, stage), r in out.items():
        assert r["refused"] is not None, (how, stage)
        # A global hook runs inside every block: the first refuses it.
        block, where = ("blocks.0", "every module (a global forward hook)")
        if how != "global":
            block, where = ("blocks.1", "blocks.1.1")
        assert f"inside checkpointed block {block}," in r["refused"], r["refused"]
        assert where in r["refused"], (how, r["refused"])
        assert r["nothing_ran"], (how, stage)
        assert "would carry no gradient" in r["refused"]
