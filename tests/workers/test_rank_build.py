"""A rank that loads a checkpoint builds its engine without initial weights
(``zeroservice.RESTORED``), and falls back to them when there is nothing to load."""

from __future__ import annotations

import pytest

from tests.workers import rank_scenarios as rs
from tests.workers.jobs import tiny_job
from zeroservice.launch import run_local


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("saved", [True, False], ids=["checkpoint", "nothing-to-load"])
def test_a_rank_built_to_be_restored_loads_or_starts_from_the_initial_weights(
    tmp_path, stage, saved
):
    spec = tiny_job(engine={"stage": stage, "bucket_elements": 4096})
    root = str(tmp_path / "ckpt")
    results = run_local(rs.load_or_initialise, 2, spec.model_dump_json(), root, saved)
    for r in results:
        assert r["awaiting_before"] and not r["awaiting_after"]
        if saved:
            assert r["loaded"] is not None and r["step"] == 2
            assert r["equals_saved"] and not r["equals_initial"]
        else:
            assert r["loaded"] is None and r["step"] == 0
            assert r["equals_initial"]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_dropped_engine_is_freed_at_once(tmp_path, stage):
    """A re-forming rank builds its next engine beside the old one's memory unless the
    old one is freed now: a closed engine sits in reference cycles."""
    spec = tiny_job(engine={"stage": stage, "redundancy": "host-copy"})
    results = run_local(rs.frees_its_engine, 2, spec.model_dump_json(), str(tmp_path))
    assert all(r["alive"] == [False, False] for r in results), results


def test_a_group_forms_at_the_rendezvous_rank_0_opened(tmp_path):
    """See [Note: rendezvous opened first] in workers/rank.py: rank 0 serves the store
    it opened before anyone was asked to join; a store another rank opened for some
    other port is dropped, not served."""
    spec = tiny_job(engine={"stage": 2})
    results = run_local(
        rs.joins_through_the_opened_rendezvous,
        3,
        spec.model_dump_json(),
        str(tmp_path),
        timeout_s=300,
    )
    assert [r["sum"] for r in results] == [3.0, 3.0, 3.0]
    assert all(r["world"] == 3 and r["opened"] and not r["kept"] for r in results)
    assert results[0]["phases"] == ["rendezvous", "build"]


def test_a_rank_refuses_the_calls_of_a_supervisor_older_than_the_one_that_settled_it(tmp_path):
    """See [Note: supervisor terms] in workers/rank.py."""
    spec = tiny_job(resources={"dp": 1, "cpus_per_rank": 1})
    root = str(tmp_path / "ckpt")
    (r,) = run_local(rs.refuses_an_older_supervisors_calls, 1, spec.model_dump_json(), root)
    assert r["first"] == [1, 2] and r["settled_at"] == 2
    assert r["late"] == [] and r["late_saved"] is None and r["after_late"] == 2
    assert "term 0" in r["late_regroup"] and "term 1" in r["late_regroup"]
    assert r["kept_engine"], "a refused re-forming left its group"
    assert r["then"] == [3] and r["saved"].endswith("step-00000003") and r["failed"] == ""
    assert r["newest"] == (3, r["saved"])


def test_a_steps_exported_peaks_and_bandwidth_are_its_own(tmp_path):
    """After a step of 8x the batch trained by hand, the loop's next step exports its
    own activation and gathered peaks (below the large step's) and the bus bandwidth of
    its own collectives (the start-up broadcast: none), and its own process peak; the
    tokens counter counts what the process trained, from 0 whatever position the job
    resumed at."""
    spec = tiny_job(engine={"stage": 3, "bucket_elements": 4096, "activation_checkpointing": True})
    for r in run_local(rs.metrics_of_a_step, 2, spec.model_dump_json(), str(tmp_path)):
        assert r["after"][0] < r["large"][0] and r["after"][1] <= r["large"][1], r
        assert tuple(r["exported_memory"].values()) == r["after"]
        assert r["busbw"]["broadcast"] == 0.0
        assert r["busbw"] == r["expected_busbw"]
        assert r["busbw"]["all_gather"] > 0
        # The tokens counter is this process's training, not the job's restored position.
        assert r["tokens"] == r["tokens_per_step"]
        # The process's peak is the step's, not the 256 MiB held and freed before it.
        assert r["peak"] < r["lifetime_peak"] - 200 * 2**20, r


@pytest.mark.parametrize(
    ("data", "said"),
    [
        ({"kind": "tokens", "path": "missing.bin"}, "missing.bin: no such file"),
        ({"kind": "text", "path": "short.txt"}, "is too short for seq_len"),
        ({"kind": "tokens", "path": "odd.bin"}, "is not a whole number of uint16 ids"),
    ],
)
def test_data_that_cannot_serve_is_the_jobs_configuration_error(tmp_path, data, said):
    """Every start would fail alike: the engine's ConfigError, which fails the job at
    once naming the field (workers/worker_group.py refused_by_engine), not a restart."""
    (tmp_path / "short.txt").write_bytes(b"abc")
    (tmp_path / "odd.bin").write_bytes(b"\0" * 101)
    spec = tiny_job(data={**data, "path": str(tmp_path / data["path"])})
    (error,) = run_local(rs.set_up_error, 1, spec.model_dump_json(), str(tmp_path / "ckpt"))
    assert error.startswith("ConfigError: data.path: ") and said in error, error


def test_collective_counters_never_go_down_through_a_live_re_forming(tmp_path):
    """The re-formed group's engine starts a new ledger; the process's counters carry on
    from what the dropped engine moved (a counter going down reads as a reset)."""
    spec = tiny_job(engine={"stage": 2, "bucket_elements": 4096, "redundancy": "host-copy"})
    for r in run_local(rs.counters_through_a_regroup, 2, spec.model_dump_json(), str(tmp_path)):
        for name in ("zeroservice_collective_bytes_total", "zeroservice_collective_seconds_total"):
            assert 0 < r["before"][name] <= r["regrouped"][name] < r["after"][name], (name, r)
