"""Every fault is detected and named; resume falls back to the newest sound checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from tests.checkpoint import scenarios as sc
from tests.engine.scenarios import Spec
from zeroservice.checkpoint import CheckpointError, describe
from zeroservice.checkpoint.manifest import write_manifest
from zeroservice.launch import run_local

SPEC = Spec(stage=2)


@pytest.fixture
def three_saves(tmp_path):
    """Checkpoints after steps 1, 2 and 3 (keep 3), at N_d = 2."""
    run_local(sc.save_every, 2, SPEC, str(tmp_path), 3, 3)
    return tmp_path, sorted(tmp_path.iterdir())


def _load(path) -> dict:
    return run_local(sc.load_and_continue, 2, SPEC, str(path), 1)[0]


def _try(path) -> str:
    return run_local(sc.try_load, 2, SPEC, str(path))[0]


@pytest.mark.parametrize("background", [False, True])
def test_retention_keeps_the_newest_n(tmp_path, background):
    run_local(sc.save_every, 2, SPEC, str(tmp_path), 4, 2, None, background)
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["step-00000003", "step-00000004"]


def test_a_run_that_went_back_keeps_what_it_saves(three_saves):
    """Back at step 1, the save of step 2 (keep 1) stays, and so does the higher step 3
    of the run it went back past; step 1, older, goes. See [Note: pruning]."""
    root, (first, _, third) = three_saves
    r = run_local(sc.go_back_and_save, 2, SPEC, str(first), str(root), 1)[0]
    assert r["loaded"] == 1 and r["saved"] == str(root / "step-00000002")
    assert [p.name for p in sorted(root.iterdir())] == ["step-00000002", "step-00000003"]
    assert (root / "step-00000002" / "manifest.json").is_file() and third.is_dir()


def test_a_fall_back_past_corrupt_checkpoints_keeps_the_new_save(three_saves):
    """Steps 2 and 3 corrupt: the load falls back to 1, the save of the new step 2 (keep
    1) replaces the corrupt one and stays; the next load skips step 3 and finds it."""
    root, (_, second, third) = three_saves
    for directory in (second, third):
        _corrupt(directory, "truncated")
    r = run_local(sc.go_back_and_save, 2, SPEC, str(root), str(root), 1)[0]
    assert r["loaded"] == 1 and r["saved"] == str(second)
    assert [p.name for p in sorted(root.iterdir())] == ["step-00000002", "step-00000003"]
    again = _load(root)
    assert again["step"] == 2 and [p for p, _ in again["skipped"]] == [str(third)]


def test_pruning_removes_only_what_a_save_wrote(tmp_path):
    """An interrupted save's directory (rank files, temporary names) older than the new
    checkpoint goes; a directory of another name stays, and so do files a save did not
    write (with their directory), in an old checkpoint too."""
    left = tmp_path / "step-00000000"
    left.mkdir()
    (left / "rank-00000.bin").write_bytes(b"x")
    (left / "manifest.json.tmp").write_bytes(b"{")
    for name in ("step-0", "step-00000001"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.txt").write_text("mine")
    run_local(sc.save_every, 2, SPEC, str(tmp_path), 3, 1)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-0", "step-00000001", "step-00000003"], names
    assert [p.name for p in (tmp_path / "step-00000001").iterdir()] == ["notes.txt"]
    assert (tmp_path / "step-0" / "notes.txt").read_text() == "mine"


def _corrupt(directory, how: str) -> str:
    """Damage one checkpoint; return what the error must say."""
    shard = directory / "rank-00001.bin"
    if how == "missing":
        shard.unlink()
        return f"{shard}: missing"
    if how == "truncated":
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
        return f"{shard}: truncated or altered"
    if how == "checksum":
        data = bytearray(shard.read_bytes())
        data[len(data) // 3] ^= 0xFF
        shard.write_bytes(bytes(data))
        return f"{shard}: checksum mismatch in "
    if how == "version":
        manifest = directory / "manifest.json"
        m = json.loads(manifest.read_text())
        m["version"] = 99
        manifest.write_text(json.dumps(m))
        return f"{manifest}: format version 99 is not supported"
    manifest = directory / "manifest.json"
    m = json.loads(manifest.read_text())
    if how == "unsigned":  # a digit changed in place: sound bytes read into the wrong slice
        text = manifest.read_text()
        start = m["segments"][-1]["start"]
        edited = text.replace(f'"start": {start},', f'"start": {start + 1},', 1)
        assert edited != text
        manifest.write_text(edited)
        return f"{manifest}: damaged: its content does not match its digest"
    # Hand edits signed again (a writer that wrote them so), which neither the blocks'
    # checksums nor the digest catch: each of them loaded garbage or failed after the
    # state was written.
    if how == "step":
        m["step"] = 99
        said = f"{manifest}: says step 99, but its directory is {directory.name}"
    elif how in ("dtype", "int master"):
        kind, dtype = ("exp_avg", "float16") if how == "dtype" else ("master", "int32")
        seg = next(s for s in m["segments"] if s["kind"] == kind)
        seg["dtype"] = dtype
        elements = seg["end"] - seg["start"]
        said = {
            "dtype": f"is {seg['bytes']} bytes in the manifest, but {elements} elements of "
            "float16 are",
            "int master": "is int32 in the manifest; masters and optimizer states are",
        }[how]
    elif how == "scalar":
        m["optimizer"]["scalars"][0]["step"]["value"] = "x"
        said = "malformed manifest (TypeError"
    elif how == "rng":
        m["rng"][0]["torch"] = "AAAA"
        said = "rank 0's malformed random state"
    elif how == "kinds":  # a kind dropped from the list: its states would not be read
        m["kinds"].remove("exp_avg_sq")
        said = "lists the state kinds ['exp_avg', 'master'] but its segments hold ['exp_avg', "
    elif how == "segment":  # a parameter's exp_avg dropped: it was taken for a frozen one
        name = m["segments"][-1]["param"]
        m["segments"] = [s for s in m["segments"] if (s["param"], s["kind"]) != (name, "exp_avg")]
        said = f"lists exp_avg_sq of {name} but no exp_avg (an edited or damaged manifest)"
    elif how == "one rank's rng":  # an error of a kind only rank 1 meets: rank 0 waited
        m["rng"][1]["numpy"][1][0] = 2**40
        said = "malformed manifest (OverflowError"
    else:
        raise AssertionError(how)
    write_manifest(directory, m)
    return said


@pytest.mark.parametrize(
    "how",
    ["missing", "truncated", "checksum", "version", "unsigned", "step", "dtype", "int master"]
    + ["scalar", "rng", "kinds", "segment", "one rank's rng"],
)
def test_fault_is_named_and_resume_falls_back(three_saves, how):
    root, dirs = three_saves
    newest = dirs[-1]
    expected = _corrupt(newest, how)
    # Loading that checkpoint by name fails and says which file and what.
    message = _try(newest)
    assert message.startswith("CheckpointError") and expected in message, message
    # Resuming from the root passes over it to the newest sound one.
    r = _load(root)
    assert r["path"] == str(dirs[-2]) and r["step"] == 2
    assert len(r["skipped"]) == 1 and expected in r["skipped"][0][1]


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    with pytest.raises(RuntimeError):  # rank 1 is gone; rank 0 fails on its collective
        run_local(sc.save_every, 2, SPEC, str(tmp_path), 3, 3, 2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-00000001", "step-00000002"]
    assert not (tmp_path / "step-00000002" / "manifest.json").exists()
    r = _load(tmp_path)
    assert r["step"] == 1 and "incomplete" in r["skipped"][0][1]


def test_nothing_valid_is_an_error_listing_each_reason(three_saves):
    root, dirs = three_saves
    for d in dirs:
        _corrupt(d, "checksum")
    message = _try(root)
    assert "no complete, valid checkpoint" in message
    assert all(d.name in message for d in dirs)


def test_a_checkpoint_of_another_model_is_refused_without_fallback(three_saves):
    root, dirs = three_saves
    manifest = dirs[-1] / "manifest.json"
    m = json.loads(manifest.read_text())
    renamed = "blocks.1.mlp.fc.weight"
    for p in m["params"]:
        p["names"] = [n.replace(renamed, "blocks.1.mlp.w") for n in p["names"]]
        p["name"] = p["names"][0]
    write_manifest(dirs[-1], m)
    message = _try(root)  # the newest does not fit: an error, not a silent older load
    assert message.startswith("CheckpointMismatch"), message
    assert f"no entry for parameter {renamed}" in message


def test_a_mismatch_that_one_rank_holds_is_raised_on_every_rank(three_saves):
    """The last parameter lies in the last rank's shard alone: that rank raised, and the
    others waited in their next collective (a hang, or gloo's 'connection reset')."""
    root, dirs = three_saves
    manifest = dirs[-1] / "manifest.json"
    m = json.loads(manifest.read_text())
    last = m["params"][-1]
    renamed = last["names"][0]
    last["names"] = [n + "_other" for n in last["names"]]
    last["name"] = last["names"][0]
    write_manifest(dirs[-1], m)
    messages = run_local(sc.try_load, 2, SPEC, str(root), timeout_s=120)
    for message in messages:
        assert message.startswith("CheckpointMismatch"), messages
        assert f"no entry for parameter {renamed}" in message, messages


def test_a_checkpoint_holding_a_parameter_the_model_lacks_is_refused(three_saves):
    """It loaded without a word, dropping that parameter (strict=True refuses it)."""
    root, dirs = three_saves
    manifest = dirs[-1] / "manifest.json"
    m = json.loads(manifest.read_text())
    m["params"].append({"name": "extra", "names": ["extra"], "shape": [3], "numel": 3})
    write_manifest(dirs[-1], m)
    for message in run_local(sc.try_load, 2, SPEC, str(root), timeout_s=120):
        assert message.startswith("CheckpointMismatch"), message
        assert "holds parameters this model does not have: extra" in message, message


def test_a_manifest_missing_what_the_result_needs_is_skipped_before_anything_is_written(
    three_saves,
):
    """A manifest without its engine counters raised KeyError after the state was written."""
    root, dirs = three_saves
    manifest = dirs[-1] / "manifest.json"
    m = json.loads(manifest.read_text())
    del m["engine"]
    write_manifest(dirs[-1], m)
    r = _load(root)
    assert r["step"] == 2, r  # the next older one, loaded whole
    assert "malformed manifest (KeyError: 'engine')" in str(r["skipped"]), r


@pytest.mark.parametrize("stage", [1, 3])
def test_a_buffer_of_another_shape_is_refused_before_anything_is_written(tmp_path, stage):
    """It was a RuntimeError from a view, after the masters had been written."""
    r = run_local(sc.buffer_of_another_shape, 2, str(tmp_path), stage)[0]
    assert r["message"].startswith("CheckpointMismatch"), r
    assert "buffer table is (16, 1) in the checkpoint and (32, 1) in this model" in r["message"]
    assert r["unchanged"], r


@pytest.mark.parametrize("stage", [0, 3])
def test_the_factorys_hyperparameters_apply_after_a_load_and_differences_are_warned(
    tmp_path, stage
):
    """They used to apply half: the factory's lr (the engine sets the rate from it each
    step) beside the checkpoint's weight decay and betas, without a word."""
    out = run_local(sc.changed_hyperparameters, 2, str(tmp_path), stage)[0]
    assert out["same"]["warnings"] == []
    assert out["same"]["applied"] == (1e-2, 0.1, (0.9, 0.999))
    assert out["changed"]["applied"] == (1e-4, 0.0, (0.8, 0.99))
    (message,) = out["changed"]["warnings"]
    assert message.startswith("load_checkpoint: the optimizer factory's hyperparameters apply")
    for said in (
        "group 0 betas: (0.8, 0.99) here, (0.9, 0.999) in the checkpoint",
        "group 0 weight_decay: 0.0 here, 0.1 in the checkpoint",
        "group 0 lr: 0.0001 here, 0.01 in the checkpoint",
    ):
        assert said in message, message


def test_a_failed_background_save_seen_through_its_handle_is_not_raised_again(tmp_path):
    """The next save raised the old failure again (through the engine's wait for the
    previous save) and wrote nothing."""
    r = run_local(sc.background_save_failed_then_saved, 2, str(tmp_path))[0]
    assert "background save failed" in r["first"] and "No space left" in r["first"], r
    assert r["second"].endswith("step-00000002"), r
    assert (tmp_path / "step-00000002" / "manifest.json").is_file()


def test_a_background_save_failed_on_one_rank_fails_on_every_rank_naming_it(tmp_path):
    """Rank 0 waited out the save's timeout (600 s) for the failed rank's report, and the
    engine's next save with it; run_local's 120 s limit fails the test if it still does."""
    out = run_local(sc.background_save_failed_on_one_rank, 2, str(tmp_path), timeout_s=120)
    assert "background save failed" in out[1]["message"] and "No space left" in out[1]["message"]
    assert "not committed: rank 1: No space left on device" in out[0]["message"], out[0]
    assert not (tmp_path / "step-00000001" / "manifest.json").exists()


@pytest.mark.parametrize(
    "client_state,message",
    [
        ({"t": float("nan")}, "no NaN or infinity"),
        ({"x": object()}, "not JSON serializable"),
        ([1, 2], "expected a dict, got list"),
    ],
)
def test_a_client_state_that_is_not_json_is_refused_before_anything_is_written(
    tmp_path, client_state, message
):
    from zeroservice.checkpoint import save_checkpoint
    from zeroservice.checkpoint.state import Counters, ShardedState

    state = ShardedState(
        units=[],
        masters=[],
        optimizer=torch.optim.SGD([torch.zeros(1)], lr=0.1),
        module=torch.nn.Linear(1, 1),
        whole=True,
        rank=0,
        world=1,
        group=None,
        counters=Counters(1, 1, None),
        pending_micro_steps=0,
    )
    with pytest.raises(CheckpointError, match=f"^client_state: .*{message}"):
        save_checkpoint(state, tmp_path / "root", client_state)
    assert not (tmp_path / "root").exists()


def test_a_tied_checkpoint_loads_into_an_untied_model(three_saves):
    root, _ = three_saves
    assert run_local(sc.try_load, 2, Spec(stage=2, tie=False), str(root))[0] == "loaded"


def test_an_untied_checkpoint_into_a_tied_model_is_refused(tmp_path):
    """It loaded the embedding into the tied pair and dropped the saved head."""
    untied = Spec(stage=2, tie=False)
    run_local(sc.train_and_save, 2, untied, str(tmp_path), 1)
    for message in run_local(sc.try_load, 2, SPEC, str(tmp_path)):
        assert message.startswith("CheckpointMismatch"), message
        assert "wte.weight / head.weight is one tied parameter in this model and 2 in" in message


@pytest.mark.parametrize(
    "saved_with,loaded_with,said",
    [
        ("sgd", "adamw", "the checkpoint was saved by SGD; this engine runs AdamW"),
        ("adamw", "sgd", "the checkpoint was saved by AdamW; this engine runs SGD"),
        ("adamw", "adamw-amsgrad", "amsgrad is on here and was off at the save"),
        ("adamw-amsgrad", "adamw", "loaded and stepped"),
    ],
)
def test_an_optimizer_that_cannot_go_on_from_the_checkpoint_is_refused(
    tmp_path, saved_with, loaded_with, said
):
    """Another class (also one whose checkpoint holds no state: plain SGD), and amsgrad
    turned on (its first step raised KeyError: 'max_exp_avg_sq'), are refused by name."""
    messages = run_local(sc.save_then_load_with, 2, SPEC, str(tmp_path), saved_with, loaded_with)
    assert all(said in m for m in messages), messages


def test_a_path_no_file_system_holds_is_a_checkpoint_error(tmp_path):
    """A name over 255 bytes raised a bare OSError from both save and load."""
    long = tmp_path / ("x" * 300)
    for message in run_local(sc.save_and_load_at, 2, SPEC, str(long)):
        assert message == [f"CheckpointError: {long}: File name too long"] * 2, message


def test_save_between_micro_batches_is_refused(tmp_path):
    message = run_local(sc.save_mid_accumulation, 2, str(tmp_path))[0]
    assert "micro-batch(es) accumulated" in message


def test_inspect_describes_and_verifies(three_saves):
    _, dirs = three_saves
    text = describe(dirs[-1], verify=True)
    assert "step 3" in text and "ZeRO stage 2, fp32, world 2" in text
    assert "every checksum matches" in text and "rank-00001.bin" in text


def test_inspecting_what_is_not_one_checkpoint_says_what_it_is(three_saves):
    """A missing directory, a root of step directories, an uncommitted step: each named."""
    root, dirs = three_saves
    with pytest.raises(CheckpointError, match=r"/nowhere: no such checkpoint directory"):
        describe(root / "nowhere")
    with pytest.raises(
        CheckpointError,
        match=rf"holds 3 step directories, not one checkpoint: .*the last: {dirs[-1]}\)",
    ):
        describe(root)
    (dirs[-1] / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"missing: the checkpoint is incomplete"):
        describe(dirs[-1])


def test_export_to_where_it_cannot_write_is_a_one_line_error(three_saves, tmp_path, capsys):
    """A directory, or a file in a directory that does not exist: refused before a byte
    is read, by the command line in one line, and nothing is written anywhere."""
    from zscli.cli import main

    _, dirs = three_saves
    out = tmp_path / "out"
    out.mkdir()
    cases = {
        str(out): f"a directory: name the file to write: '{out}'",
        str(out / "no" / "m.safetensors"): f"no such directory to write into: '{out / 'no'}'",
    }
    for target, message in cases.items():
        assert main(["checkpoint", "export", str(dirs[-1]), target]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert list(out.iterdir()) == [] and not list(tmp_path.glob("*.tmp"))
    assert main(["checkpoint", "export", str(dirs[-1]), str(out / "m.pt")]) == 0
    assert [p.name for p in out.iterdir()] == ["m.pt"]


@pytest.mark.parametrize("where", ["shard", "manifest", "directory"])
def test_a_full_disk_fails_the_save_not_the_training(tmp_path, where):
    """ENOSPC during step 2's save: every rank gets SaveFailed naming it, nothing of
    that save is left (no temporary file, no step directory), step 1 stays the newest
    sound checkpoint meanwhile, training goes on and step 3's save succeeds."""
    results = run_local(sc.save_on_a_full_disk, 2, SPEC, str(tmp_path), 3, 2, where)
    for r in results:
        first, failed, retried = r["outcomes"]
        assert first == "saved" and retried == "saved"
        assert failed.startswith("SaveFailed: ") and "ENOSPC" in failed, failed
        assert "the previous checkpoint stays the newest" in failed
    after_failure = results[0]["listings"][1]
    assert not any(".tmp" in p or p.startswith("step-00000002") for p in after_failure)
    assert "step-00000001/manifest.json" in after_failure
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000003"]
    assert _load(tmp_path)["step"] == 3
    # The step directory's entry is made durable: its parent is fsynced after it appears.
    assert str(tmp_path) in results[0]["synced"]


def test_after_a_full_disk_the_previous_checkpoint_is_the_newest_sound_one(tmp_path):
    run_local(sc.save_on_a_full_disk, 2, SPEC, str(tmp_path), 2, 2, "shard")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]
    r = _load(tmp_path)
    assert r["step"] == 1 and r["skipped"] == []


def test_a_step_saved_again_keeps_its_checkpoint_when_the_save_fails(tmp_path):
    """Saving the step just loaded used to un-commit it first and, on ENOSPC, remove the
    step directory: the only checkpoint was gone while the error said it stayed."""
    results = run_local(sc.resave_on_a_full_disk, 2, SPEC, str(tmp_path))
    for r in results:
        assert r["failed"].startswith("SaveFailed: ") and "ENOSPC" in r["failed"], r
        assert r["after_failure"] == ["manifest.json", "rank-00000.bin", "rank-00001.bin"]
        assert r["loaded"] == 2
        # With room, the new files replace the old ones after the commit.
        names = r["after_retry"]
        assert len(names) == 3 and "manifest.json" in names, names
        assert not {"rank-00000.bin", "rank-00001.bin"} & set(names), names
