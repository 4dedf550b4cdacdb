"""Run a function on N local processes joined by torch.distributed (gloo, loopback; or
NCCL, one GPU per rank).

Tests, benchmarks and the engine demo share it; a cluster uses torchrun or Ray instead.
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


def free_port() -> int:
    """A port free now, for a server that binds it itself (uvicorn, Prometheus). A
    process group takes no such port: see [Note: the launcher holds the store]."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, outdir, threads, timeout_s, env, backend) -> None:
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
) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` processes; return each rank's result.

    ``backend``: "gloo" (CPU tensors, and GPU tensors staged through the host) or
    "nccl" (rank r on GPU r modulo the GPUs there are; NCCL refuses two ranks on one).

    ``fn`` must be importable (a module-level function). A rank that raises fails
    the whole call with that rank's traceback; a run past ``timeout_s`` is killed.
    """
    if world_size < 1:
        raise ValueError(f"world_size: must be >= 1, got {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: {backend!r} is not 'gloo' or 'nccl'")
    ctx = mp.get_context("spawn")
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
                    env or {},
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
