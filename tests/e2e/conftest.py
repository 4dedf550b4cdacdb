"""The local stack as a user starts it (`zeroservice up`), for the end-to-end tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def stack(tmp_path):
    env = dict(
        os.environ, ZEROSERVICE_HOME=str(tmp_path / "home"), ZEROSERVICE_PORT=str(free_port())
    )

    def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "api.cli", *args],
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
