"""Queued jobs make an autoscaling cluster grow, and a drained queue lets it shrink.

The cluster is Ray's fake multi-node provider (RAY_FAKE_CLUSTER=1): a real autoscaler
that starts and stops real raylets on this machine (loopback) as it would cloud
nodes. The head has no CPUs, so a job fits only once the autoscaler has answered the
scheduler's ``request_resources``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.e2e.conftest import free_port
from zscli.server import processes_with, terminate

pytestmark = pytest.mark.slow


def _autoscaling_config(gcs: str) -> dict:
    return {
        "cluster_name": "fake-autoscaling",
        "max_workers": 2,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.1,
        "provider": {
            "type": "fake_multinode",
            "gcs_address": gcs,
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            "ray.worker.cpu": {
                "resources": {"CPU": 2},
                "node_config": {},
                "min_workers": 0,
                "max_workers": 2,
            },
        },
        "head_node_type": "ray.head.default",
        "auth": {"ssh_user": "nobody"},
        "docker": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


@pytest.fixture
def autoscaling_head():
    from workers.cluster import loopback_env

    work = Path(tempfile.mkdtemp(prefix="zs-as-"))  # Ray's socket paths must stay short
    port = free_port()
    gcs = f"127.0.0.1:{port}"
    config = work / "autoscaling.json"
    config.write_text(json.dumps(_autoscaling_config(gcs)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env.update(loopback_env(work / "home"))
    env.update(RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_AUTH_MODE="disabled")
    ray_bin = str(Path(sys.executable).parent / "ray")
    subprocess.run(
        [
            ray_bin,
            "start",
            "--head",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--num-cpus=0",
            f"--autoscaling-config={config}",
            "--include-dashboard=false",
            f"--temp-dir={work / 'ray'}",
            "--disable-usage-stats",
        ],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    yield gcs, work, env
    # Stop this head and the nodes its autoscaler started (never a machine-wide stop).
    terminate(processes_with(str(work).encode(), gcs.encode()), grace_s=0)
    shutil.rmtree(work, ignore_errors=True)


def test_queue_grows_the_cluster_and_a_drained_queue_releases_it(autoscaling_head, tmp_path):
    gcs, work, env = autoscaling_head
    code = f"""
import json, sys, time
sys.path.insert(0, {str(Path(__file__).parents[2])!r})
from workers.cluster import use_loopback
use_loopback({str(work / "home")!r})
import ray
ray.init(address={gcs!r}, namespace="zeroservice", log_to_driver=False)
from api.service import Service
from api.backend import RayBackend
from api.settings import Settings
from api import store
from api.confine import checkpoint_base
from workers.spec import JobSpec
settings = Settings(data_dir={str(tmp_path / "data")!r}, max_cluster={{"CPU": 4.0}})
service = Service(settings, RayBackend(), start_scheduler=False)
backend = service.backend
spec = JobSpec.model_validate({{
    "name": "scaled", "steps": 6, "micro_batch": 2,
    "model": {{"vocab_size": 256, "seq_len": 16, "n_layer": 2, "n_head": 4, "dim": 32}},
    "resources": {{"dp": 2, "cpus_per_rank": 1}}, "checkpoint": {{"interval_steps": 3}},
    "timeouts": {{"bootstrap_s": 120, "step_s": 120}}}})
with service.sessions() as s:
    admin = store.authenticate(s, service.bootstrap_token)
    base = checkpoint_base(settings, admin.tenant)
    job = store.submit(s, admin, spec.model_dump(mode="json"), "scaled", None, 0, base).job
log = {{"cpus": [], "requests": []}}
def tick():
    service.scheduler.tick()
    log["cpus"].append(ray.cluster_resources().get("CPU", 0.0))
    log["requests"].append(list(backend.requested))
    with service.sessions() as s:
        return s.get(type(job), job.id).status
deadline = time.monotonic() + 240
status = tick()
while status not in ("succeeded", "failed") and time.monotonic() < deadline:
    time.sleep(1.0)
    status = tick()
log["status"] = status
deadline = time.monotonic() + 120
while ray.cluster_resources().get("CPU", 0.0) > 0 and time.monotonic() < deadline:
    time.sleep(1.0)
    tick()
log["cpus_after"] = ray.cluster_resources().get("CPU", 0.0)
print(json.dumps(log))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=500
    )
    assert out.returncode == 0, out.stderr[-3000:]
    log = json.loads(out.stdout.strip().splitlines()[-1])
    # The queued job asked for its two 1-CPU bundles; the autoscaler added a node.
    assert log["cpus"][0] == 0.0
    assert log["requests"][0] == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert max(log["cpus"]) >= 2.0
    assert log["status"] == "succeeded"
    # The queue drained: the request was withdrawn and the idle node released.
    assert log["requests"][-1] == []
    assert log["cpus_after"] == 0.0
