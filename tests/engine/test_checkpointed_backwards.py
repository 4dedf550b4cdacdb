"""Backwards that are not the engine's through checkpointed blocks (see [Note: backwards
that are not the engine's] in activations.py): an input's gradient by
``torch.autograd.grad`` (an adversarial example), a graph retained for it and then
back-propagated by the engine after another forward (clean and adversarial losses
together), a saliency map, and a generator's loss through a checkpointed
discriminator. Each trains at every stage to the losses of data parallelism written
out by hand (every rank's replica, gradients averaged with one all-reduce), at rtol
1e-5. A second derivative through a checkpointed block is refused by name, and a
forward whose loss is kept but never back-propagated leaves the arena to the next
step."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zeroservice
from tests.engine.harness import average_gradients, mean_over_ranks
from zeroservice.launch import run_local

STEPS = 4
CHECKPOINTED = {"activation_checkpointing": True}


class _Blocks(nn.Module):
    """An embedding, two residual blocks in a ModuleList (the checkpointed ones), a head."""

    def __init__(self, width: int = 16, out: int = 4):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(2)
        )
        self.head = nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


def _adversarial(model: Callable, step: int) -> torch.Tensor:
    """FGSM: the input's gradient by autograd.grad, then the loss of the perturbed input."""
    x, y = _batch(step)
    x.requires_grad_(True)
    (gx,) = torch.autograd.grad(F.cross_entropy(model(x), y), x)
    return F.cross_entropy(model((x + 0.1 * gx.sign()).detach()), y)


def _clean_and_adversarial(model: Callable, step: int) -> torch.Tensor:
    """The clean loss serves the attack (graph retained) and the training loss, which
    the engine back-propagates after the adversarial forward has run."""
    x, y = _batch(step)
    x.requires_grad_(True)
    clean = F.cross_entropy(model(x), y)
    (gx,) = torch.autograd.grad(clean, x, retain_graph=True)
    return 0.5 * (clean + F.cross_entropy(model((x + 0.1 * gx.sign()).detach()), y))


def _saliency(model: Callable, step: int) -> torch.Tensor:
    """A saliency map of another batch weights this batch's inputs."""
    x, y = _batch(step)
    probe = _batch(step + 50)[0].requires_grad_(True)
    (g,) = torch.autograd.grad(model(probe).amax(-1).sum(), probe)
    return F.cross_entropy(model(x * (1 + 0.01 * g.abs())), y)


RECIPES = {"adversarial": _adversarial, "clean+adversarial": _clean_and_adversarial}
RECIPES["saliency"] = _saliency


def _adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-2)


def _by_hand(recipe: Callable) -> list[float]:
    """Data parallelism written out: each rank's replica, gradients all-reduced and
    averaged, then AdamW."""
    torch.manual_seed(0)
    model = _Blocks()
    opt = _adamw(model.parameters())
    out = []
    for step in range(STEPS):
        loss = recipe(model, step)
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        average_gradients(model)
        opt.step()
        opt.zero_grad()
        out.append(mean_over_ranks(loss.item()))
    return out


def _engine(stage: int, **extra) -> zeroservice.Engine:
    torch.manual_seed(0)
    return zeroservice.initialize(_Blocks(), {"stage": stage, **CHECKPOINTED, **extra}, _adamw)


def _ours(recipe: Callable, stage: int) -> list[float]:
    engine = _engine(stage)
    out = []
    try:
        for step in range(STEPS):
            loss = recipe(engine, step)
            engine.backward(loss)
            engine.step()
            out.append(mean_over_ranks(loss.item()))
    finally:
        engine.close()
    return out


def _recipes() -> dict:
    return {
        (name, who): (_by_hand(recipe) if who == "by hand" else _ours(recipe, who))
        for name, recipe in RECIPES.items()
        for who in ("by hand", 0, 1, 2, 3)
    }


@pytest.fixture(scope="module")
def recipes() -> dict:
    return run_local(_recipes, 2, timeout_s=300)[0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("name", list(RECIPES))
def test_input_gradients_through_checkpointed_blocks_train_as_by_hand(recipes, name, stage):
    ours, ref = recipes[(name, stage)], recipes[(name, "by hand")]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=1e-5, atol=0)


def _gan(d_stage: int | None) -> list[tuple[float, float]]:
    """A generator whose loss goes through a checkpointed discriminator. ``None``: by
    hand (zero_grad drops what the generator's backward left in the discriminator)."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
    disc = _Blocks(out=1)
    if d_stage is None:
        models = (gen, disc)
        opts = [_adamw(m.parameters()) for m in models]
    else:
        models = (
            zeroservice.initialize(gen, {"stage": 1}, _adamw),
            zeroservice.initialize(disc, {"stage": d_stage, **CHECKPOINTED}, _adamw),
        )

    def train(i: int, loss: torch.Tensor) -> None:
        if d_stage is None:
            opts[i].zero_grad()
            loss.backward()
            for p in models[i].parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
            opts[i].step()
        else:
            models[i].backward(loss)
            models[i].step()

    g, d = models
    out = []
    for step in range(STEPS):
        gen_in = torch.Generator().manual_seed(7 * step + dist.get_rank())
        real, z = torch.randn(6, 8, generator=gen_in) + 1, torch.randn(6, 4, generator=gen_in)
        with torch.no_grad():
            fake = g(z)
        loss_d = F.softplus(-d(real)).mean() + F.softplus(d(fake)).mean()
        train(1, loss_d)
        loss_g = F.softplus(-d(g(z))).mean()
        train(0, loss_g)
        out.append((mean_over_ranks(loss_d.item()), mean_over_ranks(loss_g.item())))
    return out


def _gans() -> dict:
    return {stage: _gan(stage) for stage in (None, 0, 1, 2)}


def test_a_generator_loss_through_a_checkpointed_discriminator_trains_as_by_hand():
    """The generator's backward gets the input's gradient from the recomputed blocks and
    leaves the discriminator's parameters alone (stage 3 refuses a foreign backward
    through its gathered weights: test_two_engines.py)."""
    out = run_local(_gans, 2, timeout_s=300)[0]
    for stage in (0, 1, 2):
        torch.testing.assert_close(
            torch.tensor(out[stage]), torch.tensor(out[None]), rtol=1e-5, atol=0
        )


def _second_derivative(stage: int) -> dict:
    engine = _engine(stage)
    try:
        x, y = _batch(0)
        x.requires_grad_(True)
        out = engine(x)
        try:
            torch.autograd.grad(out.logsumexp(-1).sum(), x, create_graph=True)
            refused = None
        except RuntimeError as e:
            refused = str(e)
        # The engine trains on without the penalty.
        loss = F.cross_entropy(engine(_batch(1)[0]), _batch(1)[1])
        engine.backward(loss)
        report = engine.step()
        return {"refused": refused, "applied": report.applied}
    finally:
        engine.close()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_second_derivative_through_a_checkpointed_block_is_refused_by_name(stage):
    """A gradient penalty differentiates the recomputed block twice, from a detached
    copy of its input: refused, where the losses would silently be another model's."""
    for r in run_local(functools.partial(_second_derivative, stage), 2, timeout_s=120):
        assert r["refused"] is not None
        assert "create_graph=True" in r["refused"] and "blocks.1" in r["refused"]
        assert "activation_checkpointing" in r["refused"]
        assert r["applied"]


def _train_keeping(stage: int, keep_every: int | None) -> dict:
    """Seven steps; with ``keep_every``, a forward whose loss is kept and never
    back-propagated every that many steps (an evaluation without torch.no_grad)."""
    engine, kept = _engine(stage), None
    store = engine.activations
    assert store is not None
    trained, overflows, arena = [], [], []
    try:
        for step in range(7):
            x, y = _batch(step)
            loss = F.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            trained.append(mean_over_ranks(loss.item()))
            if keep_every and step % keep_every == 0:
                kept = engine(_batch(step + 99)[0]).sum()  # kept until the next one
            overflows.append(store.overflows)
            arena.append(store.arena_bytes)
    finally:
        engine.close()
    assert keep_every is None or kept is not None
    return {"trained": trained, "overflows": overflows, "arena": arena}


def _kept_losses(stage: int) -> dict:
    """The training must not see the kept forwards, and the arena must not grow for them
    or stay taken by them."""
    return {"kept": _train_keeping(stage, 3), "baseline": _train_keeping(stage, None)}


@pytest.mark.parametrize("stage", [1, 3])
def test_a_loss_never_back_propagated_leaves_the_arena_to_the_next_step(stage):
    out = run_local(functools.partial(_kept_losses, stage), 2, timeout_s=120)[0]
    r, baseline = out["kept"], out["baseline"]
    torch.testing.assert_close(
        torch.tensor(r["trained"]), torch.tensor(baseline["trained"]), rtol=1e-5, atol=0
    )
    # Each kept forward costs the next step's two blocks one allocation each (that step
    # ran while the kept checkpoints were in the arena); the steps after it use the
    # arena again, and it is never sized for the kept forward.
    assert r["overflows"] == [0, 2, 2, 2, 4, 4, 4]
    assert len(set(r["arena"])) == 1


def _reversed(module: nn.Module, grad_input, grad_output):
    return tuple(None if g is None else -0.5 * g for g in grad_input)


HOOKS: dict[str, Callable[[nn.Module], object]] = {
    "gradient reversal": lambda m: m.register_full_backward_hook(_reversed),
    "output gradient scaled": lambda m: m.register_full_backward_pre_hook(
        lambda _, grads: tuple(None if g is None else 2.0 * g for g in grads)
    ),
    "input doubled": lambda m: m.register_forward_pre_hook(lambda _, args: (args[0] * 2,)),
    "output halved": lambda m: m.register_forward_hook(lambda _, args, out: out * 0.5),
}


def _hooked_block(stage: int, hook: str) -> dict:
    """The model's own hook on a checkpointed block runs once per call, as without
    checkpointing (see [Note: a recomputed block's own hooks] in activations.py)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    reference = _Blocks()
    model = _Blocks()
    model.load_state_dict(reference.state_dict())
    calls = {"reference": 0, "engine": 0}
    for name, m in (("reference", reference), ("engine", model)):
        m.blocks[1].register_forward_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
        HOOKS[hook](m.blocks[1])
    ddp = DDP(reference)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    engine = zeroservice.initialize(
        model, {"stage": stage, **CHECKPOINTED}, lambda ps: torch.optim.SGD(ps, lr=0.1)
    )
    out: dict = {"reference": [], "engine": []}
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        out["reference"].append(mean_over_ranks(loss.item()))
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        out["engine"].append(mean_over_ranks(loss.item()))
    engine.close()
    out["calls"] = calls
    return out


@pytest.mark.parametrize("hook", HOOKS)
@pytest.mark.parametrize("stage", [0, 3])
def test_a_hook_on_a_checkpointed_block_runs_once_per_call(stage, hook):
    r = run_local(_hooked_block, 2, stage, hook, timeout_s=120)[0]
    torch.testing.assert_close(
        torch.tensor(r["engine"]), torch.tensor(r["reference"]), rtol=1e-5, atol=0
    )
    assert r["calls"]["engine"] == r["calls"]["reference"] == STEPS


@dataclass
class _BlockOut:
    h: torch.Tensor
    aux: torch.Tensor


class _AuxBlock(nn.Module):
    """A residual block that also returns an auxiliary loss, in one of several shapes."""

    def __init__(self, shape: str):
        super().__init__()
        self.shape, self.linear = shape, nn.Linear(16, 16)

    def forward(self, h: torch.Tensor):
        out = torch.tanh(self.linear(h))
        aux = out.pow(2).mean()
        if self.shape == "dict":
            return h + out, {"aux": aux}
        if self.shape == "list":
            return [h + out, aux]
        return _BlockOut(h + out, aux)


class _AuxNet(nn.Module):
    def __init__(self, shape: str):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(_AuxBlock(shape) for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor):
        h, total = self.embed(x), 0.0
        for block in self.blocks:
            out = block(h)
            if isinstance(out, _BlockOut):
                h, aux = out.h, out.aux
            elif isinstance(out, tuple):
                h, aux = out[0], out[1]["aux"]
            else:
                h, aux = out
            total = total + aux
        return self.head(h), total


def _aux_outputs(stage: int, shape: str) -> dict:
    """Every tensor a checkpointed block returns carries its gradient, wherever it sits
    in the output (see [Note: a block's output, flattened] in activations.py)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def loss(model, step):
        x, y = _batch(step)
        logits, aux = model(x)
        return F.cross_entropy(logits, y) + 0.5 * aux

    torch.manual_seed(0)
    reference = _AuxNet(shape)
    model = _AuxNet(shape)
    model.load_state_dict(reference.state_dict())
    ddp, opt = DDP(reference), torch.optim.SGD(reference.parameters(), lr=0.1)
    engine = zeroservice.initialize(
        model, {"stage": stage, **CHECKPOINTED}, lambda ps: torch.optim.SGD(ps, lr=0.1)
    )
    out: dict = {"reference": [], "engine": []}
    for step in range(STEPS):
        opt.zero_grad()
        value = loss(ddp, step)
        value.backward()
        opt.step()
        out["reference"].append(mean_over_ranks(value.item()))
        value = loss(engine, step)
        engine.backward(value)
        engine.step()
        out["engine"].append(mean_over_ranks(value.item()))
    out["weights"] = (reference.state_dict(), engine.state_dict())
    engine.close()
    return out


@pytest.mark.parametrize("shape", ["dict", "list", "dataclass"])
@pytest.mark.parametrize("stage", [0, 3])
def test_tensors_inside_a_checkpointed_blocks_output_carry_their_gradients(stage, shape):
    r = run_local(_aux_outputs, 2, stage, shape, timeout_s=120)[0]
    torch.testing.assert_close(
        torch.tensor(r["engine"]), torch.tensor(r["reference"]), rtol=1e-5, atol=0
    )
    reference, trained = r["weights"]
    for name, value in reference.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-7)
