"""Experiment tracking: what a job's tracker writes is read back with TensorBoard's
event reader and an MLflow client on a local file store; the control plane fills in
the service's defaults and refuses servers it does not allow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from api.confine import Refused, confine
from api.settings import Settings
from tests.api.fakes import point
from workers.spec import JobSpec
from workers.tracking import Tracker, allow_file_store, tensorboard_dir

SPEC = {
    "name": "tracked",
    "model": {"vocab_size": 256, "seq_len": 16, "n_layer": 2, "n_head": 4, "dim": 32},
    "engine": {"stage": 2},
    "steps": 6,
    "tracking": {"tensorboard": True, "mlflow": True},
}


def _track(tmp_path: Path, uri: str) -> tuple[Tracker, JobSpec, Path]:
    spec = JobSpec.model_validate(
        {**SPEC, "tracking": {**SPEC["tracking"], "mlflow_uri": uri, "experiment": "team-a"}}
    )
    root = tmp_path / "checkpoints" / "job-1"
    errors: list[tuple[str, str]] = []
    tracker = Tracker("job-1", spec, str(root), lambda sink, msg: errors.append((sink, msg)))
    tracker.steps([point(s, 5.0 - s / 10) for s in range(1, 4)])
    tracker.checkpoint(3, str(root / "step-00000003"))
    tracker.steps([point(s, 5.0 - s / 10) for s in range(4, 7)])
    tracker.steps([point(6, 99.0)])  # redone after a restart: the first value stays
    tracker.checkpoint(6, str(root / "step-00000006"))
    tracker.close("succeeded")
    assert errors == []
    return tracker, spec, root


def test_tensorboard_and_mlflow_runs_read_back(tmp_path):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    uri = (tmp_path / "mlruns").as_uri()
    _, spec, root = _track(tmp_path, uri)

    events = EventAccumulator(str(tensorboard_dir(str(root), "job-1")))
    events.Reload()
    tags = events.Tags()
    assert {"train/loss", "train/grad_norm", "train/lr", "train/tokens_per_second"} <= set(
        tags["scalars"]
    )
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4, 5, 6]
    assert [e.value for e in loss] == pytest.approx([5.0 - s / 10 for s in range(1, 7)])
    assert {"spec/text_summary", "checkpoint/text_summary"} <= set(tags["tensors"])

    allow_file_store()  # how MLflow 3 reads a file store
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("team-a")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked-job-1"
    params = run.data.params
    assert params["name"] == "tracked" and params["engine.stage"] == "2"
    assert params["model.dim"] == "32" and params["optimizer.betas"] == "[0.9, 0.999]"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, round(m.value, 6)) for m in history) == [
        (s, round(5.0 - s / 10, 6)) for s in range(1, 7)
    ]
    assert len(client.get_metric_history(run.info.run_id, "memory_peak_bytes")) == 6
    # Checkpoints by reference: a small JSON artifact naming each one, no shard copied.
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")]
    assert artifacts == ["checkpoints/step-00000003.json", "checkpoints/step-00000006.json"]
    local = client.download_artifacts(run.info.run_id, artifacts[1], str(tmp_path / "dl"))
    reference = json.loads(Path(local).read_text())
    assert reference["step"] == 6 and reference["path"] == str(root / "step-00000006")
    assert run.data.tags["checkpoint"] == str(root / "step-00000006")
    assert run.data.tags["zeroservice.job_id"] == "job-1"


def test_a_failing_sink_is_reported_and_switched_off(tmp_path):
    spec = JobSpec.model_validate({**SPEC, "tracking": {"tensorboard": True}})
    root = tmp_path / "root"
    root.mkdir()
    (root / "tensorboard").write_text("a file where the directory would go")
    errors: list[tuple[str, str]] = []
    tracker = Tracker("job-2", spec, str(root), lambda sink, msg: errors.append((sink, msg)))
    tracker.steps([point(1, 1.0)])
    tracker.steps([point(2, 1.0)])
    tracker.close("failed")
    assert len(errors) == 1 and errors[0][0] == "tensorboard"


def test_the_service_fills_in_tracking_defaults_and_confines_servers(tmp_path):
    settings = Settings(data_dir=tmp_path, mlflow_uris=("http://mlflow.internal:5000",))
    spec = JobSpec.model_validate(SPEC)
    confined = confine(spec, "alice", settings).tracking
    assert confined.mlflow_uri == (tmp_path / "mlruns").absolute().as_uri()
    assert confined.experiment == "alice"
    allowed = spec.tracking.model_copy(update={"mlflow_uri": "http://mlflow.internal:5000"})
    named = confine(spec.model_copy(update={"tracking": allowed}), "alice", settings)
    assert named.tracking.mlflow_uri == "http://mlflow.internal:5000"
    for uri in ("file:///etc", "http://169.254.169.254/"):
        other = spec.tracking.model_copy(update={"mlflow_uri": uri})
        with pytest.raises(Refused, match="tracking.mlflow_uri"):
            confine(spec.model_copy(update={"tracking": other}), "alice", settings)
    off = JobSpec.model_validate({**SPEC, "tracking": {}})
    assert confine(off, "alice", settings).tracking.mlflow_uri is None


@pytest.mark.parametrize(
    ("named", "stored"),
    [(None, "alice"), ("bob", "alice/bob"), ("alice", "alice"), ("alice/runs", "alice/runs")],
)
def test_a_named_experiment_stays_in_the_tenants_namespace(tmp_path, named, stored):
    """Tenants share the tracking server and a tenant's default experiment is its name:
    a bare name must not reach another tenant's experiment."""
    settings = Settings(data_dir=tmp_path)
    tracking = {**SPEC["tracking"], "experiment": named}
    spec = JobSpec.model_validate({**SPEC, "tracking": tracking})
    confined = confine(spec, "alice", settings)
    assert confined.tracking.experiment == stored
    assert confine(confined, "alice", settings).tracking.experiment == stored
