"""The job spec refuses bad input by field, before anything is placed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from tests.workers.jobs import TINY_GPT2, tiny_job
from workers.build import build_dataset, build_model, optimizer_factory
from workers.spec import JobSpec
from zeroservice.config import ConfigError
from zeroservice.models import GPTConfig
from zeroservice.models.tiled_head import TiledHead


def _error(body) -> str:
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(body)
    return str(info.value)


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"stepz": 3}, "stepz"),
        ({"steps": -1}, "steps"),
        ({"steps": "many"}, "steps"),
        ({"micro_batch": 10**9}, "micro_batch"),
        ({"resources": {"dp": 0}}, "resources.dp"),
        ({"resources": {"dp": 2, "min_dp": 3}}, "min_dp <= dp <= max_dp"),
        ({"resources": {"dp": 4, "max_dp": 2}}, "min_dp <= dp <= max_dp"),
        ({"resources": {"gpus_per_rank": 2}}, "gpus_per_rank"),
        ({"resources": {"cpus_per_rank": 0}}, "cpus_per_rank"),
        ({"resources": {"mp": 3}, "model": {"n_head": 4}}, "n_head: 4 is not divisible"),
        (
            {"resources": {"mp": 2}, "model": {"vocab_size": 255, "n_head": 4}},
            "vocab_size: 255 is not divisible",
        ),
        (
            {
                "resources": {"mp": 2},
                "model": {"kind": "factory", "factory": "a.b:c", "vocab_size": 8},
            },
            "model parallelism needs the reference GPT",
        ),
        ({"model": {"dim": 30, "n_head": 4}}, "model.dim: 30 is not divisible by n_head 4"),
        ({"model": {"vocab_size": 64, "vocab_tiles": 65}}, "vocab_tiles: 65 exceeds vocab_size"),
        ({"model": {"vocab_tiles": 0}}, "vocab_tiles"),
        (
            {"resources": {"mp": 2}, "model": {"n_head": 4, "vocab_tiles": 4}},
            "splits the vocabulary already",
        ),
        (
            {"model": {"kind": "factory", "factory": "not a path", "vocab_size": 8}},
            "package.module:function",
        ),
        ({"model": {"kind": "nope"}}, "model"),
        ({"engine": {"stage": 5}}, "engine.stage"),
        ({"engine": {"stag": 1}}, "stag: unknown ZeroConfig field"),
        ({"engine": {"partition_activations": True}}, "partition_activations"),
        ({"engine": {"redundancy": "mirror"}}, "engine.redundancy"),
        ({"engine": {"redundancy_interval": 0}}, "engine.redundancy_interval"),
        ({"engine": {"stage3_leaf_modules": "MLP"}}, "engine.stage3_leaf_modules: 'MLP' must"),
        (
            {"engine": {"stage": 3, "stage3_leaf_modules": ["MLP", "Mlp"]}},
            "engine.stage3_leaf_modules: 'Mlp' names no module with parameters",
        ),
        (
            {"engine": {"stage": 3, "stage3_leaf_modules": ["blocks"]}},
            "'blocks' names blocks, a ModuleList",
        ),
        (
            {"engine": {"stage": 3, "stage3_leaf_modules": ["MLP"] * 257}},
            "engine.stage3_leaf_modules: 257 names, at most 256 are taken",
        ),
        (
            {"engine": {"stage": 3, "stage3_leaf_modules": ["MLP", "M" * 257]}},
            "engine.stage3_leaf_modules[1]: a name of at most 256 characters",
        ),
        ({"data": {"kind": "text"}}, "data.path: required"),
        ({"data": {"kind": "synthetic", "path": "x"}}, "synthetic data reads no file"),
        ({"optimizer": {"lr": -1}}, "optimizer.lr"),
        ({"optimizer": {"betas": [0.9, 1.5]}}, "beta"),
        ({"timeouts": {"step_s": 0}}, "timeouts.step_s"),
        ({"timeouts": {"bootstrap_s": 0.001}}, "timeouts.bootstrap_s"),
        ({"name": "bad/name"}, "name"),
        ({"name": "   "}, "name"),
        (
            {"micro_batch": 4, "engine": {"train_micro_batch_size": 8}},
            "engine.train_micro_batch_size: 8 differs from micro_batch 4",
        ),
        ({"resources": {"host_allocator": "jemalloc"}}, "resources.host_allocator"),
        # Engine settings that hold only at some sizes, checked at every size the job
        # may run at (each rank's engine would refuse the others).
        (
            {"engine": {"ranks_per_node": 2}, "resources": {"dp": 3}},
            "engine.ranks_per_node: 2 does not divide the data-parallel size 3, which the "
            "job may run at (resources.dp 3)",
        ),
        (
            {"engine": {"ranks_per_node": 2}, "resources": {"dp": 4, "min_dp": 2, "max_dp": 4}},
            "size 3, which the job may run at (min_dp..max_dp 2..4)",
        ),
        (
            {
                "engine": {"stage": 3, "ranks_per_node": 2, "hierarchical_partition": True},
                "resources": {"dp": 2, "mp": 2},
                "model": {"n_head": 4},
            },
            "hierarchical ZeRO++ groups (hierarchical_partition, quantized_gradients) are not "
            "supported with resources.mp 2",
        ),
        (
            {"engine": {"collectives": "shm"}, "resources": {"gpus_per_rank": 1}},
            "engine.collectives: 'shm' moves host tensors over gloo, and GPU ranks",
        ),
    ],
)
def test_bad_specs_name_the_field(body, needle):
    assert needle in _error(body)


def test_a_data_path_whose_directory_was_swapped_for_a_link_is_refused(tmp_path):
    """The control plane checked the real path at submission; a directory on it replaced
    by a symlink afterwards (into another tenant's data) is refused by the rank, which
    reads through the descriptor it checked (see [Note: a data file opened as checked])."""
    own, other = tmp_path / "a" / "sub", tmp_path / "b"
    own.mkdir(parents=True)
    other.mkdir()
    (own / "corpus.txt").write_bytes(b"tenant a's own text " * 10)
    (other / "corpus.txt").write_bytes(b"TENANT B SECRET TEXT " * 10)
    job = tiny_job(data={"kind": "text", "path": str(own / "corpus.txt")})
    assert bytes(build_dataset(job).data[:8].tolist()) == b"tenant a"
    (own / "corpus.txt").unlink()
    own.rmdir()
    own.symlink_to(other)
    with pytest.raises(ValueError, match="no longer leads to the file checked") as e:
        build_dataset(job)
    assert str(other) not in str(e.value)  # the other file's place is not told


@pytest.mark.parametrize(
    "body",
    [
        {"engine": {"ranks_per_node": 2}, "resources": {"dp": 4, "min_dp": 4, "max_dp": 4}},
        {"engine": {"ranks_per_node": 1}, "resources": {"dp": 2, "min_dp": 1, "max_dp": 3}},
        # qgZ in one hop (no ranks_per_node) beside MP.
        {"engine": {"quantized_gradients": "int8"}, "resources": {"dp": 2, "mp": 2}},
        {"engine": {"collectives": "native"}, "resources": {"gpus_per_rank": 1}},
    ],
)
def test_engine_settings_valid_at_every_size_are_accepted(body):
    JobSpec.model_validate(body)


def test_leaf_modules_of_the_reference_gpt_are_accepted_by_class_or_name():
    spec = tiny_job(engine={"stage": 3, "stage3_leaf_modules": ["MLP", "blocks.0.attn"]})
    assert spec.zero_config().stage3_leaf_modules == ["MLP", "blocks.0.attn"]


LEAF_NAMES = [
    "Block",
    "MLP",
    "blocks.0",
    "blocks.2",
    "blocks.3",
    "blocks.02",
    "blocks.1.attn",
    "blocks.2.mlp.fc",
    "blocks.1.nope",
    "blocks",
    "head",
    "wte",
    "Nope",
]


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("name", LEAF_NAMES)
def test_leaf_names_are_checked_as_on_the_whole_model(monkeypatch, name, tie):
    """The submission's check builds one block and reads block i's names as block
    0's; it answers as the whole model would, and builds no other block."""
    import dataclasses

    from workers import spec as spec_module
    from zeroservice.models import GPT
    from zeroservice.models import gpt as gpt_module
    from zeroservice.partition import leaf_modules

    cfg = GPTConfig(n_layer=3, dim=32, n_head=4, vocab_size=64, seq_len=16, tie_weights=tie)
    with torch.device("meta"):
        whole = GPT(cfg)
    try:
        leaf_modules(whole, [name])
        want = None
    except ConfigError as exc:
        want = str(exc)
    built = []
    init = gpt_module.Block.__init__
    monkeypatch.setattr(
        gpt_module.Block, "__init__", lambda self, *a, **k: built.append(1) or init(self, *a, **k)
    )
    spec_module._gpt_leaf_error.cache_clear()
    assert spec_module._gpt_leaf_error(dataclasses.astuple(cfg), (name,)) == want
    assert len(built) == 1


def test_defaults_and_round_trip():
    spec = tiny_job(resources={"dp": 2, "mp": 2})
    again = JobSpec.model_validate_json(spec.model_dump_json())
    assert again == spec
    assert spec.world_size == 4
    assert spec.resources.lowest_dp == spec.resources.highest_dp == 2
    assert spec.zero_config().stage == 2


def test_builds_each_model_kind_and_dataset(tmp_path):
    gpt = tiny_job()
    model, init = build_model(gpt, None)
    x = torch.randint(0, 256, (2, 16))
    assert model(x, x).ndim == 0 and init is None
    tiled, _ = build_model(tiny_job(model={"vocab_tiles": 4}), None)
    assert isinstance(tiled.head, TiledHead) and tiled.head.tiles == 4
    torch.testing.assert_close(tiled(x, x), model(x, x), rtol=1e-5, atol=0)
    hf = tiny_job(
        model=TINY_GPT2,
    )
    loss = build_model(hf, None)[0](x, x)
    assert loss.ndim == 0 and loss.item() > 0
    factory = tiny_job(
        model={
            "kind": "factory",
            "factory": "tests.workers.jobs:tiny_model",
            "kwargs": {"dim": 16},
            "vocab_size": 256,
            "seq_len": 16,
        }
    )
    assert build_model(factory, None)[0](x, x).ndim == 0
    missing = tiny_job(
        model={"kind": "factory", "factory": "tests.workers.jobs:nope", "vocab_size": 256}
    )
    with pytest.raises(ValueError, match="cannot import tests.workers.jobs:nope"):
        build_model(missing, None)
    # Datasets: bytes of a text file, and a uint16 token file checked against the vocabulary.
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 4)
    ds = build_dataset(tiny_job(data={"kind": "text", "path": str(text)}))
    assert ds.sample(3).shape == (17,)
    tokens = tmp_path / "t.bin"
    np.arange(1000, dtype="<u2").__mod__(256).astype("<u2").tofile(tokens)
    ds = build_dataset(tiny_job(data={"kind": "tokens", "path": str(tokens)}))
    assert int(ds.sample(5).max()) < 256
    np.full(100, 300, dtype="<u2").tofile(tokens)
    ds = build_dataset(tiny_job(data={"kind": "tokens", "path": str(tokens)}))
    with pytest.raises(ValueError, match="a token id near offset .* outside the vocabulary") as e:
        ds.sample(0)
    assert "300" not in str(e.value)  # the file's content is never in a message
    assert str(e.value).startswith(f"{tokens}: ")  # named by the job's path
    text.write_bytes(b"short")
    with pytest.raises(ValueError, match=f"^{text}: 5 bytes is too short for seq_len 16"):
        build_dataset(tiny_job(data={"kind": "text", "path": str(text)}))
    opt = optimizer_factory(tiny_job(optimizer={"type": "sgd", "lr": 0.1, "momentum": 0.9}))
    assert isinstance(opt([torch.nn.Parameter(torch.zeros(2))]), torch.optim.SGD)


def test_every_spec_field_and_metric_family_is_documented():
    from pathlib import Path

    from workers.metrics import FAMILIES
    from workers.spec import (
        CheckpointSpec,
        DataSpec,
        FactoryModelSpec,
        GPTModelSpec,
        OptimizerSpec,
        ResourcesSpec,
        TimeoutsSpec,
        TrackingSpec,
        TransformersModelSpec,
    )

    docs = Path(__file__).parents[2] / "docs"
    config = (docs / "configuration.md").read_text()
    prefixed = {
        "": JobSpec,
        "model.": GPTModelSpec,
        "data.": DataSpec,
        "optimizer.": OptimizerSpec,
        "resources.": ResourcesSpec,
        "checkpoint.": CheckpointSpec,
        "timeouts.": TimeoutsSpec,
        "tracking.": TrackingSpec,
    }
    missing = [
        f"{prefix}{name}"
        for prefix, model in prefixed.items()
        for name in model.model_fields
        if f"`{prefix}{name}`" not in config
    ]
    for model in (TransformersModelSpec, FactoryModelSpec):
        missing += [f"model.{n}" for n in model.model_fields if f"`model.{n}`" not in config]
    assert not missing
    metrics = (docs / "metrics.md").read_text()
    # A counter family is exposed (and documented) with the _total suffix.
    documented = [f for f in FAMILIES if f"`{f}`" in metrics or f"`{f}_total`" in metrics]
    assert [f for f in FAMILIES if f not in documented] == []


@pytest.mark.parametrize(
    "host_allocator,huge,threshold",
    [(None, "1", None), ("huge", "1", None), ("mapped", "1", "131072"), ("inherit", None, None)],
)
def test_host_allocator_sets_the_ranks_start_up_environment(
    monkeypatch, host_allocator, huge, threshold
):
    """What each ``resources.host_allocator`` puts in a rank actor's environment; with
    ``inherit`` nothing of its own (the node's variables pass through as they are)."""
    from workers.rank_env import actor_env

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    env = actor_env(host_allocator)
    assert env.get("THP_MEM_ALLOC_ENABLE") == huge
    assert env.get("MALLOC_MMAP_THRESHOLD_") == threshold
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "999999")
    env = actor_env(host_allocator)
    assert env["THP_MEM_ALLOC_ENABLE"] == (huge or "0")
    assert env["MALLOC_MMAP_THRESHOLD_"] == (threshold or "999999")
