"""Checkpoints on object storage (s3:// through fsspec/s3fs), against moto's S3 server on
127.0.0.1: the same format, commit point, resharding, fallback, pruning and failed-save
guarantees as on local disk (the scenarios are tests/checkpoint/scenarios.py's)."""

from __future__ import annotations

import uuid

import pytest
import torch.distributed as dist

from tests.checkpoint import scenarios as sc
from tests.checkpoint.states import assert_same_states, consolidated
from tests.engine.scenarios import Spec
from tests.s3 import BUCKET
from zeroservice.checkpoint import SaveFailed
from zeroservice.checkpoint.storage import ENDPOINT_ENV, ObjectPath, location, storage_for
from zeroservice.launch import run_local

SPEC = Spec(stage=2)


@pytest.fixture
def root(s3_server) -> str:
    """A fresh prefix in the bucket."""
    return f"s3://{BUCKET}/runs/{uuid.uuid4().hex[:12]}"


def _fs():
    return storage_for(location(f"s3://{BUCKET}")).fs  # type: ignore[attr-defined]


def _steps(root: str) -> list[str]:
    store = storage_for(location(root))
    return sorted(store.list_dirs(location(root)))


@pytest.mark.slow
def test_save_at_dp2_loads_at_dp1_and_dp3_as_from_local_disk(root, tmp_path):
    local = tmp_path / "local"
    s3_losses = run_local(sc.train_and_save, 2, SPEC, root, 3)[0]
    local_losses = run_local(sc.train_and_save, 2, SPEC, str(local), 3)[0]
    assert s3_losses == local_losses
    assert _steps(root) == ["step-00000003"]
    saved = f"{root}/step-00000003"
    assert sorted(_fs().ls(saved.removeprefix("s3://"), detail=False)) == [
        f"{saved.removeprefix('s3://')}/{n}"
        for n in ("manifest.json", "rank-00000.bin", "rank-00001.bin")
    ]
    # The checkpoint read back from S3 equals the one on disk, bit for bit.
    assert_same_states(consolidated(saved), consolidated(local / "step-00000003"))
    for world, stage in [(1, 2), (3, 2)]:
        from_s3, from_disk = tmp_path / f"s3-{world}", tmp_path / f"disk-{world}"
        spec = Spec(stage=stage)
        r = run_local(sc.load_and_continue, world, spec, root, 0, str(from_s3))[0]
        assert r["path"] == saved and r["step"] == 3 and r["skipped"] == []
        run_local(sc.load_and_continue, world, spec, str(local), 0, str(from_disk))
        # What each rank loaded (its masters and Adam's moments), saved again at once.
        assert_same_states(
            consolidated(next(from_s3.iterdir())),
            consolidated(next(from_disk.iterdir())),
        )


@pytest.mark.slow
def test_incomplete_and_corrupt_newer_checkpoints_are_skipped(root):
    run_local(sc.save_every, 2, SPEC, root, 3, 3)
    assert _steps(root) == ["step-00000001", "step-00000002", "step-00000003"]
    fs = _fs()
    # A byte flipped in a rank object of step 3: its block's CRC names it.
    shard = f"{root}/step-00000003/rank-00001.bin".removeprefix("s3://")
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 3] ^= 0xFF
    fs.pipe_file(shard, bytes(data))
    r = run_local(sc.load_and_continue, 2, SPEC, root, 1)[0]
    assert r["step"] == 2 and r["path"] == f"{root}/step-00000002"
    (why,) = [why for _, why in r["skipped"]]
    assert f"s3://{shard}: checksum mismatch in " in why
    # Step 2 without its manifest (an upload that never committed) is skipped too.
    fs.rm_file(f"{root}/step-00000002/manifest.json".removeprefix("s3://"))
    r = run_local(sc.load_and_continue, 2, SPEC, root, 1)[0]
    assert r["step"] == 1
    assert [p for p, _ in r["skipped"]] == [f"{root}/step-00000003", f"{root}/step-00000002"]
    assert "missing: the checkpoint is incomplete" in r["skipped"][1][1]


def save_with_a_failing_upload(spec: Spec, root: str, steps: int, fail_at: int) -> list[str]:
    """Save after every step; at step ``fail_at`` rank 1's upload fails as the store
    would (botocore's error, at the multipart upload's completion)."""
    from botocore.exceptions import EndpointConnectionError

    engine = sc.engine_for(spec)
    fs = storage_for(location(root)).fs  # type: ignore[attr-defined]
    real_open = fs.open

    def failing_open(path, mode="rb", **kwargs):
        f = real_open(path, mode, **kwargs)
        if "w" in mode and engine.global_steps == fail_at and dist.get_rank() == 1:

            def commit():
                raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1")

            f.commit = commit
        return f

    fs.open = failing_open
    outcomes = []
    for step in range(steps):
        sc._train(engine, spec, range(step, step + 1))
        try:
            engine.save_checkpoint(root, client_state={"next_step": step + 1}, keep=10)
            outcomes.append("saved")
        except SaveFailed as exc:
            outcomes.append(f"SaveFailed: {exc}")
        dist.barrier()
        if dist.get_rank() == 0:
            outcomes.append(" ".join(_steps(root)))
    fs.open = real_open
    return outcomes


@pytest.mark.slow
def test_a_failed_upload_fails_the_save_not_the_training(root, s3_server):
    results = run_local(save_with_a_failing_upload, 2, SPEC, root, 3, 2)
    for r in results:
        saves = r[::2] if len(r) == 6 else r
        assert saves[0] == "saved" and saves[2] == "saved", r
        assert saves[1].startswith("SaveFailed: ") and "EndpointConnectionError" in saves[1]
        assert "the previous checkpoint stays the newest" in saves[1]
    listings = results[0][1::2]
    assert listings[1] == "step-00000001"  # nothing of step 2 is left
    assert _steps(root) == ["step-00000001", "step-00000003"]
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server[ENDPOINT_ENV])
    assert client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []) == []
    assert run_local(sc.load_and_continue, 2, SPEC, root, 1)[0]["step"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True])
def test_prune_keeps_the_newest_n(root, background):
    run_local(sc.save_every, 2, SPEC, root, 4, 2, None, background)
    assert _steps(root) == ["step-00000003", "step-00000004"]
    leftovers = [p for p in _fs().find(root.removeprefix("s3://")) if "report" in p]
    assert leftovers == []


@pytest.mark.slow
def test_a_background_save_resumes_exactly(root):
    r = run_local(sc.exact_resume, 2, Spec(stage=1, steps=6), root, 3, True)[0]
    assert r["step"] == 3 and r["resumed"] == r["straight"]


def test_object_paths_join_like_paths():
    p = location("s3://bucket/a/b/")
    assert isinstance(p, ObjectPath) and str(p) == "s3://bucket/a/b"
    assert str(p / "step-00000001") == "s3://bucket/a/b/step-00000001"
    assert p.name == "b" and str(p.parent) == "s3://bucket/a" and p.key == "bucket/a/b"
    with pytest.raises(ValueError):
        ObjectPath("s3://")


def test_a_changed_endpoint_reaches_the_new_server(monkeypatch):
    pytest.importorskip("s3fs")
    loc = ObjectPath("s3://bucket/key")
    monkeypatch.setenv(ENDPOINT_ENV, "http://127.0.0.1:1")
    first = storage_for(loc)
    monkeypatch.setenv(ENDPOINT_ENV, "http://127.0.0.1:2")
    second = storage_for(loc)
    assert first.fs.endpoint_url == "http://127.0.0.1:1"  # type: ignore[attr-defined]
    assert second.fs.endpoint_url == "http://127.0.0.1:2"  # type: ignore[attr-defined]
    assert storage_for(loc) is second  # one client per endpoint, not one per call
