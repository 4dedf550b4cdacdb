"""Stage-3 scenarios run inside spawned ranks: models the engine does not know, deferred
construction, and the errors a user can run into."""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroservice
from tests.engine import harness
from zeroservice.config import ZeroConfig
from zeroservice.data import SyntheticTokens, micro_batch
from zeroservice.models import GPT, GPTConfig

VOCAB, SEQ = 128, 16


def _batch(step: int, micro: int = 0, accum: int = 1, batch: int = 2):
    data = SyntheticTokens(VOCAB, SEQ, seed=11)
    return micro_batch(data, step, micro, batch, dist.get_rank(), dist.get_world_size(), accum)


class _Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x + torch.tanh(self.lin(self.norm(x)))
        peer = self.__dict__.get("peer")  # not a submodule: its weights belong elsewhere
        if peer is not None:
            out = out + 0.1 * F.linear(out, peer.lin.weight)
        return out


class OddModel(nn.Module):
    """Everything stage 3 must survive: a weight tied across two groups, a block called
    twice, a block reading another block's weight inside its own forward, and the root
    reading a block's weight outside that block's forward. With ``reorder`` the blocks run
    in the opposite order on every other call, so the recorded gather order goes stale."""

    def __init__(self, d: int = 32, reorder: bool = False):
        super().__init__()
        self.reorder, self.calls = reorder, 0
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(3))
        self.blocks[2].lin.weight = self.blocks[1].lin.weight
        self.blocks[2].__dict__["peer"] = self.blocks[0]
        self.out = nn.Linear(d, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        order = [0, 1, 1, 2]
        if self.reorder and self.calls % 2:
            order.reverse()
        self.calls += 1
        for i in order:
            x = self.blocks[i](x)
        x = x + 0.1 * F.linear(x, self.blocks[0].lin.weight)
        return F.cross_entropy(self.out(x).view(-1, VOCAB), targets.reshape(-1))


class PenalisedOdd(OddModel):
    """OddModel whose loss adds penalties over ``self.parameters()`` and the weight
    matrices of ``self.named_parameters()``: read inside the forward, at stage 3 they
    must be the gathered weights, not the empty placeholders."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = super().forward(idx, targets)
        l2 = sum(p.pow(2).sum() for p in self.parameters())
        matrices = sum(p.abs().sum() for n, p in self.named_parameters() if n.endswith("weight"))
        return loss + 1e-3 * l2 + 1e-4 * matrices


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(cfg)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "odd": OddModel,
    "odd-reorder": lambda: OddModel(reorder=True),
    "odd-penalised": PenalisedOdd,
    "gpt2": _gpt2,
    "llama": _llama,
}


def _loss(name: str, model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name.startswith("odd"):
        return model(x, y)
    return model(input_ids=x, labels=x).loss


def _engine_and_ref(name: str, config: dict, optimizer):
    torch.manual_seed(5)
    model = MODELS[name]()
    ref = copy.deepcopy(model)
    harness.restart_fault()
    engine = zeroservice.initialize(model, ZeroConfig(stage=3, **config), optimizer)
    return engine, ref


def model_parity(name: str, config: dict, steps: int = 10, lr: float = 3e-3) -> dict:
    """The engine against DDP on one model: the AdamW run's losses and an evaluation
    forward, the SGD run's gradients and weights (see [Note: what parity compares])."""
    harness.install_fault()
    accum = config.get("gradient_accumulation_steps", 1)
    clip = config.get("gradient_clipping", 0.0)
    loss_fn = partial(_loss_of, name)
    batches = _batches_for(accum)

    def runs(optimizer, capture: bool):
        engine, ref = _engine_and_ref(name, config, optimizer)
        ref_run = harness.run_ddp(
            ref, optimizer, batches, steps, accum, clip, capture=capture, loss_fn=loss_fn
        )
        run = harness.run_engine(
            engine, batches, steps, accum, ref_run if capture else None, loss_fn
        )
        return engine, ref, run, ref_run

    engine, ref, adam, adam_ref = runs(lambda ps: torch.optim.AdamW(ps, lr=lr), False)
    x, y = _batch(steps)
    engine.eval()
    ref.eval()
    with torch.no_grad():  # an evaluation forward gathers and releases, builds no graph
        eval_loss, ref_eval = _loss(name, engine, x, y).item(), _loss(name, ref, x, y).item()
    gathered = engine.gatherer.live_elements - sum(
        engine.units[i].padded_numel for i in engine.gatherer.persistent
    )
    sgd_factory = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
    _, _, sgd, sgd_ref = runs(sgd_factory, True)
    return {
        "losses": adam.losses,
        "ref_losses": adam_ref.losses,
        "eval": (eval_loss, ref_eval),
        "gathered_after_eval": gathered,
        "grad_ratio": sgd.grad_ratio,
        "weight_ratio": harness.weight_ratio(sgd.state, sgd_ref.state),
        "state": adam.state,
        "ref_state": adam_ref.state,
    }


def _loss_of(name: str, model, batch) -> torch.Tensor:
    return _loss(name, model, *batch)


def _batches_for(accum: int):
    def batches(step: int, _accum: int) -> list:
        return [_batch(step, m, accum) for m in range(accum)]

    return batches


def _vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    """Make VmHWM (the peak resident size) restart from the current size."""
    Path("/proc/self/clear_refs").write_text("5")


BIG = GPTConfig(vocab_size=8192, seq_len=64, n_layer=24, n_head=8, dim=512)


def construction_peak(deferred: bool) -> dict:
    """Peak resident bytes added by building BIG and wrapping it at stage 3."""
    with zeroservice.deferred_init():  # the first meta-device op imports ~70 MiB of code
        nn.Embedding(2, 2)
    dist.barrier()
    _reset_peak()
    base = _vm_kib("VmRSS")
    if deferred:
        with zeroservice.deferred_init():
            model = GPT(BIG)
        init = GPT.initializer(BIG)
    else:
        torch.manual_seed(0)
        model = GPT(BIG)
        init = None
    engine = zeroservice.initialize(
        model,
        ZeroConfig(stage=3, stage3_persistence_elements=0),
        lambda ps: torch.optim.AdamW(ps, lr=1e-4),
        init=init,
    )
    peak = (_vm_kib("VmHWM") - base) * 1024
    ledger = engine.memory_ledger()
    x, y = micro_batch(SyntheticTokens(BIG.vocab_size, BIG.seq_len, seed=1), 0, 0, 1, 0, 1, 1)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    out = {
        "peak_bytes": peak,
        "full_bytes": 4 * BIG.num_params(),
        "params_bytes": ledger.params,
        "psi_padded": ledger.psi_padded,
        "loss": loss.item(),
        "digest": sum(u.flat.double().sum().item() for u in engine.units),
    }
    engine.close()
    return out


def deferred_init_agrees() -> dict:
    """A deferred model initialised by the modules' own initialisers: every rank ends up
    with the same whole weights, drawn from the intended distributions."""
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, dim=64)
    torch.manual_seed(dist.get_rank())  # ranks disagree: the engine must not care
    with zeroservice.deferred_init():
        model = GPT(cfg)
    assert all(p.is_meta for p in model.parameters())
    engine = zeroservice.initialize(
        model, ZeroConfig(stage=3), lambda ps: torch.optim.AdamW(ps), init=GPT.initializer(cfg)
    )
    state = engine.state_dict()
    x, y = _batch(0)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return {"state": {k: v.clone() for k, v in state.items()}, "loss": loss.item()}


def file_init_parity(path: str, stage: int, steps: int = 6) -> dict:
    """A deferred GPT loaded from a state-dict file trains like DDP on the eager model."""
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, dim=64)
    ref = GPT(cfg)
    ref.load_state_dict(torch.load(path, weights_only=True))
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    with zeroservice.deferred_init():
        model = GPT(cfg)
    engine = zeroservice.initialize(
        model, ZeroConfig(stage=stage), lambda ps: torch.optim.AdamW(ps, lr=3e-3), init=path
    )
    losses, ref_losses = [], []
    for step in range(steps):
        x, y = _batch(step)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        ref_loss = ddp(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        losses.append(harness.mean_over_ranks(loss.item()))
        ref_losses.append(harness.mean_over_ranks(ref_loss.item()))
    return {"losses": losses, "ref_losses": ref_losses}


def small_gpt_state(path: str) -> None:
    torch.manual_seed(21)
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, dim=64)
    torch.save(GPT(cfg).state_dict(), path)


class _ClampsItsWeight(nn.Module):
    """Writes to its own weight inside forward: lost at stage 3, so it must be refused."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.blocks[0].weight.clamp_(-0.1, 0.1)
        return self.blocks[1](self.blocks[0](x)).mean()


def error_message(case: str, path: str = "") -> str:
    """The message a misuse produces (world 1)."""
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, dim=64)
    opt = lambda ps: torch.optim.AdamW(ps)  # noqa: E731
    try:
        if case == "init-fn-on-real-model":
            zeroservice.initialize(GPT(cfg), ZeroConfig(stage=3), opt, init=GPT.initializer(cfg))
        elif case.startswith("restored-on-real-model-"):
            stage = int(case.rsplit("-", 1)[1])
            restored = zeroservice.RESTORED
            zeroservice.initialize(GPT(cfg), ZeroConfig(stage=stage), opt, init=restored)
        elif case.startswith("restored-snapshot-"):
            stage = int(case.rsplit("-", 1)[1])
            with zeroservice.deferred_init():
                model = GPT(cfg)
            config = ZeroConfig(stage=stage, redundancy="host-copy")
            zeroservice.initialize(model, config, opt, init=zeroservice.RESTORED).snapshot_now()
        elif case in ("file", "file-stage2"):
            with zeroservice.deferred_init():
                model = GPT(cfg)
            zeroservice.initialize(
                model, ZeroConfig(stage=3 if case == "file" else 2), opt, init=path
            )
        elif case == "in-place-weight":
            engine = zeroservice.initialize(_ClampsItsWeight(), ZeroConfig(stage=3), opt)
            engine(torch.randn(4, 8))
        elif case == "penalty-outside-forward":
            engine = zeroservice.initialize(GPT(cfg), ZeroConfig(stage=3), opt)
            x, y = _batch(0)
            penalty = sum(p.pow(2).sum() for p in engine.module.parameters())
            engine.backward(engine(x, y) + 1e-3 * penalty)
        elif case == "plain-backward":
            engine = zeroservice.initialize(GPT(cfg), ZeroConfig(stage=3), opt)
            x, y = _batch(0)
            engine(x, y).backward()
        else:
            raise AssertionError(case)
    except Exception as exc:  # the test asserts on type and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


class _SkipsABlock(nn.Module):
    """Three blocks of one size; a forward may skip the middle one."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if not (skip and i == 1):
                x = torch.tanh(block(x))
        return x.pow(2).mean()


def divergent_control_flow() -> str:
    """Rank 1 skips a block that rank 0 runs: the gather check must name both units."""
    torch.manual_seed(0)
    config = ZeroConfig(
        stage=3, stage3_check_gathers=True, stage3_persistence_elements=0, bucket_elements=1024
    )  # one unit per block
    engine = zeroservice.initialize(_SkipsABlock(), config, lambda ps: torch.optim.SGD(ps, 0.1))
    try:
        loss = engine(torch.randn(4, 16), skip=dist.get_rank() == 1)
        engine.backward(loss)
        engine.step()
    except RuntimeError as exc:
        return str(exc)
    return "no error"
