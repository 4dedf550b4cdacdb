"""The ``zeroservice`` command: the demo, and checkpoint inspect / export."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoint import scenarios as sc
from tests.engine.scenarios import TINY, Spec
from zeroservice.launch import run_local
from zeroservice.models import GPT, GPTConfig
from zscli.cli import main


def test_demo_trains_at_stage3_and_reports(tmp_path, capsys):
    out = tmp_path / "demo.json"
    assert main(["demo", "--steps", "4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ZeRO stage 3" in text and "(equal: True)" in text
    assert "Ψ (paper: 3Ψ at stage 3)" in text
    result = json.loads(out.read_text())
    assert result["losses"][-1] < result["losses"][0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    run_local(sc.train_and_save, 2, Spec(stage=3), str(root), 2)
    return next(root.iterdir())


def test_inspect(checkpoint, capsys):
    assert main(["checkpoint", "inspect", str(checkpoint), "--verify"]) == 0
    text = capsys.readouterr().out
    assert "ZeRO stage 3, fp32, world 2" in text and "every checksum matches" in text


def test_export_both_formats(checkpoint, tmp_path, capsys):
    for name in ("model.safetensors", "model.pt"):
        assert main(["checkpoint", "export", str(checkpoint), str(tmp_path / name)]) == 0
    assert "wrote" in capsys.readouterr().out
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    GPT(GPTConfig(**TINY)).load_state_dict(state)


def test_errors_are_one_line_and_exit_1(tmp_path, capsys):
    assert main(["checkpoint", "inspect", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("zeroservice: ") and "manifest.json: missing" in err
    assert main(["checkpoint", "export", str(tmp_path), str(tmp_path / "x"), "--format", "pt"]) == 1


@pytest.mark.parametrize("where", ["missing/report.json", "."])
def test_demo_refuses_a_json_destination_it_cannot_write_before_training(tmp_path, capsys, where):
    """It trained the whole demo, then ended in an OSError traceback."""
    target = tmp_path / where
    assert main(["demo", "--json", str(target)]) == 2
    err = capsys.readouterr()
    assert "training the reference GPT" not in err.out
    assert f"--json {target}: " in err.err


def test_output_to_a_reader_that_went_away_ends_quietly():
    """`zeroservice plan --paper | head -1`: the pipe closed, the command ends with the
    status of a process ended by SIGPIPE and no traceback."""
    read, write = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "zscli.cli", "plan", "--paper"],
        stdout=write,
        stderr=subprocess.PIPE,
        cwd=Path(__file__).parents[1],
    )
    os.close(write)
    os.close(read)  # before the command has imported anything, let alone printed
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGPIPE, err.decode()
    assert err == b""


def test_a_broken_pipe_that_is_not_standard_output_is_an_error(monkeypatch):
    """Only a reader of the output gone away ends quietly; a broken pipe elsewhere (a
    socket, a FIFO being written) is raised as it was."""
    from zscli import plan_cli

    def broken(args):
        raise BrokenPipeError("a socket's peer went away")

    monkeypatch.setattr(plan_cli, "run_plan", broken)
    with pytest.raises(BrokenPipeError, match="socket"):
        main(["plan", "--params", "1e9", "--paper"])


def test_a_demo_of_one_step_reports_without_measuring(capsys):
    """Its warm-up was fixed at 3 steps: 3 steps or fewer failed on the schedule."""
    assert main(["demo", "--steps", "1", "--world", "1"]) == 0
    out = capsys.readouterr().out
    assert "loss" in out and "communication per rank: not measured" in out
