"""Run a function on N local processes joined by torch.distributed (gloo, loopback; or
NCCL, one GPU per rank).

Tests, benchmarks and the engine demo share it; a cluster uses torchrun or Ray instead.

[Note: ranks forked from a warm server]
A spawned rank is a fresh interpreter that imports torch and the engine before it runs
anything: 1.5-1.9 s per call of two ranks on a 2-core machine, paid again by every
call (the test suite makes hundreds). With ``start="forkserver"`` one server process
imports them once (``FORKSERVER_PRELOAD``) and every rank is forked from it: 0.07-0.10 s
per call, 0.08 s where the ranks build an optimizer (which imports torch._dynamo,
1.4 s a call had the server not imported it; ``python -m benchmarks.launch_start``).
The server is single-threaded when it forks, so no rank inherits a lock held by a
thread it does not have, and it has touched no GPU.

What a forked rank cannot get is a setting read when a process starts: glibc's malloc
tunables, OpenMP's and MKL's, the interpreter's, torch's huge-page switch
(``READ_AT_START``); the server's values hold in every rank it forks. So a call whose
environment (this process's, plus ``env``) differs from the server's in one of those,
and every NCCL call, gets spawned ranks whatever was asked; any other variable is set in
the forked rank before ``fn`` runs, so it sees the environment a spawned rank would.
Spawn stays the default (benchmarks measure memory and start-up as a user's ranks
have them); ``START_ENV`` names another for a whole process (the test suite's
conftest), and ``start`` for one call.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

START_METHODS = ("spawn", "forkserver")
START_ENV = "ZEROSERVICE_LAUNCH_START"
"""The start method of a ``run_local`` call that names none (unset: "spawn")."""
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "zeroservice"]
"""What the fork server imports once, before it forks any rank. torch._dynamo is
imported by the first optimizer a process builds: 1.3-1.4 s that every forked rank of a
training call would pay again (it starts no thread, so the server stays one)."""
READ_AT_START = (
    "MALLOC_",
    "GLIBC_",
    "LD_",
    "PYTHON",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "DNNL_",
    "ONEDNN_",
    "ATEN_",
    "TORCH_",
    "THP_",
    "CUDA_",
)
"""Prefixes of variables a process reads when it starts (see the module's note)."""

_server_env: dict[str, str] | None = None
"""This process's environment when it started the fork server (None: not started)."""


def free_port() -> int:
    """A port free now, for a server that binds it itself (uvicorn, Prometheus). A
    process group takes no such port: see [Note: the launcher holds the store]."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_method(start: str | None, env: dict[str, str], backend: str = "gloo") -> str:
    """How a ``run_local`` call starts its ranks: ``start``, else ``START_ENV``, else
    "spawn"; "forkserver" only where it gives the ranks the environment ``env`` (the
    whole environment they should have) describes (see the module's note)."""
    method = start or os.environ.get(START_ENV) or "spawn"
    if method not in START_METHODS:
        raise ValueError(f"start: {method!r} is not one of {', '.join(START_METHODS)}")
    if method == "spawn" or backend == "nccl":
        return "spawn"
    # Not started yet, the server will have this process's environment.
    server = _server_env if _server_env is not None else dict(os.environ)
    differing = [k for k in set(env) | set(server) if env.get(k) != server.get(k)]
    if any(k.startswith(READ_AT_START) for k in differing):
        return "spawn"
    return method


def _context(method: str):
    """The multiprocessing context; the fork server started (and its environment
    recorded) at its first use."""
    global _server_env
    ctx = mp.get_context(method)
    if method == "forkserver" and _server_env is None:
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        import multiprocessing.forkserver

        multiprocessing.forkserver.ensure_running()
        _server_env = dict(os.environ)
    return ctx


def _worker(rank, world, port, fn, args, outdir, threads, timeout_s, env, backend) -> None:
    # The caller's whole environment: a spawned rank has it already, a forked one has
    # the fork server's until now.
    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # What torchrun would set, for libraries that read it.
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        result = fn(*args)
        torch.save(result, Path(outdir) / f"{rank}.pt")
    except BaseException:
        (Path(outdir) / f"{rank}.err").write_text(traceback.format_exc())
        raise
    # Leave without running destructors: torch.distributed's C++ threads, torn down at
    # interpreter exit while objects of the finished job (engines, ring threads) are
    # still alive, abort the process now and then ("terminate called without an active
    # exception") after its result is safely written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    threads: int = 1,
    timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
    backend: str = "gloo",
    start: str | None = None,
) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` processes; return each rank's result.

    ``env``: variables set in every rank, beside this process's environment.
    ``start``: "spawn" or "forkserver" (see [Note: ranks forked from a warm server]);
    unset, ``ZEROSERVICE_LAUNCH_START`` or "spawn".

    ``backend``: "gloo" (CPU tensors, and GPU tensors staged through the host) or
    "nccl" (rank r on GPU r modulo the GPUs there are; NCCL refuses two ranks on one).

    ``fn`` must be importable (a module-level function). A rank that raises fails
    the whole call with that rank's traceback; a run past ``timeout_s`` is killed.
    """
    if world_size < 1:
        raise ValueError(f"world_size: must be >= 1, got {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: {backend!r} is not 'gloo' or 'nccl'")
    rank_env = {**os.environ, **(env or {})}
    ctx = _context(start_method(start, rank_env, backend))
    store = host_store(timeout_s)
    port = int(store.port)
    with tempfile.TemporaryDirectory(prefix="zeroservice-run-") as outdir:
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r,
                    world_size,
                    port,
                    fn,
                    args,
                    outdir,
                    threads,
                    timeout_s,
                    rank_env,
                    backend,
                ),
                daemon=False,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        _join(procs, timeout_s + 30)
        errors = sorted(Path(outdir).glob("*.err"))
        if errors:
            raise RuntimeError(f"rank {errors[0].stem} failed:\n{errors[0].read_text()}")
        bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            codes = [procs[r].exitcode for r in bad]
            raise RuntimeError(f"ranks {bad} exited with codes {codes}")
        return [torch.load(Path(outdir) / f"{r}.pt", weights_only=False) for r in range(world_size)]


def host_store(timeout_s: float) -> dist.TCPStore:
    """The group's store, served by this process on a port the kernel picks.

    [Note: the launcher holds the store]
    Picking a free port and letting rank 0 bind it later is a race: on a busy machine
    (gloo opens a socket per peer pair) another socket takes the port in between,
    rank 0 fails with EADDRINUSE, and its peers wait out the whole timeout on a
    stranger. Held here, the store is listening before any rank starts, and it
    outlives every rank, so a rank still forming a group (``dist.new_group``
    exchanges addresses through the store) never loses it when rank 0 leaves first.
    """
    return dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _join(procs, timeout_s: float) -> None:
    """Wait for all; stop early when one fails (its peers would only hang on it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [p.exitcode for p in procs]
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            break
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
