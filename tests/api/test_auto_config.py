"""``engine: {"stage": "auto"}``: resolved at submission and by POST /v1/plan into the
fastest configuration whose predicted peak fits (api/auto_config.py), refused with the
numbers when nothing fits, and refused naming the field when the job is outside what
the peak model covers."""

from __future__ import annotations

import pytest

from api.auto_config import AutoRefused, resolve
from tests.api.test_routes import TINY
from workers.rank_env import actor_env
from workers.spec import JobSpec
from zeroservice.autoconf import RUNTIME_RESERVE, auto_configure
from zeroservice.config import ConfigError

GIB = 2**30
MIB = 2**20
SMALL = {
    "name": "auto",
    "model": {"vocab_size": 2048, "seq_len": 128, "n_layer": 6, "n_head": 4, "dim": 256},
    "engine": {"stage": "auto"},
    "steps": 10,
    "micro_batch": 4,
    "resources": {"dp": 2, "cpus_per_rank": 1},
}
HUGE = {**SMALL, "model": {**SMALL["model"], "n_layer": 48, "dim": 8192, "n_head": 64}}


def _expected(spec: dict, memory: int, mp: int | None = None):
    job = JobSpec.model_validate(spec)
    return auto_configure(
        job.model.gpt_config(),
        world=job.resources.lowest_dp * job.resources.mp,
        memory_per_rank=memory,
        micro_batch=job.micro_batch,
        seq_len=job.model.seq_len,
        mp=mp,
    )


def test_a_submitted_auto_job_is_stored_resolved_with_the_reason(harness):
    h = harness.headers(harness.tenant_token("alice"))
    limit = int(harness.service.settings.cpu_rank_memory_gib * GIB)
    want = _expected(SMALL, limit).choice
    assert want is not None
    r = harness.client.post("/v1/jobs", json={"spec": SMALL}, headers=h)
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["spec"]["engine"] == want.engine_config()
    assert isinstance(job["spec"]["engine"]["stage"], int)
    assert job["spec"]["resources"]["dp"] * job["spec"]["resources"]["mp"] == 2
    events = harness.client.get(f"/v1/jobs/{job['id']}/events", headers=h).json()
    kinds = [(e["kind"], e["reason"]) for e in events]
    assert kinds == [("status", "submitted"), ("configured", "auto")]
    configured = events[1]
    assert configured["message"].startswith(want.describe())
    assert configured["data"]["engine"] == want.engine_config()
    assert configured["data"]["peak_bytes"] < configured["data"]["budget_bytes"] == limit


def test_the_plan_of_an_auto_job_says_what_was_chosen_and_why(harness):
    h = harness.headers(harness.tenant_token("alice"))
    budget_gib = 0.07  # 70 MiB: rules out some of the configurations weighed
    body = {"spec": SMALL, "device_memory_gib": budget_gib}
    got = harness.client.post("/v1/plan", json=body, headers=h).json()
    want = _expected(SMALL, int(budget_gib * GIB))
    assert want.choice is not None and got["fits"] is True
    assert got["auto"]["choice"]["engine"] == want.choice.engine_config()
    assert got["auto"]["considered"] == len(want.candidates)
    assert "predicted peak" in got["auto"]["reason"]
    # The resolved job's own plan: its peak with the runtime reserve (auto also adds the
    # margin, so what auto chooses is always admitted).
    assert got["needed_bytes"] == want.choice.peak.peak + RUNTIME_RESERVE


def test_a_gpu_job_is_configured_for_the_gpus_memory():
    """GPU ranks: the budget is the device's, which optimizer offload relieves (the
    host holds its states); 50 MiB fits nothing on CPU ranks."""
    gpu = {**SMALL, "resources": {**SMALL["resources"], "gpus_per_rank": 1}}
    spec, weighed = resolve(JobSpec.model_validate(gpu), 50 * MIB)
    assert weighed["device"] == "cuda" and weighed["choice"]["peak_bytes"] < 50 * MIB
    assert spec.engine["offload_optimizer"] is True
    assert spec.resources.host_allocator is None  # the mapping threshold is for CPU ranks
    with pytest.raises(AutoRefused, match="nothing fits"):
        resolve(JobSpec.model_validate(SMALL), 50 * MIB)


def test_nothing_fits_is_refused_with_the_numbers(harness):
    h = harness.headers(harness.tenant_token("alice"))
    r = harness.client.post("/v1/jobs", json={"spec": HUGE}, headers=h)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert "nothing fits" in detail["message"] and "smallest predicted peak" in detail["message"]
    assert detail["needed_bytes"] > detail["available_bytes"]
    assert detail["auto"]["choice"] is None
    planned = harness.client.post("/v1/plan", json={"spec": HUGE}, headers=h)
    assert planned.status_code == 200 and planned.json()["fits"] is False
    assert harness.client.get("/v1/jobs", headers=h).json()["total"] == 0


def test_a_budget_below_one_byte_is_refused_naming_the_field(harness):
    h = harness.headers(harness.tenant_token("alice"))
    r = harness.client.post("/v1/plan", json={"spec": SMALL, "device_memory_gib": 1e-12}, headers=h)
    assert r.status_code == 422, r.text
    assert "device_memory_gib" in r.json()["detail"], r.text


@pytest.mark.parametrize("stage", [True, False])
def test_a_boolean_stage_is_refused_naming_the_field(harness, stage):
    h = harness.headers(harness.tenant_token("alice"))
    spec = {**SMALL, "engine": {"stage": stage}}
    for route in ("/v1/jobs", "/v1/plan"):
        r = harness.client.post(route, json={"spec": spec}, headers=h)
        assert r.status_code == 422, r.text
        assert "engine.stage" in r.text, r.text


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"engine": {"stage": "auto", "bucket_elements": 4096}}, "engine.bucket_elements"),
        ({"engine": {"stage": "auto", "precision": "fp16"}}, "engine.precision: fp16"),
        ({"engine": {"stage": "auto", "redundancy": "host-copy"}}, "engine.redundancy"),
        (
            {"engine": {"stage": "auto", "stage3_leaf_modules": ["Block"]}},
            "engine.stage3_leaf_modules",
        ),
        ({"optimizer": {"type": "sgd", "lr": 0.1}}, "optimizer.type: sgd"),
    ],
)
def test_a_job_auto_cannot_model_is_refused_naming_the_field(harness, change, field):
    h = harness.headers(harness.tenant_token("alice"))
    spec = {**SMALL, "resources": {"dp": 2, "min_dp": 2, "max_dp": 2}, **change}
    for route in ("/v1/jobs", "/v1/plan"):
        r = harness.client.post(route, json={"spec": spec}, headers=h)
        assert r.status_code == 422, r.text
        assert field in r.json()["detail"]["message"], r.text


def test_an_elastic_job_keeps_its_model_parallel_size():
    spec = {**SMALL, "resources": {"dp": 2, "min_dp": 1, "max_dp": 4, "mp": 2}}
    resolved, weighed = resolve(JobSpec.model_validate(spec), 200 * MIB)
    assert resolved.resources.mp == 2 and resolved.resources.min_dp == 1
    assert resolved.resources.max_dp == 4 and weighed["choice"]["dp"] == 1  # its fewest
    want = _expected(spec, 200 * MIB, mp=2).choice
    assert want is not None and resolved.engine == want.engine_config()


def test_a_fixed_size_job_may_be_split_otherwise():
    """The world (dp x mp) stays; auto may trade replicas for model parallelism."""
    spec = {**SMALL, "resources": {"dp": 2, "mp": 1}}
    want = _expected(spec, 64 * MIB).choice
    resolved, _ = resolve(JobSpec.model_validate(spec), 64 * MIB)
    assert want is not None and (want.config.dp, want.config.mp) == (1, 2)
    assert (resolved.resources.dp, resolved.resources.mp) == (1, 2)
    assert resolved.engine == want.engine_config()


def test_another_model_is_refused():
    spec = {
        **SMALL,
        "model": {"kind": "factory", "factory": "tests.workers.jobs:tiny_model", "vocab_size": 256},
    }
    with pytest.raises(AutoRefused, match="needs the reference GPT"):
        resolve(JobSpec.model_validate(spec), GIB)


def test_the_spec_accepts_auto_and_nothing_else_by_name():
    job = JobSpec.model_validate(SMALL)
    with pytest.raises(ConfigError, match="resolved by the control plane"):
        job.zero_config()
    with pytest.raises(ValueError, match="engine.stage"):
        JobSpec.model_validate({**SMALL, "engine": {"stage": "automatic"}})
    with pytest.raises(ValueError, match="engine.precision"):
        JobSpec.model_validate({**SMALL, "engine": {"stage": "auto", "precision": "fp64"}})
    assert JobSpec.model_validate({**TINY}).zero_config().stage == 3


def test_cpu_ranks_of_an_auto_job_run_with_the_threshold_the_prediction_holds_for(monkeypatch):
    """Under glibc's default settings a rank holds more than the predicted peak, so the
    resolved job maps its blocks above 128 KiB on their own, unless it said otherwise
    (and GPU ranks, whose device memory the prediction is about, are left alone)."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "999999")  # what the Ray node says
    resolved, weighed = resolve(JobSpec.model_validate(SMALL), 200 * MIB)
    assert resolved.resources.host_allocator == weighed["host_allocator"] == "mapped"
    assert actor_env(resolved.resources.host_allocator)["MALLOC_MMAP_THRESHOLD_"] == "131072"
    named = {**SMALL, "resources": {**SMALL["resources"], "host_allocator": "mapped"}}
    kept, _ = resolve(JobSpec.model_validate(named), 200 * MIB)
    assert kept.resources.host_allocator == "mapped"
    assert actor_env("inherit")["MALLOC_MMAP_THRESHOLD_"] == "999999"
    gpus = {**SMALL, "resources": {**SMALL["resources"], "gpus_per_rank": 1}}
    on_gpus, _ = resolve(JobSpec.model_validate(gpus), 200 * MIB)
    assert on_gpus.resources.host_allocator is None
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    assert "MALLOC_MMAP_THRESHOLD_" not in actor_env(None)
    assert actor_env(None)["THP_MEM_ALLOC_ENABLE"] == "1"  # unset: huge pages only


@pytest.mark.parametrize("allocator", ["inherit", "huge"])
def test_cpu_ranks_under_another_allocator_than_the_predictions_are_refused(harness, allocator):
    """Under glibc's defaults ranks hold up to 40% more than the predicted peak, beyond
    auto's margin: a job naming such an allocator is refused, naming the field."""
    h = harness.headers(harness.tenant_token("alice"))
    spec = {**SMALL, "resources": {**SMALL["resources"], "host_allocator": allocator}}
    for route in ("/v1/jobs", "/v1/plan"):
        r = harness.client.post(route, json={"spec": spec}, headers=h)
        assert r.status_code == 422, r.text
        assert "resources.host_allocator" in r.json()["detail"]["message"], r.text


def test_a_tiled_vocabulary_is_configured_without_model_parallelism(harness):
    """The model refuses vocab_tiles with N_m > 1: auto weighs N_m = 1 alone (and the
    spec refuses a job fixing N_m = 2)."""
    h = harness.headers(harness.tenant_token("alice"))
    spec = {**SMALL, "model": {**SMALL["model"], "vocab_tiles": 4}}
    got = harness.client.post("/v1/plan", json={"spec": spec}, headers=h).json()
    assert got["fits"] is True and got["auto"]["choice"]["mp"] == 1, got
    assert got["auto"]["considered"] == 32  # 4 stages x checkpointing x offload x buckets
    fixed = {**spec, "resources": {"dp": 1, "min_dp": 1, "max_dp": 2, "mp": 2}}
    r = harness.client.post("/v1/plan", json={"spec": fixed}, headers=h)
    assert r.status_code == 422 and "model.vocab_tiles: 4 with resources.mp 2" in r.text, r.text


def test_auto_weighs_only_splits_the_spec_can_hold():
    """128 heads on 128 GPUs: the fastest split overall is N_m = 128, beyond the spec's
    64; auto answers the fastest split within it instead of one the spec refuses."""
    model = {"n_layer": 2, "dim": 8192, "n_head": 128, "vocab_size": 65536, "seq_len": 256}
    spec = {**SMALL, "model": model, "micro_batch": 1}
    spec["resources"] = {"dp": 128, "gpus_per_rank": 1}
    job = JobSpec.model_validate(spec)
    unbounded = auto_configure(
        job.model.gpt_config(), world=128, memory_per_rank=80 * GIB, micro_batch=1, device="cuda"
    )
    assert unbounded.choice is not None and unbounded.choice.config.mp > 64
    resolved, weighed = resolve(job, 80 * GIB)
    assert 1 <= resolved.resources.mp <= 64 and resolved.resources.dp * resolved.resources.mp == 128
    assert weighed["choice"]["mp"] == resolved.resources.mp


def test_a_world_with_no_split_within_the_bounds_is_refused_naming_them():
    gpt = JobSpec.model_validate(SMALL).model.gpt_config()  # 4 heads
    with pytest.raises(ValueError, match=r"N_d <= 2 and N_m <= 4 .* heads \(4\)"):
        auto_configure(gpt, world=64, memory_per_rank=GIB, max_dp=2, max_mp=4)
