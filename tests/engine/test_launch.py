"""``run_local``: rank 0 hosts the group's store, so it outlives every peer's use of it."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from zeroservice.launch import run_local


def _a_late_group_without_rank_0() -> float:
    if dist.get_rank() == 0:
        return 0.0  # done at once: the others still need the store it hosts
    time.sleep(1.0)
    group = dist.new_group([1, 2], use_local_synchronization=True)
    total = torch.ones(1)
    dist.all_reduce(total, group=group)
    return float(total.item())


def test_rank_0_leaves_only_after_the_others_are_done_with_its_store():
    assert run_local(_a_late_group_without_rank_0, 3) == [0.0, 2.0, 2.0]


# -- how ranks start (see [Note: ranks forked from a warm server]) ------------------------


def _how_started(name: str) -> dict:
    """The variable ``name`` as the rank sees it, and whether the caller started it."""
    import os

    return {
        "value": os.environ.get(name),
        "parent_is_caller": os.getppid() == int(os.environ["CALLER_PID"]),
    }


def _run_and_report(name: str, env: dict[str, str], start: str | None = None) -> list[dict]:
    import os

    return run_local(
        _how_started, 2, name, env={**env, "CALLER_PID": str(os.getpid())}, start=start
    )


def test_a_forked_rank_sees_the_callers_environment(monkeypatch):
    # The server up first, without the variable: the rank must get it from the caller.
    monkeypatch.delenv("ZEROSERVICE_SOME_SETTING", raising=False)
    _run_and_report("ZEROSERVICE_SOME_SETTING", {}, start="forkserver")
    monkeypatch.setenv("ZEROSERVICE_SOME_SETTING", "from-the-caller")
    ranks = _run_and_report("ZEROSERVICE_SOME_SETTING", {}, start="forkserver")
    assert [r["value"] for r in ranks] == ["from-the-caller"] * 2
    # Forked by the server, not started by this process.
    assert not any(r["parent_is_caller"] for r in ranks)


def test_a_variable_read_at_start_up_gets_spawned_ranks():
    ranks = _run_and_report(
        "MALLOC_MMAP_THRESHOLD_", {"MALLOC_MMAP_THRESHOLD_": "131072"}, "forkserver"
    )
    assert [r["value"] for r in ranks] == ["131072"] * 2
    assert all(r["parent_is_caller"] for r in ranks)


def test_start_method_rules(monkeypatch):
    import os

    from zeroservice import launch

    # The environment the fork server has (or will have, started now).
    server = dict(launch._server_env or os.environ)
    monkeypatch.delenv(launch.START_ENV, raising=False)
    assert launch.start_method(None, server) == "spawn"
    monkeypatch.setenv(launch.START_ENV, "forkserver")
    assert launch.start_method(None, server) == "forkserver"
    assert launch.start_method("spawn", server) == "spawn"
    assert launch.start_method(None, server, backend="nccl") == "spawn"
    assert launch.start_method(None, {**server, "OMP_NUM_THREADS": "7"}) == "spawn"
    assert launch.start_method(None, {**server, "ZEROSERVICE_X": "1"}) == "forkserver"
    with pytest.raises(ValueError, match="'fork' is not one of spawn, forkserver"):
        launch.start_method("fork", server)
