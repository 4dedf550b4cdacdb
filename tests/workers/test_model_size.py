"""A tenant's model is built for its plan in a Ray task of its own, never in the
caller's process, and within a time and a memory bound."""

from __future__ import annotations

import os

import pytest

from tests.workers.jobs import TINY_GPT2, factory_model, tiny_job
from workers.model_size import ModelNotBuildable, count_on_worker, count_parameters

GIB = 2**30


def _factory(name: str, **kwargs) -> dict:
    return factory_model(f"tests.workers.factories:{name}", **kwargs)


def test_a_factory_runs_in_another_process_and_counts_as_in_place(local_ray, tmp_path):
    marker = tmp_path / "pid"
    spec = tiny_job(model=_factory("recorded", path=str(marker)))
    counted = count_on_worker(spec, timeout_s=60, memory_bytes=2 * GIB)
    worker_pid = int(marker.read_text())
    assert worker_pid != os.getpid()
    assert counted == count_parameters(spec)  # the same build, here


def test_a_transformers_model_is_counted_and_an_unknown_one_refused(local_ray):
    pytest.importorskip("transformers")
    spec = tiny_job(model=TINY_GPT2)
    assert count_on_worker(spec, timeout_s=60, memory_bytes=2 * GIB) == count_parameters(spec)
    nope = tiny_job(model={**TINY_GPT2, "architecture": "NopeForCausalLM"})
    with pytest.raises(ModelNotBuildable, match="model.architecture: transformers has no Nope"):
        count_on_worker(nope, timeout_s=60, memory_bytes=2 * GIB)
    typo = tiny_job(model=TINY_GPT2, engine={"stage": 3, "stage3_leaf_modules": ["GPT2Mlp"]})
    with pytest.raises(ModelNotBuildable, match="engine.stage3_leaf_modules: 'GPT2Mlp' names no"):
        count_on_worker(typo, timeout_s=60, memory_bytes=2 * GIB)
    named = tiny_job(model=TINY_GPT2, engine={"stage": 3, "stage3_leaf_modules": ["GPT2MLP"]})
    assert count_parameters(named) == count_parameters(spec)


def test_a_slow_factory_is_cut_at_the_timeout(local_ray):
    spec = tiny_job(model=_factory("slow", seconds=600))
    with pytest.raises(ModelNotBuildable, match=r"model.factory: .* took over 3 s"):
        count_on_worker(spec, timeout_s=3, memory_bytes=2 * GIB)


def test_a_factory_over_the_memory_bound_is_stopped(local_ray):
    spec = tiny_job(model=_factory("hungry", gib=1.5))
    with pytest.raises(ModelNotBuildable, match=r"model.factory: .* over 1 GiB of memory"):
        count_on_worker(spec, timeout_s=120, memory_bytes=1 * GIB)


@pytest.mark.parametrize(
    "architecture,config,field",
    [
        ("GPT2LMHeadModel", {"n_positions": 8}, "n_positions"),
        ("LlamaForCausalLM", {"max_position_embeddings": 8}, "max_position_embeddings"),
    ],
)
def test_a_sample_longer_than_the_models_positions_is_refused(architecture, config, field):
    """A GPT-2 indexes its position table past the end at the first forward of every
    rank; the limit a config states is checked where the model is built for its plan."""
    pytest.importorskip("transformers")
    base = {"vocab_size": 256, "num_hidden_layers": 1, "hidden_size": 16}
    base |= {"num_attention_heads": 2, "intermediate_size": 32, "n_layer": 1}
    base |= {"n_embd": 16, "n_head": 2}
    model = {**TINY_GPT2, "architecture": architecture, "config": {**base, **config}}
    fits = tiny_job(model={**model, "seq_len": 8})
    assert count_parameters(fits) > 0
    with pytest.raises(ValueError, match=rf"model.seq_len: 9 tokens .* 8 positions .*{field}"):
        count_parameters(tiny_job(model={**model, "seq_len": 9}))
