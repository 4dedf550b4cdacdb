"""Stage 3: a sub-module called on its own sees its weights (see [Note: a sub-module
called directly] in gather.py): one holding groups, one inside a group, and a tied
embedding whose weight no single group owns.

A weight tied across modules stays in the root's window; a sub-module called without
the root (T5's ``generate`` runs ``model.encoder(...)`` first) read it as the empty
placeholder and failed inside torch ("'weight' must be 2-D"). The sub-module now
opens the root's window itself: its outputs, a step trained through it, and T5's
``generate`` equal those of stage 0.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zeroservice
from tests.engine.harness import mean_over_ranks
from zeroservice.launch import run_local


class _Encoder(nn.Module):
    def __init__(self, embed: nn.Embedding):
        super().__init__()
        self.embed = embed
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return h


class _Tied(nn.Module):
    """An embedding shared by the encoder and the head (tied)."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Embedding(32, 16)
        self.encoder = _Encoder(self.shared)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(self.encoder(ids), self.shared.weight)


def _ids(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * step + dist.get_rank())
    return torch.randint(0, 32, (4, 6), generator=g)


def _through_the_encoder(stage: int) -> dict:
    torch.manual_seed(0)
    # SGD: the encoder's outputs are compared elementwise after the steps, and Adam
    # would turn summation noise into steps of about lr (see [Note: what parity
    # compares] in harness.py).
    engine = zeroservice.initialize(
        _Tied(), {"stage": stage}, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    )
    losses = []
    for step in range(3):
        # A loss on the encoder alone, then the whole model: both through the engine.
        ids = _ids(step)
        loss = engine.module.encoder(ids).square().mean() + F.cross_entropy(
            engine(ids).flatten(0, 1), ids.flatten()
        )
        engine.backward(loss)
        engine.step()
        losses.append(mean_over_ranks(loss.item()))
    with torch.no_grad():
        encoded = engine.module.encoder(_ids(9))
    engine.close()
    return {"losses": losses, "encoded": encoded}


def _inner_and_tied_modules(stage: int) -> dict:
    """A tied embedding module (its weight in the root's window) and a layer inside a
    block (the block is the group) called on their own, each training step, then once
    more without a graph: nothing small is kept gathered between steps."""
    torch.manual_seed(0)
    engine = zeroservice.initialize(
        _Tied(),
        {"stage": stage, "stage3_persistence_elements": 0},
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    )
    inner = engine.module.encoder.blocks[0][0]
    losses = []
    for step in range(3):
        ids = _ids(step)
        embedded = engine.module.shared(ids)  # as model.get_input_embeddings()(ids)
        loss = inner(embedded).square().mean() + F.cross_entropy(
            engine(ids).flatten(0, 1), ids.flatten()
        )
        engine.backward(loss)
        engine.step()
        losses.append(mean_over_ranks(loss.item()))
    with torch.no_grad():
        out = inner(engine.module.shared(_ids(9)))
    engine.close()
    return {"losses": losses, "out": out}


def _t5_generate(stage: int) -> torch.Tensor:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0, relative_attention_num_buckets=8,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    engine = zeroservice.initialize(
        T5ForConditionalGeneration(config), {"stage": stage}, lambda ps: torch.optim.AdamW(ps)
    )
    engine.eval()
    ids = torch.randint(2, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = engine.module.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    engine.close()
    return out


def _at_stages_0_and_3(what: str) -> dict:
    run = {"t5": _t5_generate, "encoder": _through_the_encoder}.get(what, _inner_and_tied_modules)
    return {stage: run(stage) for stage in (0, 3)}


def test_a_sub_module_called_alone_sees_the_tied_weight_at_stage_3():
    out = run_local(_at_stages_0_and_3, 2, "encoder", timeout_s=300)[0]
    torch.testing.assert_close(
        torch.tensor(out[3]["losses"]), torch.tensor(out[0]["losses"]), rtol=1e-5, atol=0
    )
    torch.testing.assert_close(out[3]["encoded"], out[0]["encoded"], rtol=1e-5, atol=1e-6)


def test_a_layer_inside_a_block_and_a_tied_embedding_called_alone_at_stage_3():
    """Neither is a group nor holds one: each, entered with no window open, opens the
    root's window and gathers the rest of what it reads (they read empty placeholders:
    "'weight' must be 2-D", "size mismatch ... vec (0)")."""
    out = run_local(_at_stages_0_and_3, 2, "inner", timeout_s=300)[0]
    torch.testing.assert_close(
        torch.tensor(out[3]["losses"]), torch.tensor(out[0]["losses"]), rtol=1e-5, atol=0
    )
    torch.testing.assert_close(out[3]["out"], out[0]["out"], rtol=1e-5, atol=1e-6)


def test_t5_generates_at_stage_3_as_at_stage_0():
    pytest.importorskip("transformers")
    out = run_local(_at_stages_0_and_3, 2, "t5", timeout_s=300)[0]
    assert torch.equal(out[3], out[0])
