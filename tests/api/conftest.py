"""Stores for the API tests: SQLite files, and a real PostgreSQL server started here
from the machine's server binaries (initdb / pg_ctl) on loopback."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi.testclient import TestClient

from api.main import create_app
from api.service import Service
from api.settings import Settings
from tests.api.fakes import FakeBackend
from zeroservice.launch import free_port


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for candidate in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True):
        return str(candidate)
    return None


def _as_postgres_user(cmd: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: run its binaries as the postgres user then."""
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


class PostgresServer:
    """A PostgreSQL server of its own (initdb, pg_ctl) on loopback, which a test may
    stop and start again on the same port."""

    def __init__(self) -> None:
        initdb, self.pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
        if initdb is None or self.pg_ctl is None:
            pytest.fail("PostgreSQL server binaries (initdb, pg_ctl) are not on this machine")
        self.base = Path(tempfile.mkdtemp(prefix="zs-pg-"))
        self.data = self.base / "data"
        if os.geteuid() == 0:
            shutil.chown(self.base, "postgres")
        self.port = free_port()
        subprocess.run(
            _as_postgres_user(
                [initdb, "-D", str(self.data), "-U", "zs", "-A", "trust", "-E", "UTF8"]
            ),
            check=True,
            capture_output=True,
        )
        self.url = f"postgresql+psycopg://zs@127.0.0.1:{self.port}"
        self.start()

    def _ctl(self, *args: str, check: bool = True) -> None:
        cmd = [str(self.pg_ctl), "-D", str(self.data), *args]
        subprocess.run(_as_postgres_user(cmd), check=check, capture_output=True)

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._ctl("-o", opts, "-l", str(self.base / "log"), "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self._ctl("-m", mode, "-w", "stop")

    def database(self, name: str) -> str:
        import psycopg

        plain = self.url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(f"{plain}/postgres", autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"{self.url}/{name}"

    def remove(self) -> None:
        self._ctl("-m", "immediate", "stop", check=False)
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server():
    server = PostgresServer()
    yield server
    server.remove()


_counter = itertools.count()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    server = request.getfixturevalue("postgres_server")
    return server.database(f"t{os.getpid()}_{next(_counter)}")


@contextlib.contextmanager
def serve(harness: Harness) -> Iterator[str]:
    """The harness's app behind a real HTTP server on loopback, for requests that must
    run at the same time (the test client runs one at a time); yields its URL."""
    port = free_port()
    config = uvicorn.Config(harness.client.app, host="127.0.0.1", port=port, log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


class Harness:
    """A service on a fake cluster, its HTTP client and its admin token."""

    def __init__(
        self,
        database_url: str,
        data_dir: Path,
        backend: FakeBackend | None = None,
        **settings: Any,
    ):
        self.backend = backend or FakeBackend()
        self.settings = Settings(
            data_dir=data_dir,
            database_url=database_url,
            max_cluster={"CPU": 16.0, "GPU": 0.0},
            cpu_rank_memory_gib=16.0,
            **settings,
        )
        self.service = Service(self.settings, self.backend, start_scheduler=False)
        self.client = TestClient(create_app(self.service))
        self.admin = self.service.bootstrap_token

    def headers(self, token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    def tenant_token(self, tenant: str) -> str:
        h = self.headers(self.admin) if self.admin else {}
        self.client.post("/v1/tenants", json={"name": tenant}, headers=h)
        r = self.client.post("/v1/tokens", json={"tenant": tenant}, headers=h)
        assert r.status_code == 201, r.text
        return r.json()["token"]

    def tick(self) -> None:
        self.service.scheduler.tick()


@pytest.fixture
def harness(database_url, tmp_path):
    h = Harness(database_url, tmp_path / "data")
    yield h
    h.client.close()
    h.service.engine.dispose()
