"""The local stack as a user starts it (`zeroservice up`), for the end-to-end tests."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from zeroservice.launch import free_port

TINY_JOB = {
    "model": {"vocab_size": 256, "seq_len": 16, "n_layer": 2, "n_head": 4, "dim": 32},
    "engine": {"stage": 3, "bucket_elements": 4096},
    "optimizer": {"lr": 3e-3},
    "micro_batch": 2,
    "resources": {"dp": 2, "cpus_per_rank": 1},
    "timeouts": {"bootstrap_s": 120, "step_s": 120},
}
"""A stage-3 GPT on 2 CPU ranks, small enough for a step in milliseconds."""


@pytest.fixture
def stack_env() -> dict[str, str]:
    """Settings of the stack beyond its home and port (a test module may override it)."""
    return {}


@pytest.fixture
def stack(tmp_path, stack_env):
    env = dict(
        os.environ,
        ZEROSERVICE_HOME=str(tmp_path / "home"),
        ZEROSERVICE_PORT=str(free_port()),
        **stack_env,
    )

    def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "zscli.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    up = cli("up", "--cpus", "4")
    assert up.returncode == 0, up.stdout + up.stderr
    assert "zeroservice is up at http://127.0.0.1:" in up.stdout
    yield cli, env, tmp_path
    down = cli("down")
    assert down.returncode == 0, down.stderr
