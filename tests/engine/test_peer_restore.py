"""Recovery from peers' host memory (redundancy="host-copy"): shrink after a rank dies,
grow with a newcomer, incomplete copies, and the ledgers. Exact: torch.equal against a
checkpoint loaded from disk at the same step and world size."""

from __future__ import annotations

import pytest

from tests.engine import peer_scenarios as ps
from tests.engine.scenarios import Spec
from zeroservice.checkpoint.peers import ALIGN
from zeroservice.config import ConfigError, ZeroConfig
from zeroservice.launch import run_local
from zeroservice.planner import plan

METADATA_BYTES = 64 * 1024
"""Bound on a copy's metadata message (segments and RNG as JSON) for the tiny GPT."""


def _assert_restored(r: dict, step: int) -> None:
    """Restored into an engine built without initial weights (``zeroservice.RESTORED``,
    which refuses to train or save before), it equals a disk load into an engine built
    as usual, and trains alike."""
    assert r["refused_before"] == [True, True]
    assert r["path"] == "<peers>"
    assert r["step"] == r["disk_step"] == step
    assert r["diffs"] == []
    assert r["losses"] == r["ref_losses"]  # fp32: bit for bit


def _assert_ledger(results: list[dict], stage: int, k: int) -> None:
    for rank, r in enumerate(results):
        copies = [row for row in r["ledger"] if row["step"] >= k and row["step"] % k == 0]
        for i, row in enumerate(copies):
            # From the second copy on, the previous one is the spare, and each copy is
            # written into the buffers of the one two refreshes before it.
            assert row["spare"] == (0 if i == 0 else row["held"]), (i, row)
            if i >= 2:
                assert row["buffers"] == copies[i - 2]["buffers"], i
            if i >= 1:
                assert not set(row["buffers"]) & set(copies[i - 1]["buffers"]), i
        for row in r["ledger"]:
            if row["step"] < k:
                assert row["held"] == 0 and row["sent"] == 0
                continue
            assert row["held"] == row["held_copies"]
            if stage == 0:  # whole state on every rank: nothing exchanged
                assert row["copies"] == [rank] and row["held"] == row["own"]
                assert row["sent"] == row["received"] == 0
                continue
            assert row["copies"] == sorted({rank, (rank + 1) % len(results)})
            assert row["held"] == row["own"] + row["neighbour"]
            if row["step"] % k:
                assert row["sent"] == row["received"] == 0
                continue
            assert row["sent"] == row["snap_sent"]
            assert row["own_copy"] == row["own"]
            # sizes (16 bytes), the metadata, then the data
            assert 16 + row["own"] < row["sent"] <= 16 + row["own"] + METADATA_BYTES
            assert row["received"] - 16 - row["neighbour"] in range(1, METADATA_BYTES)


def _assert_planned(results: list[dict], stage: int) -> None:
    """The planner's ``redundancy_host`` is within 1% of the ledger's (the model here
    has neither frozen weights nor buffers; the ledger adds each item's 8-byte
    alignment). Shards are of padded units; stage 0 copies whole parameters."""
    for r in results:
        for row in r["ledger"]:
            if row["held"]:
                planned = plan(
                    row["psi"] if stage == 0 else row["psi_padded"],
                    dp=row["world"],
                    stage=stage,
                    precision="fp32",
                    redundancy="host-copy",
                ).redundancy_host
                assert abs(row["held"] - planned) <= planned // 100, (planned, row["held"])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_shrink_restores_exactly_from_peers(tmp_path, stage):
    store = str(tmp_path / "store")
    results = run_local(
        ps.shrink, 3, Spec(stage=stage), 1, [1], str(tmp_path / "ckpt"), store, [3], 3
    )
    assert results[1]["left"]
    for r in (results[0], results[2]):
        _assert_restored(r, 3)
    _assert_ledger(results, stage, 1)
    _assert_planned(results, stage)


@pytest.mark.parametrize("stage", [0, 2])
def test_a_group_of_one_keeps_no_host_copy(tmp_path, stage):
    """Shrunk to one replica, no peer could hold a copy: the survivor restores exactly,
    then keeps none and sends none (growing again takes its own copy at that step
    boundary), and the planner counts none."""
    store = str(tmp_path / "store")
    results = run_local(
        ps.shrink, 2, Spec(stage=stage), 1, [1], str(tmp_path / "ckpt"), store, [3], 3
    )
    assert results[1]["left"]
    (alone,) = [r for r in results if not r["left"]]
    _assert_restored(alone, 3)
    assert alone["held_after"] == 0 and not alone["snapshot_after"]
    assert alone["sent_after"] == 0
    assert all(row["held"] > 0 for row in alone["ledger"])  # at world 2, every step
    assert plan(1e6, dp=1, stage=stage, redundancy="host-copy").redundancy_host == 0
    planned = plan(1e6, dp=2, stage=stage, redundancy="host-copy")
    assert planned.redundancy_host == planned.redundancy_spare > 0
    assert planned.host_total == 2 * planned.redundancy_host  # a refresh holds both sets


@pytest.mark.parametrize(("stage", "direct_bytes"), [(1, None), (3, None), (3, 1)])
def test_shrink_restores_frozen_weights_and_buffers(tmp_path, stage, direct_bytes):
    """``direct_bytes`` 1: every slice from a peer, frozen shards and the buffer among
    them, is received straight into place (see test_grow_receives_large_slices_in_place)."""
    store, root = str(tmp_path / "store"), str(tmp_path / "ckpt")
    results = run_local(
        ps.shrink, 3, Spec(stage=stage), 1, [1], root, store, [3], 3, "frozen", direct_bytes
    )
    if direct_bytes == 1:
        # The lost rank's third is held by one survivor: the other receives its part of
        # it, one message per slice (3 kinds x the units and frozen shards, the buffer).
        received = sorted(r["load_received"][0] for r in (results[0], results[2]))
        assert received[0] == 0 and received[1] > 10, received
    for r in (results[0], results[2]):
        _assert_restored(r, 3)
        assert r["ticks"] == [3.0] * 5  # the buffer at the step, not the fresh engine's
        assert r["frozen_units"] >= 1
    _assert_ledger(results, stage, 1)


def test_a_handed_out_copy_is_never_written_again():
    for r in run_local(ps.handed_out, 2, 3):
        assert r["unchanged"] and not r["shared"]
        assert r["snap_step"] == 1 and r["step_now"] == 4
        assert r["spare_while_kept"] > 0  # the copies after it still pair up
        assert r["spare_after"] == r["held"] > 0


def test_interval_two_loses_at_most_k_steps(tmp_path):
    store = str(tmp_path / "store")
    spec = Spec(stage=2)
    results = run_local(ps.shrink, 3, spec, 2, [1], str(tmp_path / "ckpt"), store, [2, 3], 3)
    for r in (results[0], results[2]):
        _assert_restored(r, 2)
    _assert_ledger(results, 2, 2)


@pytest.mark.parametrize("collectives", ["auto", "native"])
def test_an_interrupt_frees_ranks_blocked_on_a_silent_peer(tmp_path, collectives):
    """A peer that neither sends nor fails (on gloo: one killed mid-message) blocks
    the others' collectives until the group's timeout (120 s here); Engine.interrupt
    ends the wait at once, and the survivors restore exactly from the host copies."""
    spec = Spec(stage=2, collectives=collectives)
    root, store, flag = (str(tmp_path / n) for n in ("ckpt", "store", "flag"))
    results = run_local(ps.interrupted, 3, spec, root, store, flag, 2, timeout_s=120)
    assert results[2]["left"]
    for r in results[:2]:
        assert r["raised"] == "CommInterrupted: collective abandoned: rank 2 lost", r["raised"]
        _assert_restored(r, 2)


def _grown(
    tmp_path,
    name: str,
    direct_bytes: int | None,
    stage: int = 2,
    lend: bool = False,
    env: dict[str, str] | None = None,
) -> tuple[int, int]:
    """Grow 2 -> 3 (see ps.grow); the newcomer's (messages, bytes) received."""
    path = str(tmp_path / name)
    results = run_local(ps.grow, 3, Spec(stage=stage), path, 3, direct_bytes, lend, env=env)
    for r in results:
        _assert_restored(r, 3)
    for r in results[:2]:  # redundancy "none": no copy held, no redundancy traffic
        assert r["ledger"]["held"] == 0 and "redundancy" not in r["ledger"]["tags"]
        assert r["ledger"]["lent"] is lend
        assert r["ledger"]["shared"] == ([True] * len(r["ledger"]["shared"]) if lend else [])
        assert not lend or r["ledger"]["shared"], "no master segment lent"
    assert results[2]["ledger"] is None
    return results[2]["load_received"]


def test_grow_hands_newcomers_their_state(tmp_path):
    """This model's slices are all below DIRECT_BYTES: one packed message. (The
    newcomer's last third of each unit lies in old rank 1's half: one holder serves it.)"""
    calls, received = _grown(tmp_path, "ckpt", None)
    assert calls == 1 and received > 0


def test_grow_receives_large_slices_in_place(tmp_path):
    """Every slice straight into place (threshold 1 byte), and a mix (1000 bytes): the
    same state, the same bytes, one message per direct slice plus one packed."""
    per_slice, received = _grown(tmp_path, "all", 1)
    mixed, mixed_received = _grown(tmp_path, "mixed", 1000)
    assert per_slice > 20 and 1 < mixed < per_slice, (per_slice, mixed)
    # Packed slices may pay up to ALIGN - 1 bytes of alignment each; direct ones none.
    assert received <= mixed_received < received + ALIGN * per_slice


@pytest.mark.parametrize("check", ["0", "1"])
def test_grow_at_stage_3(tmp_path, check):
    """Two ranks train over a subgroup, then three build a stage-3 engine over the whole
    group: that engine's step consensus formed a group of its own, which the newcomer,
    having formed fewer groups, could never join (every rank waited at initialize).
    The debug check per gather (on with "1") forms its own group by an id the ranks
    agree on, so the newcomer meets the old ranks there too."""
    _grown(tmp_path, f"stage3-{check}", None, stage=3, env={"ZEROSERVICE_CHECK_GATHERS": check})


@pytest.mark.parametrize("stage", [0, 2])
def test_grow_from_lent_state_after_the_old_engine_is_dropped(tmp_path, stage):
    """The old ranks lend their engines' own tensors (no copy) and drop the engines;
    the grown group equals the one loaded from the same step's checkpoint, exactly, as
    from packed copies. Large slices too go straight from the lent tensors."""
    _grown(tmp_path, "lent", None, stage=stage, lend=True)
    _grown(tmp_path, "lent-direct", 1, stage=stage, lend=True)


def test_lent_state_outlives_a_closed_stage_3_engine(tmp_path):
    """Stage 3 closes its engine with the module's parameters emptied: the lent shards
    are not among them (a re-forming at the same size, from lent tensors only). The
    restored engine equals the one that lent, every element of every state."""
    for r in run_local(ps.reform_from_lent, 2, Spec(stage=3), str(tmp_path / "s"), 3):
        _assert_restored(r, 3)
        assert r["vs_original"] == []


@pytest.mark.parametrize("stage", [2, 3])
def test_a_restore_lets_go_of_lent_state_before_its_first_copy(tmp_path, stage):
    """With ``release``, the lent tensors are freed before the new engine takes its
    first host copy (a grow's peak: the old state and the new copy never side by
    side), and the restore is still exact."""
    for r in run_local(ps.reform_from_lent, 2, Spec(stage=stage), str(tmp_path / "s"), 3, True):
        _assert_restored(r, 3)
        assert r["vs_original"] == []
        assert r["spent"] > 0 and r["alive_at_refresh"][0] == 0, r["alive_at_refresh"]
        assert r["covers_after"] == []


def test_a_restore_lets_go_of_held_copies_before_its_first_copy(tmp_path):
    """The same for a shrink's held copies (3 -> 2: the survivors take copies again)."""
    store = str(tmp_path / "store")
    results = run_local(
        ps.shrink,
        3,
        Spec(stage=2),
        1,
        [1],
        str(tmp_path / "ckpt"),
        store,
        [3],
        3,
        "plain",
        None,
        True,
    )
    for r in (results[0], results[2]):
        _assert_restored(r, 3)
        assert r["spent"] > 0 and r["alive_at_refresh"][0] == 0, r["alive_at_refresh"]


def test_two_lost_neighbours_are_reported_and_change_nothing(tmp_path):
    results = run_local(ps.lost_neighbours, 4, Spec(stage=2), [1, 2], str(tmp_path / "s"), 2)
    assert results[1]["left"] and results[2]["left"]
    for r in (results[0], results[3]):
        assert r["error"] is not None and "old ranks [2] missing" in r["error"], r["error"]
        assert r["diffs"] == []


def test_refused_mid_accumulation():
    (a, b) = run_local(ps.snapshot_mid_accumulation, 1)[0]
    assert "accumulated" in a and "CheckpointError" in a
    assert "accumulated" in b and "CheckpointError" in b


def test_config_checks_redundancy_fields():
    assert ZeroConfig(redundancy="host-copy", redundancy_interval=3).redundancy_interval == 3
    with pytest.raises(ConfigError, match="^redundancy:"):
        ZeroConfig(redundancy="mirror")  # type: ignore[arg-type]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="^redundancy_interval:"):
            ZeroConfig(redundancy_interval=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("spare", [False, True])
def test_a_refresh_cut_short_restores_the_step_before_from_the_spares(tmp_path, spare):
    """Rank 2 lost mid-refresh: rank 1 swapped to the new copies, rank 0 did not. Their
    last copies alone cover no step (each lacks an old rank at the other's step); with
    the copies before offered too (``peer_snapshots``) the step before is covered, and
    restores exactly."""
    root, store = str(tmp_path / "ckpt"), str(tmp_path / "store")
    results = run_local(ps.cut_refresh, 3, Spec(stage=2), root, store, 3, spare)
    assert results[2]["left"]
    for r in results[:2]:
        if not spare:
            assert (
                "no step at which the survivors' host copies cover every old rank" in r["error"]
            ), r
            continue
        assert "error" not in r, r["error"]
        assert r["step"] == r["disk_step"] == 2
        assert r["diffs"] == [] and r["losses"] == r["ref_losses"]
