"""A model's persistent buffers in a checkpoint: loaded by name as strictly as
parameters are, saved per rank where ranks keep their own (``broadcast_buffers=False``),
and exported under every name a shared buffer is registered under."""

from __future__ import annotations

import json

import torch

from tests.checkpoint.buffer_scenarios import (
    Normed,
    SharedTable,
    load_into,
    rank_buffers_resume,
    save_and_load_shared,
    save_normed,
)
from zeroservice.checkpoint import export_checkpoint
from zeroservice.launch import run_local


def test_each_ranks_own_buffers_resume_bit_for_bit(tmp_path):
    for rank, r in enumerate(run_local(rank_buffers_resume, 2, str(tmp_path), timeout_s=300)):
        assert all(r["loaded"]) and all(r["resumed"]), (rank, r)
    # ... and the export, a plain model's state, is rank 0's.
    (step,) = sorted(tmp_path.iterdir())
    manifest = json.loads((step / "manifest.json").read_text())
    ranks = {s.get("rank") for s in manifest["segments"] if s["kind"] == "buffer"}
    assert ranks == {0, 1}
    state = torch.load(export_checkpoint(step, tmp_path / "m.pt", "pt"), weights_only=True)
    Normed().load_state_dict(state, strict=True)


def test_a_buffer_the_model_lacks_is_refused_by_name(tmp_path):
    """BatchNorm's statistics saved, loaded into one that tracks none: refused as
    ``load_state_dict(strict=True)`` refuses it, on every rank, instead of dropped."""
    run_local(save_normed, 2, str(tmp_path), timeout_s=200)
    for said in run_local(load_into, 2, str(tmp_path), False, timeout_s=200):
        assert "the checkpoint holds buffers this model does not have" in said, said
        assert "bn.num_batches_tracked, bn.running_mean, bn.running_var" in said, said


def test_a_shared_buffer_is_exported_under_each_of_its_names(tmp_path):
    keys = run_local(save_and_load_shared, 1, str(tmp_path), timeout_s=200)[0]
    (step,) = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    state = torch.load(export_checkpoint(step, tmp_path / "m.pt", "pt"), weights_only=True)
    assert sorted(state) == keys
    assert torch.equal(state["a.table"], state["b.table"])
    SharedTable().load_state_dict(state, strict=True)


def test_a_step_directory_without_a_manifest_says_so(tmp_path):
    run_local(save_normed, 1, str(tmp_path), timeout_s=200)
    (step,) = sorted(tmp_path.iterdir())
    (step / "manifest.json").unlink()

    said = run_local(load_into, 1, str(step), timeout_s=200)[0]
    assert f"{step}/manifest.json: missing: the checkpoint is incomplete" in said, said
