"""The manifest's own digest, without ranks: what is signed reads back, what is not is
refused (see [Note: the manifest's own digest] in zeroservice/checkpoint/manifest.py)."""

from __future__ import annotations

import json

import pytest

from zeroservice.checkpoint import CheckpointError
from zeroservice.checkpoint.manifest import FORMAT, VERSION, read_manifest, write_manifest


def _manifest(**extra) -> dict:
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": 7,
        "world_size": 2,
        "stage": 2,
        "precision": "fp32",
        "params": [{"name": "w", "names": ["w"], "shape": [3], "numel": 3}],
        "segments": [{"param": "w", "kind": "master", "start": 0, "end": 3, "lr": 0.1}],
        "files": {"rank-00000.bin": 12},
        **extra,
    }


def test_a_signed_manifest_reads_back_whatever_its_client_state_holds(tmp_path):
    directory = tmp_path / "step-00000007"
    directory.mkdir()
    # Int keys become strings through JSON, and floats read back exactly.
    client = {"client_state": {1: "one", "lr": 1e-4 / 3, "nested": [0.1, 2**60]}}
    write_manifest(directory, _manifest(**client))
    read = read_manifest(directory)
    assert read["client_state"] == {"1": "one", "lr": 1e-4 / 3, "nested": [0.1, 2**60]}
    assert len(read["digest"]) == 64


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m["segments"][0].update(start=1),
        lambda m: m["segments"][0].update(lr=0.1000001),
        lambda m: m["files"].update({"rank-00000.bin": 13}),
        lambda m: m["params"][0]["names"].append("v"),
        lambda m: m.update(digest=m["digest"][:-1] + "0"),
    ],
    ids=["start", "float", "file size", "a name added", "the digest itself"],
)
def test_a_manifest_changed_after_it_was_signed_is_refused(tmp_path, edit):
    directory = tmp_path / "step-00000007"
    directory.mkdir()
    write_manifest(directory, _manifest())
    path = directory / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m, indent=1))
    with pytest.raises(CheckpointError, match="damaged: its content does not match its digest"):
        read_manifest(directory)


def test_the_writers_layout_is_not_part_of_the_digest(tmp_path):
    directory = tmp_path / "step-00000007"
    directory.mkdir()
    write_manifest(directory, _manifest())
    path = directory / "manifest.json"
    m = json.loads(path.read_text())
    path.write_text(json.dumps(dict(reversed(list(m.items())))))  # one line, keys reordered
    assert read_manifest(directory)["step"] == 7


def test_a_manifest_from_before_the_digest_reads_as_before(tmp_path):
    directory = tmp_path / "step-00000007"
    directory.mkdir()
    (directory / "manifest.json").write_text(json.dumps(_manifest(version=1)))
    assert read_manifest(directory)["step"] == 7


def test_a_manifest_whose_digest_was_removed_is_refused(tmp_path):
    """Removing the digest must not switch its check off: this build's manifests are
    version 2, which always carries it (only a version-1 manifest may lack it)."""
    directory = tmp_path / "step-00000007"
    directory.mkdir()
    write_manifest(directory, _manifest())
    path = directory / "manifest.json"
    m = json.loads(path.read_text())
    assert m["version"] == 2
    del m["digest"]
    m["step"] = 7  # an edit the digest would have caught
    m["segments"][0]["start"] = 1
    path.write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="damaged: its digest is missing"):
        read_manifest(directory)


def test_a_step_other_than_its_directorys_is_refused(tmp_path):
    directory = tmp_path / "step-00000008"
    directory.mkdir()
    write_manifest(directory, _manifest())
    with pytest.raises(CheckpointError, match="says step 7, but its directory is step-00000008"):
        read_manifest(directory)
    other = tmp_path / "exported"  # a directory named otherwise: nothing to compare
    other.mkdir()
    write_manifest(other, _manifest())
    assert read_manifest(other)["step"] == 7
