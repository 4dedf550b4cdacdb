"""Schemathesis over the whole OpenAPI schema, on SQLite and on PostgreSQL: every phase
(the schema's examples, boundary values of every parameter, random valid and invalid
requests, then sequences of calls chained by the ids responses return), a bounded
number of examples each. No request may get a server error, and every response must be
one the schema describes: its status, content type, headers and body (every check
but one). Left out: that a request the schema allows is accepted. The service refuses
more than a JSON schema can say (a synthetic dataset given a path, an integer written
``6.0``: see docs/api.md), with a 422 naming the field."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.api.conftest import Harness, serve
from tests.api.test_routes import TINY

MAX_EXAMPLES = 15


@pytest.fixture
def harness(database_url, tmp_path):
    """A service whose rate limit the fuzzing does not reach (it is tested elsewhere)."""
    h = Harness(database_url, tmp_path / "data", rate_per_s=1e9, rate_burst=10**9)
    yield h
    h.client.close()
    h.service.engine.dispose()


@pytest.fixture
def served(harness):
    """The harness's app behind a real HTTP server on loopback."""
    with serve(harness) as url:
        yield url


def test_schemathesis_finds_no_server_error(harness, served, tmp_path):
    auth = harness.headers(harness.admin)
    harness.client.post("/v1/jobs", json={"spec": TINY}, headers=auth)  # one to find
    cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert cli is not None, "schemathesis is in the dev extra"
    run = subprocess.run(
        [
            cli,
            "run",
            f"{served}/openapi.json",
            "--checks=all",
            "--exclude-checks=positive_data_acceptance",
            "--phases=examples,coverage,fuzzing,stateful",
            f"--max-examples={MAX_EXAMPLES}",
            "--generation-deterministic",
            "--continue-on-failure",
            "--request-timeout=60",
            f"--header=Authorization:{auth['Authorization']}",
            "--workers=1",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "Stateful" in run.stdout
