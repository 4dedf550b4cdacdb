"""Supervised jobs on a real local Ray: completion, DP × MP, worker loss, stalls."""

from __future__ import annotations

import ipaddress
import os
import signal
import time
from pathlib import Path

import pytest

from tests.waiting import wait_for
from tests.workers.jobs import TINY_GPT2, TINY_MIXTRAL, factory_model, tiny_job
from zscli.server import processes_with

pytestmark = pytest.mark.slow


def _run(ray, job_id, spec, root, timeout=240):
    from workers.jobs import launch

    handle = launch(job_id, spec, root)
    status = ray.get(handle.wait.remote(timeout))
    return handle, status


def test_dp2_cpu_job_completes(local_ray, tmp_path):
    ray = local_ray
    handle, status = _run(ray, "dp2", tiny_job(), tmp_path / "ckpt")
    info = ray.get(handle.status.remote())
    assert status == "succeeded", info
    losses = ray.get(handle.losses.remote())
    assert sorted(losses) == list(range(1, 9))
    assert losses[8] < losses[1]
    kinds = [(e["kind"], e["reason"]) for e in ray.get(handle.events.remote())]
    assert ("checkpoint", "saved") in kinds and ("status", "completed") in kinds
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "step-00000004",
        "step-00000008",
    ]
    ray.kill(handle)


def test_per_step_history_phases_and_tracking_of_a_job(local_ray, tmp_path):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from workers.tracking import allow_file_store, tensorboard_dir

    ray = local_ray
    root = tmp_path / "ckpt"
    uri = (tmp_path / "mlruns").as_uri()
    spec = tiny_job(tracking={"tensorboard": True, "mlflow": True, "mlflow_uri": uri})
    handle, status = _run(ray, "tracked", spec, root)
    assert status == "succeeded", ray.get(handle.status.remote())
    history = ray.get(handle.history.remote())
    assert [p["step"] for p in history] == list(range(1, 9))
    for p in history:
        assert p["steps"] == 1 and p["dp"] == 2 and p["loss_scale"] == 1.0
        assert p["lr"] == 3e-3 and p["grad_norm"] > 0 and p["memory_peak_bytes"] > 0
        # micro-batch 2 × 16 tokens × 2 replicas per step
        assert p["tokens_per_second"] == pytest.approx(2 * 16 * 2 / p["step_seconds"])
    # Collectives per step-phase: the training steps' only, no start-up broadcast.
    phases = ray.get(handle.metrics.remote())["0"]["phases"]
    assert {"reduce_scatter/grads", "all_gather/params", "all_reduce/norm"} <= set(phases)
    assert not [name for name in phases if name.endswith(("/init", "/state"))]
    assert phases["all_reduce/norm"]["calls"] == 8 and phases["all_reduce/norm"]["steps"] == 8

    events = EventAccumulator(str(tensorboard_dir(str(root), "tracked")))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 9))
    allow_file_store()
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("zeroservice").experiment_id])
    assert run.info.status == "FINISHED"
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in losses) == [(p["step"], p["loss"]) for p in history]
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")]
    assert artifacts == ["checkpoints/step-00000004.json", "checkpoints/step-00000008.json"]
    ray.kill(handle)


def test_dp2_mp2_job_on_fractional_cpus_completes(local_ray, tmp_path):
    """... and its ranks run with glibc's mapping threshold, as the job asks (set in
    their processes: tests/workers/test_rank_env.py checks that it takes effect)."""
    from workers.jobs import launch

    ray = local_ray
    spec = tiny_job(
        steps=24,
        checkpoint={"interval_steps": 12},
        resources={"dp": 2, "mp": 2, "cpus_per_rank": 0.5, "host_allocator": "mapped"},
        engine={"stage": 3, "bucket_elements": 4096},
    )
    handle = launch("dp2mp2", spec, tmp_path / "ckpt")
    wait_for(lambda: len(ray.get(handle.ranks.remote())) == 4, 120, "the four ranks")
    for rank in ray.get(handle.ranks.remote()):
        assert rank["allocator"] == {
            "MALLOC_MMAP_THRESHOLD_": "131072",
            "THP_MEM_ALLOC_ENABLE": "1",
        }
    status = ray.get(handle.wait.remote(240))
    assert status == "succeeded", ray.get(handle.status.remote())
    ranks = ray.get(handle.metrics.remote())
    assert len(ranks) == 4
    ledgers = [ranks[str(r)]["ledger"] for r in range(4)]
    assert all(led["mp"] == 2 and led["n_d"] == 2 for led in ledgers)
    assert all(led["model_states"] == led["expected_padded"] for led in ledgers)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["mp-00-of-02", "mp-01-of-02"]
    ray.kill(handle)


def test_a_loss_turned_nan_fails_the_job_as_diverged_before_its_chunk_is_saved(local_ray, tmp_path):
    """See [Note: a diverged job] in workers/controller.py."""
    ray = local_ray
    model = factory_model("tests.workers.factories:diverging", after=6)
    handle, status = _run(ray, "nan", tiny_job(model=model, steps=12), tmp_path / "ckpt")
    info = ray.get(handle.status.remote())
    assert status == "failed", info
    assert info["reason"] == "diverged", info
    assert "the loss is nan at step 6" in info["message"], info
    assert "the newest checkpoint, step 4, is from before it" in info["message"], info
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000004"]
    ray.kill(handle)


def test_killed_worker_resumes_from_checkpoint_with_fewer_ranks(local_ray, tmp_path):
    ray = local_ray
    spec = tiny_job(
        steps=24,
        resources={"dp": 2, "min_dp": 1, "max_dp": 2, "cpus_per_rank": 2},
        checkpoint={"interval_steps": 4},
    )
    from workers.jobs import launch

    handle = launch("killed", spec, tmp_path / "ckpt")
    wait_for(lambda: ray.get(handle.status.remote())["step"] >= 4, 120, "the first checkpoint")
    # Capacity for one replica only once the group is torn down: a blocker queued now
    # takes the CPUs the killed rank's replica frees.
    blocker = ray.remote(num_cpus=2)(_Blocker).remote()
    victim = ray.get(handle.ranks.remote())[1]
    os.kill(victim["pid"], signal.SIGKILL)
    status = ray.get(handle.wait.remote(300))
    info = ray.get(handle.status.remote())
    assert status == "succeeded", info
    events = ray.get(handle.events.remote())
    restarts = [e for e in events if e["kind"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["reason"] == "worker_lost"
    assert "rank 1" in restarts[0]["message"]
    assert info["restarts"] == 1
    resumed = [e for e in events if e["kind"] == "placed"][1]
    assert resumed["dp"] == 1
    saved = {e["step"] for e in events if e["kind"] == "checkpoint"}
    assert resumed["step"] in saved and resumed["step"] >= 4
    assert "from checkpoint" in resumed["message"]
    shrink = [e for e in events if e["kind"] == "resize"]
    assert shrink and shrink[0]["reason"] == "shrunk" and shrink[0]["dp_from"] == 2
    losses = ray.get(handle.losses.remote())
    assert sorted(losses) == list(range(1, 25))
    ray.kill(blocker)
    ray.kill(handle)


class _Blocker:
    def ping(self) -> bool:
        return True


def test_frozen_rank_is_named_by_the_watchdog(local_ray, tmp_path):
    ray = local_ray
    step_timeout = 6.0
    spec = tiny_job(
        steps=100_000,
        max_restarts=0,
        checkpoint={"interval_steps": 100_000},
        timeouts={"bootstrap_s": 60, "step_s": step_timeout},
    )
    from workers.jobs import launch

    handle = launch("frozen", spec, tmp_path / "ckpt")
    wait_for(lambda: ray.get(handle.status.remote())["status"] == "running", 120, "running")
    time.sleep(1.0)
    victim = ray.get(handle.ranks.remote())[1]
    os.kill(victim["pid"], signal.SIGSTOP)
    stopped = time.monotonic()
    status = ray.get(handle.wait.remote(120))
    detected = time.monotonic() - stopped
    events = ray.get(handle.events.remote())
    assert status == "failed"
    stall = [e for e in events if e["kind"] == "restart"][0]
    assert stall["reason"] == "stalled" and stall["ranks"] == [1]
    assert "rank 1 (dp 1, mp 0" in stall["message"]
    assert "not responding" in stall["message"]
    # The last collective each rank entered is named (rank 0 waits inside one).
    assert "rank 0: collective #" in stall["message"]
    # Rank 0's phase is the engine's own state inside the step, with its micro-batch.
    assert ", micro-batch 0)" in stall["message"], stall["message"]
    # Detected within the step timeout plus the polling slack (a poll is <= 2 s).
    assert detected < step_timeout + 10
    ray.kill(handle)


def _scrape(target: str) -> dict:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://{target}/metrics", timeout=5).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_rank_metrics_are_scraped_with_labels_and_equal_the_ledger(local_ray, tmp_path):
    ray = local_ray
    spec = tiny_job(
        steps=100_000,
        resources={"dp": 2, "mp": 2, "cpus_per_rank": 0.5},
        checkpoint={"interval_steps": 5},
        engine={"stage": 1, "bucket_elements": 4096},
    )
    from workers.jobs import launch, stop

    handle = launch("metrics", spec, tmp_path / "ckpt")
    wait_for(lambda: ray.get(handle.status.remote())["step"] >= 5, 120, "one chunk")
    targets = ray.get(handle.targets.remote())
    assert len(targets) == 4
    ranks = ray.get(handle.ranks.remote())
    ledgers = ray.get(handle.metrics.remote())
    seen = set()
    for target, rank in zip(targets, ranks, strict=True):
        assert target["labels"] == {"job_id": "metrics"}
        (address,) = target["targets"]
        assert address.startswith("127.0.0.1:")
        families = _scrape(address)
        memory = {s.labels["kind"]: s.value for s in families["zeroservice_memory_bytes"].samples}
        labels = families["zeroservice_memory_bytes"].samples[0].labels
        assert labels["job_id"] == "metrics" and labels["rank"] == str(rank["rank"])
        assert labels["dp_rank"] == str(rank["rank"] // 2)
        assert labels["mp_rank"] == str(rank["rank"] % 2)
        assert labels["node"].startswith("127.0.0.1/")
        seen.add((labels["dp_rank"], labels["mp_rank"]))
        ledger = ledgers[str(rank["rank"])]["ledger"]
        assert memory["params"] == ledger["params"]
        assert memory["grads"] == ledger["grads"]
        assert memory["master"] == ledger["master"]
        assert memory["optimizer"] == ledger["optimizer_states"] + ledger["optimizer_other"]
        expected = families["zeroservice_memory_expected_bytes"].samples[0].value
        assert expected == ledger["expected_padded"]
        held = families["zeroservice_model_state_bytes"].samples[0].value
        assert held == ledger["model_states"] == expected
        ops = {
            (s.labels["op"], s.labels["group"])
            for s in families["zeroservice_collective_bytes"].samples
        }
        assert ("reduce_scatter", "dp") in ops and ("all_reduce", "mp") in ops
        assert families["zeroservice_tflops"].samples[0].value > 0
        assert 0 < families["zeroservice_mfu"].samples[0].value < 1
        steps = families["zeroservice_step_seconds"].samples
        assert any(s.name == "zeroservice_step_seconds_count" and s.value >= 5 for s in steps)
        assert families["zeroservice_workers"].samples[0].value == 4
        assert families["zeroservice_tokens"].samples[0].value > 0
        assert "step" not in labels
    assert seen == {("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")}
    assert stop("metrics") == "cancelled"


def test_gpu_ranks_each_see_their_own_declared_gpu(local_ray, tmp_path):
    """On a cluster whose GPUs are declared but absent, GPU ranks are placed one GPU
    each (Ray sets CUDA_VISIBLE_DEVICES) and, finding no CUDA, train on gloo."""
    ray = local_ray
    spec = tiny_job(steps=4, resources={"dp": 2, "gpus_per_rank": 1, "cpus_per_rank": 0.5})
    from workers.jobs import launch

    handle = launch("gpus", spec, tmp_path / "ckpt")
    assert ray.get(handle.wait.remote(120)) == "succeeded"
    # Where each rank ran is in the placement event (the ranks are gone by now).
    placed = [e for e in ray.get(handle.events.remote()) if e["kind"] == "placed"][0]
    gpus = [tuple(r["gpus"]) for r in placed["ranks"]]
    assert sorted(gpus) == [(0,), (1,)] or len(set(gpus)) == 2
    ray.kill(handle)


def test_transformers_model_job(local_ray, tmp_path):
    ray = local_ray
    spec = tiny_job(
        steps=4,
        model=TINY_GPT2,
        engine={"stage": 3, "bucket_elements": 4096},
    )
    handle, status = _run(ray, "hf", spec, tmp_path / "ckpt")
    assert status == "succeeded", ray.get(handle.status.remote())
    ledgers = ray.get(handle.metrics.remote())
    assert all(
        s["ledger"]["model_states"] == s["ledger"]["expected_padded"] for s in ledgers.values()
    )
    ray.kill(handle)
    # The export loads into the transformers model itself: the names the service's
    # wrapper adds are stripped, as the checkpoint records.
    import transformers
    from safetensors.torch import load_file

    from zeroservice.checkpoint import export_checkpoint

    newest = sorted((tmp_path / "ckpt").glob("step-*"))[-1]
    config = transformers.GPT2Config(**TINY_GPT2["config"])
    exported = load_file(export_checkpoint(newest, tmp_path / "hf.safetensors"))
    transformers.GPT2LMHeadModel(config).load_state_dict(exported, strict=True)
    assert set(exported) == set(transformers.GPT2LMHeadModel(config).state_dict())
    kept = load_file(export_checkpoint(newest, tmp_path / "all.safetensors", prefix=""))
    assert set(kept) == {f"model.{name}" for name in exported}


def test_a_mixture_of_experts_job_at_stage_3_and_one_its_engine_refuses(local_ray, tmp_path):
    """A Mixtral trains at stage 3 with no setting (its MoE layers are leaf modules by
    default); the same job with a misspelt class name fails at start, naming it, without
    restarting; with the leaf modules turned off, its first forward whose ranks read
    different experts fails it, naming the class to set, without restarting."""
    ray = local_ray
    engine = {"stage": 3, "bucket_elements": 1024, "stage3_persistence_elements": 0}
    spec = tiny_job(steps=4, micro_batch=1, model=TINY_MIXTRAL, engine=engine, max_restarts=2)
    handle, status = _run(ray, "moe", spec, tmp_path / "ckpt")
    assert status == "succeeded", ray.get(handle.status.remote())
    assert sorted(ray.get(handle.losses.remote())) == [1, 2, 3, 4]
    ray.kill(handle)
    typo = spec.model_copy(update={"engine": engine | {"stage3_leaf_modules": ["MixtralMoE"]}})
    handle, status = _run(ray, "moe-typo", typo, tmp_path / "typo")
    info = ray.get(handle.status.remote())
    assert status == "failed" and info["reason"] == "config_error", info
    assert "stage3_leaf_modules: 'MixtralMoE' names no module with parameters" in info["message"]
    assert "MixtralSparseMoeBlock" in info["message"]  # among the classes it lists
    assert not [e for e in ray.get(handle.events.remote()) if e["kind"] == "restart"]
    ray.kill(handle)
    off = spec.model_copy(update={"engine": engine | {"stage3_leaf_modules": []}})
    handle, status = _run(ray, "moe-off", off, tmp_path / "off")
    info = ray.get(handle.status.remote())
    assert status == "failed" and info["reason"] == "config_error", info
    assert "on some ranks but not all" in info["message"]
    assert "stage3_leaf_modules=['MixtralSparseMoeBlock']" in info["message"]
    assert not [e for e in ray.get(handle.events.remote()) if e["kind"] == "restart"]
    ray.kill(handle)


def _remote_addresses(pids: set[int]) -> set[str]:
    """Remote ends of every TCP socket the given processes hold (IPv4 and IPv6)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    remotes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[9] not in inodes or cols[3] == "0A":  # 0A: listening
                continue
            host = cols[2].split(":")[0]
            raw = b"".join(bytes.fromhex(host[i : i + 8])[::-1] for i in range(0, len(host), 8))
            addr = ipaddress.ip_address(raw)
            if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
                addr = addr.ipv4_mapped
            remotes.add(str(addr))
    return remotes


def test_everything_stays_on_loopback(local_ray, tmp_path):
    """While a job trains, every TCP connection of Ray's and the ranks' processes has a
    loopback peer: no cloud-metadata probe, no external interface."""
    ray = local_ray
    from workers.jobs import launch, stop

    handle = launch("loopback", tiny_job(steps=100_000), tmp_path / "ckpt")
    wait_for(lambda: ray.get(handle.status.remote())["step"] >= 4, 120, "training")
    remotes = _remote_addresses(set(processes_with(b"ray", b"zeroservice", include_self=True)))
    assert remotes, "no connections found: the check would prove nothing"
    assert all(ipaddress.ip_address(r).is_loopback for r in remotes), remotes
    assert stop("loopback") == "cancelled"
