"""Collectives through shared memory: the same bits as a sum in group-rank order, on
every rank; nothing left in the directory; a clear error when ranks cannot share it or
a peer is gone."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from zeroservice.comm import SMALL_ELEMENTS, CommLedger, Communicator
from zeroservice.config import ConfigError, check_collectives
from zeroservice.launch import run_local
from zeroservice.shm import HEADER_BYTES, MIN_HALF_BYTES, SharedMemoryComm, half_bytes_for

DTYPES = [torch.float32, torch.bfloat16]
# Per-rank sizes: below the small-all-reduce threshold, one pass, and several passes
# (a half holds MIN_HALF_BYTES: 16 Ki fp32 elements).
SIZES = [3, SMALL_ELEMENTS + 5, 3 * MIN_HALF_BYTES // 4 + 7]


def _in_rank_order(inputs: list[torch.Tensor]) -> torch.Tensor:
    total = inputs[0] + inputs[1]
    for x in inputs[2:]:
        total = total + x
    return total


def _compare() -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    shm = Communicator(None, CommLedger(), "shm", ring_chunk=1)  # the smallest halves
    out = []
    for dtype in DTYPES:
        for per_rank in SIZES:
            numel = world * per_rank
            g = torch.Generator().manual_seed(100 * rank + per_rank)
            data = torch.randn(numel, generator=g).to(dtype)
            inputs = [torch.empty_like(data) for _ in range(world)]
            dist.all_gather(inputs, data)
            expected = _in_rank_order(inputs)
            a, b = data.clone(), data.clone()
            shm.all_reduce(a, "small" if numel < SMALL_ELEMENTS else "t").wait()
            shm.reduce_scatter(b, "t").wait()
            full = torch.zeros_like(data)
            shm.chunk(full).copy_(shm.chunk(expected))
            shm.all_gather(full, "p").wait()
            out.append(
                {
                    "case": (str(dtype), per_rank),
                    # A small all-reduce runs on the backend, whose order of addition
                    # may differ at world > 2.
                    "all_reduce": torch.equal(a, expected)
                    if numel >= SMALL_ELEMENTS
                    else torch.allclose(a.float(), expected.float(), rtol=2e-2, atol=2e-2),
                    "reduce_scatter": torch.equal(shm.chunk(b), shm.chunk(expected)),
                    "all_gather": torch.equal(full, expected),
                }
            )
    impls = {(e["op"], e["tag"], e["impl"]) for e in shm.ledger.as_list()}
    out.append({"impls": impls, "buffer_bytes": shm.buffer_bytes()})
    shm.close()
    return out


@functools.cache
def _results(world: int) -> list[list[dict]]:
    return run_local(_compare, world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shm_collectives_sum_in_rank_order(world):
    for rank_results in _results(world):
        for r in rank_results[:-1]:
            assert r["all_reduce"] and r["reduce_scatter"] and r["all_gather"], r


@pytest.mark.parametrize("world", [2, 3])
def test_shm_ledger_names_it_and_counts_the_segments(world):
    last = _results(world)[0][-1]
    # The smallest all-reduce stays on the backend; everything else runs through shm.
    assert last["impls"] == {
        ("all_reduce", "small", "native"),
        ("all_reduce", "t", "shm"),
        ("reduce_scatter", "t", "shm"),
        ("all_gather", "p", "shm"),
    }
    assert last["buffer_bytes"] == world * (HEADER_BYTES + 2 * MIN_HALF_BYTES)


def test_segment_size_is_bounded():
    assert half_bytes_for(2, 2**22) == 4 * 2**20  # 16 MiB mapped in all
    assert half_bytes_for(8, 2**22) == 2**20
    assert half_bytes_for(2, 1) == MIN_HALF_BYTES
    assert half_bytes_for(1024, None) == MIN_HALF_BYTES


def _files_left(directory: str) -> dict:
    shm = SharedMemoryComm(None, 1024, directory=directory)
    dist.barrier()
    left = sorted(os.listdir(directory))
    x = torch.full((5000,), float(dist.get_rank() + 1))
    shm.all_reduce(x).result()
    shm.close()
    return {"left": left, "sum": x[0].item()}


def test_files_are_unlinked_once_mapped(tmp_path):
    results = run_local(_files_left, 2, str(tmp_path))
    for r in results:
        assert r["left"] == [] and r["sum"] == 3.0
    assert os.listdir(tmp_path) == []


def _separate_directories(base: str) -> str:
    directory = Path(base) / f"rank{dist.get_rank()}"
    directory.mkdir()
    try:
        SharedMemoryComm(None, 1024, directory=str(directory))
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_ranks_that_cannot_share_memory_are_refused_on_every_rank(tmp_path):
    messages = run_local(_separate_directories, 2, str(tmp_path))
    for m in messages:
        assert "needs every rank of the group on one host" in m, m
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def _peer_gone(directory: str) -> dict:
    shm = SharedMemoryComm(None, 1024, directory=directory)
    if dist.get_rank() == 1:
        return {}  # this process ends now; rank 0's next collective waits for it
    t0 = time.monotonic()
    try:
        shm.all_reduce(torch.ones(5000)).result(timeout=60)
    except RuntimeError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - t0}
    return {"error": None}


def test_a_collective_with_a_dead_peer_fails_at_once(tmp_path):
    r = run_local(_peer_gone, 2, str(tmp_path))[0]
    assert r["error"] is not None and "is gone" in r["error"], r
    assert r["seconds"] < 30


def test_shm_is_refused_on_nccl():
    with pytest.raises(ConfigError, match="'shm' is refused on the nccl backend"):
        check_collectives("shm", "nccl")
    check_collectives("shm", "gloo")


def _ledger_buffers(cfg, stage: int) -> int:
    import zeroservice
    from zeroservice.models import GPT

    torch.manual_seed(0)
    engine = zeroservice.initialize(
        GPT(cfg), {"stage": stage, "collectives": "shm"}, optimizer=torch.optim.AdamW
    )
    buffers = engine.memory_ledger().comm_buffers
    engine.close()
    return buffers


@pytest.mark.parametrize("stage", [0, 2])
def test_the_planner_counts_the_segments_as_the_ledger_does(stage):
    from zeroservice.models import GPTConfig
    from zeroservice.peak import PeakConfig, predict_peak

    cfg = GPTConfig(vocab_size=2048, seq_len=64, n_layer=2, n_head=4, dim=128)
    predicted = predict_peak(PeakConfig(cfg, stage=stage, dp=2, collectives="shm"))
    for buffers in run_local(_ledger_buffers, 2, cfg, stage):
        assert buffers == predicted.staging + predicted.ring
    ring = predict_peak(PeakConfig(cfg, stage=stage, dp=2))
    assert predicted.ring != ring.ring


def _one_rank_not_x86() -> str:
    from unittest import mock

    machine = "aarch64" if dist.get_rank() == 1 else "x86_64"
    with mock.patch("zeroservice.shm.platform.machine", return_value=machine):
        try:
            SharedMemoryComm(None, 1024)
        except ConfigError as exc:
            return str(exc)
    return "no error"


def test_a_host_that_is_not_x86_is_refused_on_every_rank():
    for message in run_local(_one_rank_not_x86, 2):
        assert "needs an x86-64 host" in message and "rank 1 runs on aarch64" in message


def _node_groups_with_shm() -> dict:
    from zeroservice.zeropp import build_node_groups

    groups = build_node_groups(None, 2, CommLedger(), "shm")
    out = {"local": groups.local.shm is None, "cross": groups.cross.shm is None}
    groups.local.close()
    groups.cross.close()
    return out


def test_node_groups_keep_rings_so_the_ledger_holds_every_segment():
    for r in run_local(_node_groups_with_shm, 4):
        assert r == {"local": True, "cross": True}
