"""Exact resume, resharding across world sizes and stages, export."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from tests.checkpoint import scenarios as sc
from tests.checkpoint.states import assert_same_states, consolidated
from tests.engine.scenarios import TINY, Spec
from zeroservice.checkpoint import CheckpointError, export_checkpoint, iter_tensors
from zeroservice.launch import run_local
from zeroservice.models import GPT, GPTConfig


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_exact_resume_at_the_same_world_size(tmp_path, stage):
    spec = Spec(stage=stage, steps=6)
    r = run_local(sc.exact_resume, 2, spec, str(tmp_path), 3)[0]
    assert r["step"] == 3
    assert r["resumed"] == r["straight"]  # fp32: bit for bit


@pytest.mark.parametrize("stage", [1, 3])
def test_background_save_resumes_exactly(tmp_path, stage):
    spec = Spec(stage=stage, steps=6)
    r = run_local(sc.exact_resume, 2, spec, str(tmp_path), 3, True)[0]
    assert r["resumed"] == r["straight"]
    assert not list(tmp_path.glob("*/*.json.tmp")) and not list(tmp_path.glob("*/*report*"))


def test_exact_resume_with_accumulation_and_bf16(tmp_path):
    spec = Spec(stage=3, steps=5, accum=2, precision="bf16", clip=0.05)
    r = run_local(sc.exact_resume, 2, spec, str(tmp_path), 2)[0]
    assert r["resumed"] == r["straight"]


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory):
    """Stage 2 at N_d = 4, three steps, saved."""
    root = tmp_path_factory.mktemp("ckpt4")
    losses = run_local(sc.train_and_save, 4, Spec(stage=2), str(root), 3)[0]
    (directory,) = sorted(root.iterdir())
    return directory, losses


@pytest.mark.parametrize("world,stage", [(2, 3), (3, 1), (4, 0), (1, 2)])
def test_load_at_another_world_size_and_stage(tmp_path, saved_at_4, world, stage):
    saved_at_4, saved_losses = saved_at_4
    resaved = tmp_path / "resaved"
    r = run_local(sc.load_and_continue, world, Spec(stage=stage), str(saved_at_4), 3, str(resaved))[
        0
    ]
    assert r["step"] == 3 and r["skipped"] == []
    # What the new layout holds, saved again at once, is exactly what was saved.
    assert_same_states(consolidated(saved_at_4), consolidated(next(resaved.iterdir())))
    # ... and training continues from there.
    assert all(torch.isfinite(torch.tensor(r["losses"])))
    assert r["losses"][-1] < saved_losses[0]


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_export_loads_into_the_plain_model_and_matches_the_engine(tmp_path, saved_at_4, fmt):
    saved_at_4, _ = saved_at_4
    r = run_local(sc.load_and_continue, 2, Spec(stage=3), str(saved_at_4), 0)[0]
    out = export_checkpoint(saved_at_4, tmp_path / f"model.{fmt}", fmt)
    if fmt == "safetensors":
        from safetensors.torch import load_file

        state = load_file(out)
    else:
        state = torch.load(out, weights_only=True)
    model = GPT(GPTConfig(**TINY))
    model.load_state_dict(state)  # strict: every key present, no extra
    model.eval()
    with torch.no_grad():
        logits = model(r["input"])
    torch.testing.assert_close(logits, r["logits"], rtol=0, atol=1e-6)
    masters = dict(iter_tensors(saved_at_4))
    torch.testing.assert_close(state["head.weight"], masters["wte.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_a_tensor_of_no_elements_is_exported(tmp_path, fmt):
    """It has no segment: the export refused the sound checkpoint ('no master data')."""
    state = run_local(sc.save_empty_tensors, 2, str(tmp_path / "ckpt"))[0]
    [step] = (tmp_path / "ckpt").iterdir()
    out = export_checkpoint(step, tmp_path / f"model.{fmt}", fmt)
    if fmt == "safetensors":
        from safetensors.torch import load_file

        exported = load_file(out)
    else:
        exported = torch.load(out, weights_only=True)
    sc.EmptyTensors().load_state_dict(exported)  # strict
    assert exported.keys() == state.keys()
    for name, tensor in state.items():
        assert exported[name].dtype == tensor.dtype, name
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0)
    assert dict(iter_tensors(step))["empty"].shape == (0, 8)


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_export_under_a_prefix_writes_those_names_without_it(tmp_path, saved_at_4, fmt):
    """A sub-module's own state dict (what a wrapped model's export needs); a prefix no
    name has is refused by name, with nothing written."""
    saved_at_4, _ = saved_at_4
    out = export_checkpoint(saved_at_4, tmp_path / f"block.{fmt}", fmt, prefix="blocks.1.")
    if fmt == "safetensors":
        from safetensors.torch import load_file

        state = load_file(out)
    else:
        state = torch.load(out, weights_only=True)
    block = GPT(GPTConfig(**TINY)).blocks[1]
    assert set(state) == set(block.state_dict())
    block.load_state_dict(state)  # strict
    masters = dict(iter_tensors(saved_at_4))
    torch.testing.assert_close(state["mlp.fc.weight"], masters["blocks.1.mlp.fc.weight"])
    with pytest.raises(CheckpointError, match=r"no parameter or buffer name begins with 'nope\.'"):
        export_checkpoint(saved_at_4, tmp_path / "none.pt", "pt", prefix="nope.")
    assert not (tmp_path / "none.pt").exists()


def test_export_streams_one_parameter_at_a_time(tmp_path):
    psi = run_local(sc.save_medium, 2, str(tmp_path / "ckpt"))[0]
    directory = next((tmp_path / "ckpt").iterdir())
    out = tmp_path / "medium.safetensors"
    peak = run_local(sc.export_peak, 1, str(directory), str(out), start="spawn")[0]
    assert out.stat().st_size > 4 * psi  # every parameter, fp32 (tied names twice)
    # The largest parameter (the 8192 x 512 embedding) is 16 MiB, the model 168 MB. An
    # export holding the model would need all of it; streaming keeps two or three of the
    # largest parameters (one being read, the ones freed before it, kept by malloc).
    assert peak < 4 * 16.8e6 and peak < 0.4 * 4 * psi, (peak, 4 * psi)


def test_export_writes_beside_its_destination_under_a_name_of_its_own(tmp_path, saved_at_4):
    """A device, a pipe or a socket is refused, not replaced by a regular file (a rename
    over /dev/full did that); a user's ``<name>.tmp`` is left alone; the file gets the
    mode the umask gives a new file."""
    directory, _ = saved_at_4
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    with pytest.raises(OSError, match="not a regular file"):
        export_checkpoint(directory, pipe)
    assert stat.S_ISFIFO(os.stat(pipe).st_mode)
    mine = tmp_path / "model.safetensors.tmp"
    mine.write_text("the user's")
    mask = os.umask(0o022)
    try:
        out = export_checkpoint(directory, tmp_path / "model.safetensors")
    finally:
        os.umask(mask)
    assert mine.read_text() == "the user's"
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model.safetensors",
        "model.safetensors.tmp",
        "pipe",
    ]
