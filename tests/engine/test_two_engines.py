"""Two engines whose backwards cross: a GAN, where the generator's loss goes through
the discriminator (see [Note: gradients from another backward] in engine.py). Between
the discriminator's steps such gradients are dropped, as DDP's ``zero_grad()`` drops
them, and the pair trains to DDP's losses (rtol 1e-5); inside a step they are refused
by name; at stage 3 the discriminator refuses the foreign backward by name."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroservice
from tests.engine.harness import mean_over_ranks
from zeroservice.launch import run_local

STEPS = 4


def _nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
    discriminator = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    return generator, discriminator


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(6, 8, generator=g) + 1.0, torch.randn(6, 4, generator=g)


def _adam(ps):
    return torch.optim.Adam(ps, lr=1e-2)


def _ddp() -> list[tuple[float, float]]:
    gen, disc = (DDP(m) for m in _nets())
    opt_g, opt_d = _adam(gen.parameters()), _adam(disc.parameters())
    out = []
    for step in range(STEPS):
        real, z = _data(step)
        opt_d.zero_grad()
        loss_d = F.softplus(-disc(real)).mean() + F.softplus(disc(gen(z).detach())).mean()
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad()
        loss_g = F.softplus(-disc(gen(z))).mean()
        loss_g.backward()  # reaches the discriminator too; its zero_grad drops that
        opt_g.step()
        out.append((mean_over_ranks(loss_d.item()), mean_over_ranks(loss_g.item())))
    return out


def _engines(g_stage: int, d_stage: int):
    gen, disc = _nets()
    return (
        zeroservice.initialize(gen, {"stage": g_stage}, _adam),
        zeroservice.initialize(disc, {"stage": d_stage}, _adam),
    )


def _gan(g_stage: int, d_stage: int) -> list[tuple[float, float]] | str:
    gen, disc = _engines(g_stage, d_stage)
    out: list[tuple[float, float]] = []
    try:
        for step in range(STEPS):
            real, z = _data(step)
            with torch.no_grad():
                fake = gen(z)
            loss_d = F.softplus(-disc(real)).mean() + F.softplus(disc(fake)).mean()
            disc.backward(loss_d)
            disc.step()
            loss_g = F.softplus(-disc(gen(z))).mean()
            gen.backward(loss_g)
            gen.step()
            out.append((mean_over_ranks(loss_d.item()), mean_over_ranks(loss_g.item())))
    except RuntimeError as exc:
        return str(exc)
    finally:
        gen.close()
        disc.close()
    return out


def _inside_a_step(stage: int) -> dict:
    """The generator's backward between the discriminator's backward and its step."""
    gen, disc = _engines(stage, stage)
    real, z = _data(0)
    disc.backward(F.softplus(-disc(real)).mean())
    gen.backward(F.softplus(-disc(gen(z))).mean())
    out: dict = {}
    try:
        disc.step()
    except RuntimeError as exc:
        out["error"] = str(exc)
    # The refused step left the engine between steps, holding no gradient: it trains on.
    held = list(disc.reducer.full_grads)  # stages 0/1; stage 2 holds them as .grad
    held += [p.grad for p in disc.module.parameters() if p.grad is not None]
    out["grads_held"] = sum(float(g.abs().sum()) for g in held)
    disc.backward(F.softplus(-disc(real)).mean())
    out["next_step_applied"] = disc.step().applied
    gen.step()
    gen.close()
    disc.close()
    return out


PAIRS = [(0, 0), (1, 1), (2, 2), (3, 2), (2, 3)]


def _all() -> dict:
    return {
        "ddp": _ddp(),
        **{pair: _gan(*pair) for pair in PAIRS},
        **{("inside", s): _inside_a_step(s) for s in (0, 1, 2)},
    }


@functools.cache
def _results() -> dict:
    return run_local(_all, 2, timeout_s=300)[0]


@pytest.mark.parametrize("pair", [p for p in PAIRS if p[1] < 3], ids=str)
def test_a_gan_trains_to_ddps_losses(pair):
    r = _results()
    assert isinstance(r[pair], list), r[pair]
    torch.testing.assert_close(torch.tensor(r[pair]), torch.tensor(r["ddp"]), rtol=1e-5, atol=0)


def test_a_stage_3_discriminator_names_the_foreign_backward():
    msg = _results()[(2, 3)]
    assert isinstance(msg, str), msg
    assert msg.startswith("stage 3: a backward that was not this engine's reached [2.weight"), msg
    assert "train a model that another engine's loss passes through at stage 0-2" in msg


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_foreign_backward_inside_a_step_is_refused_and_the_step_discarded(stage):
    r = _results()[("inside", stage)]
    named = r["error"].removeprefix("step: a backward that was not this engine's reached ")
    assert named != r["error"] and "2.weight" in named.split(" after ")[0], r
    assert named.split(" after ")[0].endswith("and 1 more"), r  # 4 parameters, 3 named
    assert "this step's gradients were discarded" in r["error"]
    assert r["grads_held"] == 0.0
    assert r["next_step_applied"]
