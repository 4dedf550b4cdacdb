"""Two API processes on one store (SQLite file or PostgreSQL): one schedules at a
time (the lease), so every job is launched once and its events stored once; when
the scheduling one stops, the other takes over. A replica killed and started again on
its data directory takes its lease back at once (see [Note: a replica restarted after
a crash] in api/lease.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
from sqlalchemy import create_engine, select

from api.db import JobEvent
from api.lease import HOLDER_FILE, claim_holder
from tests.api.test_routes import TINY
from tests.waiting import wait_for
from zeroservice.launch import free_port

ADMIN = "zs_replica-test-admin-token-0123456789"


def _start(database_url: str, data_dir, port: int, lease_s: float = 2.0) -> subprocess.Popen:
    env = dict(
        os.environ,
        ZEROSERVICE_HOME=str(data_dir),
        ZEROSERVICE_DATABASE_URL=database_url,
        ZEROSERVICE_PORT=str(port),
        ZEROSERVICE_ADMIN_TOKEN=ADMIN,
        ZEROSERVICE_SCHEDULER_INTERVAL_S="0.2",
        ZEROSERVICE_SCHEDULER_LEASE_S=str(lease_s),
    )
    proc = subprocess.Popen([sys.executable, "-m", "tests.api.replica"], env=env)
    wait_for(lambda: _ready(port), 60, f"the replica on port {port}")
    return proc


def _ready(port: int) -> dict | None:
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


def test_two_replicas_schedule_one_at_a_time(database_url, tmp_path):
    ports = [free_port(), free_port()]
    first = _start(database_url, tmp_path / "a", ports[0])
    second = _start(database_url, tmp_path / "b", ports[1])
    procs = [first, second]
    try:
        auth = {"Authorization": f"Bearer {ADMIN}"}
        jobs = []
        for i in range(6):  # submitted through both replicas
            url = f"http://127.0.0.1:{ports[i % 2]}/v1/jobs"
            r = httpx.post(url, json={"spec": TINY}, headers=auth, timeout=30)
            assert r.status_code == 201, r.text
            jobs.append(r.json()["id"])

        def all_started():
            listed = httpx.get(
                f"http://127.0.0.1:{ports[0]}/v1/jobs", headers=auth, timeout=30
            ).json()["items"]
            return all(j["status"] == "starting" for j in listed) and listed

        wait_for(all_started, 60, "every job admitted")
        time.sleep(1.5)  # several more ticks of both replicas
        roles = sorted(_ready(p)["scheduler"] for p in ports)
        assert roles == ["leader", "standby"]
        engine = create_engine(database_url)
        with engine.connect() as conn:
            admitted = (
                conn.execute(select(JobEvent.job_id).where(JobEvent.reason == "admitted"))
                .scalars()
                .all()
            )
            lost = (
                conn.execute(select(JobEvent.job_id).where(JobEvent.reason == "supervisor_lost"))
                .scalars()
                .all()
            )
        engine.dispose()
        assert sorted(admitted) == sorted(jobs) and lost == []

        leader = ports.index(next(p for p in ports if _ready(p)["scheduler"] == "leader"))
        procs[leader].terminate()
        procs[leader].wait(30)
        other = ports[1 - leader]
        wait_for(lambda: (_ready(other) or {}).get("scheduler") == "leader", 30, "a takeover")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)


def test_a_replica_killed_and_started_again_schedules_at_once(database_url, tmp_path):
    """SIGKILLed, the scheduling replica cannot release the lease. Started again on its
    data directory it schedules within seconds, not after the lease's 60 s; a replica
    on another directory, started meanwhile, waits for the lease as before."""
    home, ports = tmp_path / "a", [free_port(), free_port(), free_port()]
    procs = [_start(database_url, home, ports[0], lease_s=60)]
    try:
        wait_for(lambda: _ready(ports[0])["scheduler"] == "leader", 30, "a leader")
        procs[0].kill()
        procs[0].wait(30)
        procs.append(_start(database_url, tmp_path / "b", ports[1], lease_s=60))
        procs.append(_start(database_url, home, ports[2], lease_s=60))
        wait_for(lambda: _ready(ports[2])["scheduler"] == "leader", 10, "the lease taken back")
        assert _ready(ports[1])["scheduler"] == "standby"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)


def test_a_holder_name_is_taken_over_only_from_a_process_that_is_gone(tmp_path):
    """The name of a data directory's replica passes to the next process only once no
    live one holds its lock, and never from a file that names another host."""
    first, lock = claim_holder(tmp_path)
    assert lock is not None and first.split(":")[0] == socket.gethostname()[:80]
    second, none = claim_holder(tmp_path)  # the first still runs: a name of its own
    assert none is None and second != first
    lock.close()  # as the kernel does when the first process exits
    third, lock = claim_holder(tmp_path)
    assert third == first and lock is not None
    lock.close()
    (tmp_path / HOLDER_FILE).write_text("elsewhere:1:0123abcd")  # a shared directory
    fourth, lock = claim_holder(tmp_path)
    assert fourth != "elsewhere:1:0123abcd" and (tmp_path / HOLDER_FILE).read_text() == fourth
    assert lock is not None
    lock.close()
    assert claim_holder(tmp_path / "missing")[1] is None  # no directory: a name of its own
