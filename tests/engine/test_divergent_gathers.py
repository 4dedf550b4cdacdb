"""Stage 3's always-on per-step gather consensus: ranks that gather different units of
one size in one forward are refused at the step, with the weights unchanged, instead of
training silently wrong. Here the ranks read the same experts in different orders, so
the forward's read consensus (which catches a router sending ranks' tokens to different
experts: tests/engine/test_leaf_modules.py) agrees, and only the order differs."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import zeroservice
from zeroservice.launch import run_local

EXPERTS = 4


class _Block(nn.Module):
    """A projection and equal-size experts; ``route`` lists the experts applied, in order."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor, route: tuple[int, ...]) -> torch.Tensor:
        h = torch.tanh(self.proj(x))
        for e in route:
            h = torch.tanh(self.experts[e](h))
        return h


class _MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Block()
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, route: tuple[int, ...]) -> torch.Tensor:
        return self.head(self.block(x, route)).pow(2).mean()


def _engine(stage: int, **extra) -> zeroservice.Engine:
    torch.manual_seed(0)
    config = {
        "stage": stage,
        # The suite turns the per-gather debug check on (tests/conftest.py): this is
        # about the always-on per-step check alone.
        "stage3_check_gathers": False,
        "stage3_persistence_elements": 0,
        "stage3_grouping": "size",
        "bucket_elements": 1024,  # the block exceeds it: each expert its own unit
    } | extra
    return zeroservice.initialize(_MoE(), config, lambda ps: torch.optim.Adam(ps, lr=1e-2))


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(4, 8, generator=g)


def _train(engine: zeroservice.Engine, step: int, route: tuple[int, ...]) -> float:
    loss = engine(_batch(step), route)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _optimizer_state(engine: zeroservice.Engine) -> list[torch.Tensor]:
    tensors = [m.detach().clone() for m in engine.optimizer.masters]
    for state in engine.optimizer.optimizer.state_dict()["state"].values():
        tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def divergent_step_refused() -> dict:
    """One agreed step, then a step where rank 0 applies experts 0 then 1 and rank 1
    experts 1 then 0 (same-size units, the same ones read), then an agreed step again.
    No prefetching: a rank off the plan recorded in the first
    step would prefetch the plan's expert and gather its own on top, a different number
    of gathers, which gloo's size check may catch; what is left to catch is the silent
    case, the same sizes in the same order."""
    engine = _engine(3, stage3_prefetch_elements=0)
    expert_units = {
        u.index for u in engine.units if any(".experts." in s.names[0] for s in u.slots)
    }
    sizes = {engine.units[i].padded_numel for i in expert_units}
    _train(engine, 0, route=(0, 1))
    before, optim_before = engine.state_dict(), _optimizer_state(engine)
    steps_before = (engine.applied_steps, engine.global_steps)
    loss = engine(_batch(1), route=(0, 1) if dist.get_rank() == 0 else (1, 0))
    engine.backward(loss)
    message = "no error"
    try:
        engine.step()
    except RuntimeError as exc:
        message = str(exc)
    after, optim_after = engine.state_dict(), _optimizer_state(engine)
    unchanged = before.keys() == after.keys() and all(
        torch.equal(before[k], after[k]) for k in before
    )
    optim_unchanged = len(optim_before) == len(optim_after) and all(
        torch.equal(a, b) for a, b in zip(optim_before, optim_after, strict=True)
    )
    steps_after = (engine.applied_steps, engine.global_steps)
    _train(engine, 2, route=(0, 1))  # the engine goes on after a refused step
    return {
        "expert_units": len(expert_units),
        "expert_sizes": len(sizes),
        "message": message,
        "unchanged": unchanged,
        "optim_unchanged": optim_unchanged and len(optim_before) > 0,
        "steps": (steps_before, steps_after, (engine.applied_steps, engine.global_steps)),
    }


def agreed_routing(stage: int) -> list[float]:
    """Both ranks apply expert 1 alone (the others unused on every rank)."""
    engine = _engine(stage)
    return [_train(engine, step, route=(1,)) for step in range(4)]


def test_divergent_gathers_refuse_the_step_on_every_rank():
    results = run_local(divergent_step_refused, 2, timeout_s=300)
    for rank, r in enumerate(results):
        assert r["expert_units"] == EXPERTS and r["expert_sizes"] == 1, (rank, r)
        message = r["message"]
        assert message.startswith("stage 3: ranks issued different parameter gathers"), (
            rank,
            message,
        )
        for part in (
            "rank-divergent control flow",
            "Mixture-of-Experts",
            "gradients were discarded",
            "stage3_check_gathers=True",
            "ZEROSERVICE_CHECK_GATHERS=1",
            "stage3_leaf_modules",
            "stage 0-2",
        ):
            assert part in message, (rank, part, message)
        assert r["unchanged"], rank
        assert r["optim_unchanged"], rank
        assert r["steps"] == ((1, 1), (1, 1), (2, 2)), (rank, r["steps"])


def test_agreed_routing_trains_at_stage_3_as_at_stage_0():
    stage3 = run_local(agreed_routing, 2, 3, timeout_s=300)
    stage0 = run_local(agreed_routing, 2, 0, timeout_s=300)
    for rank in range(2):
        torch.testing.assert_close(
            torch.tensor(stage3[rank]), torch.tensor(stage0[rank]), rtol=1e-5, atol=0
        )
