"""Runtime recipes: buffers broadcast as DDP does, collectives per backend, a clean exit
without close()."""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.harness import assert_matches_ddp
from tests.engine.recipe_scenarios import (
    batchnorm_vs_ddp,
    compiled_vs_ddp,
    out_of_order_vs_ddp,
    stage2_staging,
)
from zeroservice.config import ConfigError, check_collectives
from zeroservice.launch import host_store, run_local

ROOT = Path(__file__).resolve().parents[2]


def test_ring_refused_on_nccl_by_name():
    with pytest.raises(ConfigError, match=r"^collectives: 'ring' is refused on the nccl"):
        check_collectives("ring", "nccl")


@pytest.mark.parametrize(
    ("impl", "backend"), [("ring", "gloo"), ("auto", "nccl"), ("native", "nccl")]
)
def test_other_collectives_accepted(impl, backend):
    check_collectives(impl, backend)


@pytest.mark.parametrize("impl", ["ring", "shm"])
def test_host_only_collectives_refused_for_gpu_tensors_by_name(impl):
    """gloo's point-to-point sends and the shared segments read host memory only."""
    with pytest.raises(
        ConfigError, match=rf"^collectives: '{impl}' is refused for a model on cuda"
    ):
        check_collectives(impl, "gloo", "cuda")
    check_collectives(impl, "gloo", "cpu")


def _ring_for(device_type: str) -> bool:
    from zeroservice.comm import CommLedger, Communicator

    communicator = Communicator(None, CommLedger(), "auto", device_type=device_type)
    ring = communicator.ring is not None
    communicator.close()
    return ring


def test_auto_takes_the_ring_on_gloo_for_host_tensors_only():
    assert run_local(_ring_for, 2, "cpu") == [True, True]
    assert run_local(_ring_for, 2, "cuda") == [False, False]


def _exit_script(*args: str, **popen: Any) -> subprocess.Popen:
    """``python -m tests.engine.exit_script ARGS``, from the project's root on loopback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "tests.engine.exit_script", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, **popen)


@contextlib.contextmanager
def _pair(*extra: str) -> Iterator[list[subprocess.Popen]]:
    """The two ranks of one job of exit_script.py, around the group's store (held
    here for the pair's life: see [Note: the launcher holds the store])."""
    store = host_store(300)
    ranks = [_exit_script(str(r), "2", str(store.port), *extra) for r in range(2)]
    try:
        yield ranks
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


def _launch_pair(_: int) -> tuple[int, int]:
    """One 2-rank job of exit_script.py; both ranks' exit codes."""
    with _pair() as ranks:
        codes = [p.wait(timeout=300) for p in ranks]
    return codes[0], codes[1]


def test_an_interrupted_rank_exits_while_its_ring_still_waits_on_a_silent_peer(tmp_path):
    """Rank 1 stays alive but silent (a peer killed mid-message looks so on gloo) for up
    to 300 s, the group's timeout too; rank 0, interrupted inside the ring, closes and
    exits at once: its ring thread, still blocked, must not hold up the exit."""
    flag = tmp_path / "peer-may-go"
    with _pair(str(flag)) as (rank0, rank1):
        try:
            assert rank0.wait(timeout=150) == 0
            assert rank1.poll() is None  # the peer has not let go of the transfer
        finally:
            flag.touch()
        assert rank1.wait(timeout=300) == 0


def test_exit_without_close_is_clean():
    """Two fresh interpreters, each a rank of a stage-2 job on rings that returns from
    its last step without close(): both exit, and with code 0."""
    assert _launch_pair(0) == (0, 0)


@pytest.mark.slow
def test_exit_without_close_is_clean_50_times():
    """The same exit 50 times, five pairs at a time, each rank forked from one warm
    interpreter and leaving through its own finalization (exit_script.serve)."""
    server = _exit_script("serve", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    codes: list[str] = []
    try:
        for _ in range(10):
            stores = [host_store(300) for _ in range(5)]
            server.stdin.write(" ".join(str(s.port) for s in stores) + "\n")
            server.stdin.flush()
            codes += server.stdout.readline().split()
            del stores
    finally:
        server.kill()
        server.wait()
    assert codes == ["0"] * 100


BUFFER_CASES = [(stage, accum) for stage in (0, 1, 2, 3) for accum in (1, 3)]


@functools.cache
def _batchnorm():
    return run_local(batchnorm_vs_ddp, 2, BUFFER_CASES, timeout_s=300)


@pytest.mark.parametrize("case", BUFFER_CASES, ids=lambda c: f"stage{c[0]}-accum{c[1]}")
def test_buffers_follow_ddp(case):
    """BatchNorm statistics and a buffer the training forward reads, with gradient
    accumulation and an evaluation forward after each step: the engine broadcasts
    rank 0's buffers exactly where DDP does (see [Note: when buffers are broadcast] in
    engine.py), so losses, evaluations and every rank's buffers are DDP's."""
    ranks = _batchnorm()
    r = ranks[0][case]
    for got, ref in (("losses", "ref_losses"), ("evals", "ref_evals")):
        torch.testing.assert_close(
            torch.tensor(r[got]), torch.tensor(r[ref]), rtol=1e-5, atol=0, msg=got
        )
    for rank in ranks:
        ours = rank[case]
        assert ours["buffers"].keys() == ours["ref_buffers"].keys()
        for name, ref in ours["ref_buffers"].items():
            torch.testing.assert_close(ours["buffers"][name], ref, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("overlap", [True, False])
def test_stage2_stages_in_constant_buffers_in_every_mode(overlap):
    r = run_local(stage2_staging, 2, [overlap], timeout_s=300)[0][0]
    # The largest unit holds 1088 elements (under C_B = 2048): two staging buffers of
    # it and the ring's scratch of 1088 / N, in fp32; no temporary buffer, so no peak
    # above that (staging units in new buffers until backward ends peaked at 28288).
    assert r["overflows"] == 0
    assert r["comm_buffers"] == r["comm_buffers_peak"] == 2 * 1088 * 4 + 544 * 4


@functools.cache
def _out_of_order():
    return dict(
        zip((True, False), run_local(out_of_order_vs_ddp, 2, [True, False])[0], strict=True)
    )


@pytest.mark.parametrize("overlap", [True, False])
def test_modules_called_out_of_order_match_ddp_and_stay_in_two_buffers(overlap):
    r = _out_of_order()[overlap]
    assert_matches_ddp(r)
    # Backward finishes the units about in reverse index order (unit 0, the tied
    # embedding, last). Every rank adopted the reverse of the first forward's order
    # before the first backward, and the order that backward finished the units in
    # after it (two "order" collectives each, once): no step needed a temporary buffer.
    assert r["order"] != list(range(r["units"])) and r["order"][-1] == 0
    assert r["overflows"] == [0] * len(r["overflows"])
    assert r["order_calls"] == 4
    assert r["comm_buffers_peak"] == r["comm_buffers"] + r["temporary_peak"]


COMPILED = [(what, stage) for what in ("blocks", "model") for stage in (0, 1, 2, 3)]


@functools.cache
def _compiled():
    runs = run_local(compiled_vs_ddp, 2, COMPILED, timeout_s=300)[0]
    return dict(zip(COMPILED, runs, strict=True))


@pytest.mark.parametrize("what,stage", COMPILED)
def test_compiled_modules_match_ddp(what, stage):
    r = _compiled()[(what, stage)]
    torch.testing.assert_close(
        torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=1e-5, atol=0
    )
