"""The local stack: a Ray head on loopback, the API (uvicorn) and its SQLite store.

``zeroservice up`` starts both as background processes and records them in
``<data_dir>/stack.json`` (URL, token file, pids); ``zeroservice down`` stops them.
Ray runs as its own process (``ray start --head``), so the job supervisors, which are
detached Ray actors, outlive an API restart: the API reattaches to them by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from api.settings import TOKEN_FILE, Settings

STACK_FILE = "stack.json"


def stack_path(settings: Settings) -> Path:
    return settings.data_dir / STACK_FILE


class StackError(RuntimeError):
    """``stack.json`` exists but is not a stack record (truncated, edited, not ours)."""


def read_stack(settings: Settings) -> dict | None:
    """The local stack's record, None when there is none; StackError naming the file
    when it cannot be read as one."""
    path = stack_path(settings)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise StackError(
            f"{path}: not a stack record ({exc}); remove it if no stack runs"
        ) from None
    if not (
        isinstance(record, dict)
        and isinstance(record.get("url"), str)
        and isinstance(record.get("ray_address"), str)
        and (record.get("api_pid") is None or type(record.get("api_pid")) is int)
    ):
        raise StackError(
            f"{path}: not a stack record (it needs url, ray_address and api_pid); "
            "remove it if no stack runs"
        )
    return record


def _clean_env(extra: dict[str, str], **more: str) -> dict[str, str]:
    """This process's environment without Ray settings a previous Ray session in it left
    (auth mode, token paths, addresses), plus ``extra``: the stack's Ray makes its own
    token under its HOME, where the API finds it."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RAY_AUTH", "RAY_ADDRESS", "RAY_TMPDIR"))
    }
    env.update(extra)
    env.update(more)
    return env


def start_ray_head(
    settings: Settings, num_cpus: float, num_gpus: int = 0, port: int | None = None
) -> tuple[str, int]:
    """``ray start --head`` on loopback (see workers/cluster.py), on ``port`` or a free
    one; returns (address, port)."""
    from workers.cluster import loopback_env

    env = _clean_env(loopback_env(settings.data_dir / "ray-home"))
    tmp = _ray_temp(settings)
    tmp.mkdir(parents=True, exist_ok=True)
    from zeroservice.launch import free_port  # loaded here: the CLI's client needs no torch

    port = port or free_port()
    ray_bin = Path(sys.executable).parent / "ray"
    cmd = [
        str(ray_bin),
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        f"--num-cpus={int(num_cpus)}",
        f"--num-gpus={num_gpus}",
        "--include-dashboard=false",
        f"--temp-dir={tmp}",
        "--disable-usage-stats",
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"ray start failed:\n{out.stdout}\n{out.stderr}")
    return f"127.0.0.1:{port}", port


def processes_with(*needles: bytes, include_self: bool = False) -> list[int]:
    """Pids of the processes whose command line contains any of ``needles``."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or (int(proc.name) == os.getpid() and not include_self):
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if any(needle in cmd for needle in needles):
            pids.append(int(proc.name))
    return pids


def terminate(pids: list[int], grace_s: float = 1.0) -> None:
    """SIGTERM, then after ``grace_s`` SIGKILL, to each of ``pids`` still there."""
    for sig in (signal.SIGTERM, signal.SIGKILL) if grace_s else (signal.SIGKILL,):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if sig == signal.SIGTERM:
            time.sleep(grace_s)


def stop_ray_head(settings: Settings, address: str) -> None:
    """Stop this stack's Ray (its own processes only: never a machine-wide ``ray stop``)."""
    terminate(processes_with(str(_ray_temp(settings)).encode(), address.encode()))


def ray_head_running(settings: Settings, address: str) -> bool:
    """Whether this stack's Ray head still runs at ``address``: its processes (found by
    the stack's temporary directory) are there and its port takes connections."""
    if not processes_with(str(_ray_temp(settings)).encode()):
        return False
    try:
        socket.create_connection((address.rpartition(":")[0], _port(address)), timeout=2).close()
    except (OSError, ValueError):
        return False
    return True


def _port(address: str) -> int:
    """The port of a ``host:port`` address."""
    return int(address.rpartition(":")[2])


def _ray_temp(settings: Settings) -> Path:
    """The stack's Ray temporary directory: short (Ray's socket paths), one per API port."""
    return Path("/tmp") / f"zs-{os.getuid()}-{settings.port}"


def up(settings: Settings, num_cpus: float, num_gpus: int = 0, wait_s: float = 120) -> dict:
    """Start Ray and the API in the background; returns the stack record (``ray_kept``:
    the Ray head was already running; ``ray_restarted``: it had stopped under a running
    API and was started again).

    After the API alone stopped (killed, crashed), the stack's Ray head runs on with the
    jobs' supervisors and ranks: the API is started again on it and reattaches to them.
    A second head would leave them training unseen beside the copies a new API would
    start from their checkpoints, into the same directories. After the head alone
    stopped, it is started again on its address, where the API rejoins it by itself."""
    existing = read_stack(settings)
    if existing is not None and _alive(existing.get("api_pid")):
        address = existing["ray_address"]
        if ray_head_running(settings, address):
            return existing
        stop_ray_head(settings, address)  # what is left of it
        start_ray_head(settings, num_cpus, num_gpus, port=_port(address))
        record = {**existing, "ray_restarted": True}
        return _ready(
            record, lambda: None if _alive(record["api_pid"]) else "status unknown", wait_s
        )
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    address = existing.get("ray_address") if existing is not None else None
    kept = address is not None and ray_head_running(settings, address)
    if not kept:
        address, _ = start_ray_head(settings, num_cpus, num_gpus)
    log = open(settings.data_dir / "api.log", "ab")  # noqa: SIM115 - handed to the child
    env = _clean_env(
        {},
        ZEROSERVICE_HOME=str(settings.data_dir),
        ZEROSERVICE_DATABASE_URL=settings.database_url,
        ZEROSERVICE_RAY_ADDRESS=address,
        ZEROSERVICE_HOST=settings.host,
        ZEROSERVICE_PORT=str(settings.port),
    )
    from workers.cluster import loopback_env

    env.update(loopback_env(settings.data_dir / "ray-home"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "api.serve"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://{settings.host}:{settings.port}"
    record = {
        "url": url,
        "ray_address": address,
        "api_pid": proc.pid,
        "token_file": str(settings.data_dir / TOKEN_FILE),
        "log": str(settings.data_dir / "api.log"),
        "data_dir": str(settings.data_dir),
    }
    path = stack_path(settings)  # written whole or not at all: a crash leaves no half
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(record, indent=2))
    os.replace(part, path)
    return _ready({**record, "ray_kept": kept}, proc.poll, wait_s)  # this call's, not stored


def _ready(record: dict, exited: Callable[[], object], wait_s: float) -> dict:
    """``record`` once its API answers ``/readyz`` with 200; RuntimeError if the API
    exits first (``exited()`` gives its status, None while it runs) or after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        status = exited()
        if status is not None:
            raise RuntimeError(f"the API exited ({status}); see {record['log']}")
        try:
            if httpx.get(f"{record['url']}/readyz", timeout=2).status_code == 200:
                return record
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the API did not become ready within {wait_s:g} s; see {record['log']}")


def down(settings: Settings) -> bool:
    record = read_stack(settings)
    if record is None:
        return False
    pid = record.get("api_pid")
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        for _ in range(50):
            if not _alive(pid):
                break
            time.sleep(0.1)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    stop_ray_head(settings, record["ray_address"])
    stack_path(settings).unlink(missing_ok=True)
    return True


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        return state != "Z"
    except OSError:
        return True
