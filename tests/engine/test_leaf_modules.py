"""Stage 3 leaf modules (``stage3_leaf_modules``): a Mixture-of-Experts layer whose
router sends each rank's tokens to different experts trains at stage 3 to stage 0's
losses and weights, with prefetching on, under both groupings and with activation
checkpointing. See [Note: leaf modules] in zeroservice/leaf_modules.py."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroservice
from tests.engine import harness
from zeroservice import planner
from zeroservice.config import ConfigError
from zeroservice.launch import run_local
from zeroservice.leaf_modules import suggested_leaves
from zeroservice.partition import build_groups, leaf_modules

DIM, HIDDEN, EXPERTS, TOKENS, STEPS = 8, 48, 4, 3, 4


class SparseMoE(nn.Module):
    """Top-1 routing per token: an expert no token of this rank picked is not called."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, DIM))
            for _ in range(EXPERTS)
        )
        self.used: list[set[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, DIM)
        weights = torch.softmax(self.gate(flat), dim=-1)
        choice = weights.argmax(dim=-1)
        out = torch.zeros_like(flat)
        used = set()
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            used.add(e)
            out = out.index_add(0, rows, expert(flat[rows]) * weights[rows, e : e + 1])
        self.used.append(used)
        return out.reshape(x.shape)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.moe = SparseMoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.moe(self.norm(x))
        return h + 0.5 * self.moe(h)  # the leaf called twice in one forward


class Model(nn.Module):
    """An MoE layer on the raw input (no gradient reaches its input), two blocks of
    MoE layers, a head."""

    def __init__(self):
        super().__init__()
        self.front = SparseMoE()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.front(x)
        for layer in self.layers:
            h = layer(h)
        return (self.head(h) - y).pow(2).mean()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x, y = torch.randn(1, TOKENS, DIM, generator=g), torch.randn(1, TOKENS, 1, generator=g)
    return x.to(harness.device()), y.to(harness.device())


def _train(config: dict) -> dict:
    torch.manual_seed(0)
    model = Model().to(harness.device())
    engine = zeroservice.initialize(
        model, config, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    )
    losses = []
    for step in range(STEPS):
        loss = engine(*_batch(step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    used = [m.used for m in model.modules() if isinstance(m, SparseMoE)]
    state = {k: v.detach().cpu().clone() for k, v in engine.state_dict().items()}
    return {"losses": losses, "state": state, "used": used, "units": len(engine.units)}


VARIANTS = {
    "blocks": {"stage3_leaf_modules": ["SparseMoE"]},
    "size": {
        "stage3_leaf_modules": ["front", "layers.0.moe", "layers.1.moe"],
        "stage3_grouping": "size",
    },
    "checkpointed": {"stage3_leaf_modules": ["SparseMoE"], "activation_checkpointing": True},
    "checkpointed leaves": {  # each block a leaf, recomputed from a detached input
        "stage3_leaf_modules": ["Block", "front"],
        "activation_checkpointing": True,
    },
    "no prefetch": {"stage3_leaf_modules": ["SparseMoE"], "stage3_prefetch_elements": 0},
}


def train_variants() -> dict:
    common = {"bucket_elements": 1024, "stage3_persistence_elements": 0}
    out = {"stage 0": _train({"stage": 0} | common)}
    for name, extra in VARIANTS.items():
        out[name] = _train({"stage": 3} | common | extra)
    return out


def test_rank_divergent_experts_train_at_stage_3_as_at_stage_0():
    assert_variants_follow_stage_0(run_local(train_variants, 2, timeout_s=600))


def assert_variants_follow_stage_0(results: list[dict]) -> None:
    """Every rank's stage-3 variants trained to its stage-0 losses and weights, with
    stage 0's routing, which did diverge between the ranks (tests/gpu reuses this)."""
    ranks_used = [r["stage 0"]["used"] for r in results]
    assert ranks_used[0] != ranks_used[1]
    for rank, r in enumerate(results):
        ref = r["stage 0"]
        for name in VARIANTS:
            got = r[name]
            if not name.startswith("checkpointed"):  # (whose recomputation routes again)
                assert got["used"] == ref["used"], (rank, name)  # stage 0's routing
            assert got["units"] > 1 + EXPERTS, (rank, name)  # experts are units of their own
            torch.testing.assert_close(
                torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0
            )
            assert got["state"].keys() == ref["state"].keys()
            for key, value in ref["state"].items():
                scale = value.abs().max().item()
                torch.testing.assert_close(
                    got["state"][key], value, rtol=1e-5, atol=1e-5 * scale, msg=(rank, name, key)
                )


class Blocks(Model):
    """Only the blocks route (their MoE layers sit inside the blocks' list, as in
    Mixtral): the forward's gathers are the same on every rank, its reads are not."""

    def __init__(self):
        super().__init__()
        self.front = nn.Identity()


def train_without_leaves(config: dict) -> list[tuple[str, object]]:
    """Per step: ("refused", message) where the first forward raised ConfigError, else
    ("trained", loss); a refused step leaves the engine ready for the next."""
    torch.manual_seed(0)
    engine = zeroservice.initialize(
        Blocks().to(harness.device()), config, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    )
    out: list[tuple[str, object]] = []
    for step in range(STEPS):
        try:
            loss = engine(*_batch(step))
        except ConfigError as exc:
            out.append(("refused", str(exc)))
            continue
        engine.backward(loss)
        engine.step()
        out.append(("trained", loss.item()))
    return out


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
def test_divergent_reads_without_a_leaf_are_refused_at_the_forward(prefetch):
    """Without ``stage3_leaf_modules`` the ranks' backward collectives would differ (gloo
    aborted the process, "collective mismatch"): every rank raises the same ConfigError
    at the end of each such forward, naming the parameters and the class to make a
    leaf, before any backward collective; the engine stays usable. With the leaf named,
    the same steps train."""
    config = {
        "stage": 3,
        "bucket_elements": 1024,
        "stage3_persistence_elements": 0,
        "stage3_check_gathers": False,  # as jobs run: no per-gather consensus to catch it
    }
    if not prefetch:
        config["stage3_prefetch_elements"] = 0
    assert_refused_without_leaves(run_local(train_without_leaves, 2, config, timeout_s=300))
    with_leaf = run_local(
        train_without_leaves, 2, config | {"stage3_leaf_modules": ["SparseMoE"]}, timeout_s=300
    )
    assert all(kind == "trained" for rank in with_leaf for kind, _ in rank), with_leaf


def assert_refused_without_leaves(ranks: list[list[tuple[str, object]]]) -> None:
    """Both ranks refused the same steps with the same message, naming the leaf to set
    (tests/gpu reuses this)."""
    # The same outcome on both ranks each step, and the same message where refused (a
    # step that trained has each rank's own loss: its batch is the rank's).
    outcomes = [[(kind, got if kind == "refused" else None) for kind, got in r] for r in ranks]
    assert outcomes[0] == outcomes[1]
    refused = [message for kind, message in ranks[0] if kind == "refused"]
    assert len(refused) >= 2, ranks[0]  # the routing diverges at most steps
    for message in refused:
        assert isinstance(message, str)
        assert re.match(r"stage 3: this forward read layers\.\d\.moe\.experts\.\d", message)
        assert "on 1 of 2" in message
        assert "stage3_leaf_modules=['SparseMoE']" in message


def _tiny_mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        num_local_experts=4, num_experts_per_tok=1,
    )  # fmt: skip
    return MixtralForCausalLM(config)


def _train_mixtral(config: dict) -> dict:
    engine = zeroservice.initialize(
        _tiny_mixtral(), config, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    )
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        ids = torch.randint(0, 64, (1, 4), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "leaves": [g.name for g in engine.layout.groups or [] if g.leaf]}


def mixtral_by_default() -> dict:
    """transformers' Mixtral at stage 0, at stage 3 with the default configuration, and
    at stage 3 with the default list turned off."""
    stage3 = {"stage": 3, "bucket_elements": 1024, "stage3_persistence_elements": 0}
    out: dict = {"stage 0": _train_mixtral({"stage": 0}), "stage 3": _train_mixtral(stage3)}
    try:
        off = stage3 | {"stage3_leaf_modules": [], "stage3_check_gathers": False}
        out["off"] = _train_mixtral(off)
    except ConfigError as exc:
        out["off"] = str(exc)
    return out


def test_transformers_moe_layers_are_leaves_by_default():
    """The default ``stage3_leaf_modules`` names transformers' MoE layers: a Mixtral
    whose ranks route to different experts trains at stage 3 to stage 0's losses with
    no setting; with the list emptied, its first divergent forward is refused, naming
    the class."""
    for r in run_local(mixtral_by_default, 2, timeout_s=300):
        assert r["stage 3"]["leaves"] == [f"model.layers.{i}.block_sparse_moe" for i in (0, 1)]
        torch.testing.assert_close(
            torch.tensor(r["stage 3"]["losses"]),
            torch.tensor(r["stage 0"]["losses"]),
            rtol=1e-5,
            atol=0,
        )
        assert isinstance(r["off"], str), r["off"]
        assert "stage3_leaf_modules=['MixtralSparseMoeBlock']" in r["off"]


def test_a_known_moe_layer_the_model_lacks_is_not_refused():
    model = Model()
    assert leaf_modules(model, ["SparseMoE", "MixtralSparseMoeBlock"]) == [
        "front", "layers.0.moe", "layers.1.moe",
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="'MixtralSparseMoe' names no module"):
        leaf_modules(model, ["MixtralSparseMoe"])


def test_the_suggested_leaf_is_the_module_holding_the_list():
    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Linear(2, 2)

    class SparseBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(Expert() for _ in range(2))
            self.shared = nn.ModuleDict({"up": nn.Linear(2, 2)})

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.ModuleDict({"mlp": SparseBlock()}) for _ in range(2))
            self.blocks = nn.ModuleList(Expert() for _ in range(2))
            self.head = nn.Linear(2, 2)

    root = Root()
    names = [
        "layers.1.mlp.experts.0.w1.weight",  # the block holding the experts' list
        "layers.0.mlp.shared.up.bias",  # a ModuleDict's item: the block too
        "blocks.1.w1.weight",  # in the model's own list: the item, not the model
        "head.weight",  # in no list: its own module
    ]
    assert suggested_leaves(root, names) == ["SparseBlock", "Expert", "Linear"]


def test_leaf_is_one_group_holding_no_other():
    model = Model()
    groups = build_groups(model, "size", 64, ["SparseMoE"])
    names = [g.name for g in groups]
    assert names == ["", "front", "layers.0.norm", "layers.0.moe", "layers.1.norm",
                     "layers.1.moe", "head"]  # fmt: skip
    leaves = {g.name for g in groups if g.leaf}
    assert leaves == {"front", "layers.0.moe", "layers.1.moe"}
    moe = next(g for g in groups if g.name == "layers.0.moe")
    assert {n[0] for n, _ in moe.params} == {
        n if n.startswith("layers.0.moe.") else "" for n, _ in model.named_parameters()
    } - {""}
    # A qualified name inside another leaf adds nothing; "blocks" keeps its blocks.
    nested = build_groups(model, "blocks", 64, ["SparseMoE", "layers.0.moe.gate"])
    assert [g.name for g in nested] == ["", "front", "layers.0", "layers.0.moe", "layers.1",
                                        "layers.1.moe", "head"]  # fmt: skip


def test_planner_counts_the_units_a_leaf_makes():
    model = Model()
    kw = {"dp": 2, "stage": 3, "bucket_elements": 1024, "stage3_grouping": "size"}
    with_leaf = planner.unit_sizes_for_module(model, **kw, stage3_leaf_modules=["SparseMoE"])
    without = planner.unit_sizes_for_module(model, **kw)
    assert with_leaf != without
    from zeroservice.units import plan_layout

    layout = plan_layout(
        model, stage=3, world=2, bucket_elements=1024, stage3_grouping="size",
        stage3_leaf_modules=["SparseMoE"],
    )  # fmt: skip
    assert len(with_leaf) == len(layout.chunks)
    with pytest.raises(planner.PlanError, match="stage3_leaf_modules: 'Nope'"):
        planner.unit_sizes_for_module(model, **kw, stage3_leaf_modules=["Nope"])


REFUSED = {
    "SparseMoe": r"'SparseMoe' names no module with parameters .*classes with .*SparseMoE",
    "layers.2.moe": "'layers.2.moe' names no module",
    "Tanh": "'Tanh' names no module with parameters",
    "ModuleList": "'ModuleList' names front.experts, a ModuleList, which has no forward",
}


def refusals() -> dict[str, str]:
    out = {}
    for leaf in REFUSED:
        config = {"stage": 3, "stage3_leaf_modules": ["SparseMoE", leaf]}
        try:
            zeroservice.initialize(Model(), config, lambda ps: torch.optim.SGD(ps, lr=0.1))
            out[leaf] = "accepted"
        except ConfigError as exc:
            out[leaf] = str(exc)
    return out


def test_a_leaf_that_names_nothing_is_refused_at_initialize():
    got = run_local(refusals, 1, timeout_s=120)[0]
    for leaf, pattern in REFUSED.items():
        assert re.match("stage3_leaf_modules: " + pattern, got[leaf]), (leaf, got[leaf])


@pytest.mark.parametrize("value", ["SparseMoE", [""], [3], None])
def test_leaf_modules_must_be_a_list_of_names(value):
    with pytest.raises(ConfigError, match="stage3_leaf_modules"):
        zeroservice.ZeroConfig(stage3_leaf_modules=value)
