"""The supervisor's state machine, stepped one transition at a time with in-process
scripted ranks (no Ray): success, a killed rank (shrink), capacity returned (grow),
a stall, a training error, a failed start, cancellation, and the restart budget."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from tests.workers.jobs import tiny_job
from tests.workers.scripted import Script, scripted_pool
from workers.controller import JobController
from workers.job_record import JobRecord
from workers.job_states import (
    Cancelled,
    Failed,
    Queued,
    Regrouping,
    Resizing,
    Running,
    Starting,
    Succeeded,
)
from workers.messages import Succession
from workers.state import TRANSITIONS, IllegalTransition, JobState, check_transition
from workers.worker_group import RankDied


def _controller(spec, pool):
    record = JobRecord("job", spec.resources.mp, spec.steps, "/ckpt")
    return JobController(spec, pool, record)


def _steps(ctl, n):
    """Step n times; the (previous, next) state classes of each."""
    out = []
    for _ in range(n):
        previous, following = ctl.step()
        out.append((type(previous), type(following)))
    return out


def _events(ctl, kind):
    return [e for e in ctl.record.events_since(0) if e["kind"] == kind]


def test_a_job_runs_chunk_by_chunk_to_success():
    script = Script()
    ctl = _controller(tiny_job(steps=8), scripted_pool(script, capacity=2))
    assert isinstance(ctl.state, Queued)
    assert _steps(ctl, 4) == [
        (Queued, Starting),
        (Starting, Running),
        (Running, Running),  # steps 1-4, saved at 4
        (Running, Succeeded),  # steps 5-8, saved at 8
    ]
    assert ctl.state.is_terminal and ctl.record.status == JobState.SUCCEEDED
    assert sorted(ctl.record.losses) == list(range(1, 9))
    assert [e["step"] for e in _events(ctl, "checkpoint")] == [4, 8]
    statuses = [e["reason"] for e in _events(ctl, "status")]
    assert statuses == ["placing", "training", "completed"]
    assert ctl.record.restarts == 0 and ctl.pool.used == 0


def test_a_killed_rank_restarts_smaller_from_the_checkpoint():
    script = Script(kill={(1, 1, 6)})
    pool = scripted_pool(script, capacity=2)
    script.on_kill = lambda: setattr(pool, "capacity", 1)  # its replica's node is gone
    spec = tiny_job(steps=12, resources={"dp": 2, "min_dp": 1, "max_dp": 2})
    ctl = _controller(spec, pool)
    assert _steps(ctl, 4)[2:] == [(Running, Running), (Running, Resizing)]
    assert ctl.state.reason == "worker_lost"
    (restart,) = _events(ctl, "restart")
    assert restart["ranks"] == [1] and "lost rank 1 (dp 1, mp 0" in restart["message"]
    assert _steps(ctl, 1) == [(Resizing, Running)]
    assert ctl.group.dp == 1 and ctl.record.step == 4
    (shrunk,) = _events(ctl, "resize")
    assert shrunk["reason"] == "shrunk" and shrunk["dp_from"] == 2
    placed = _events(ctl, "placed")[1]
    assert "from checkpoint step-00000004 at step 4" in placed["message"]
    ctl.run()
    assert ctl.record.status == JobState.SUCCEEDED and ctl.record.restarts == 1
    assert sorted(ctl.record.losses) == list(range(1, 13))


def test_a_save_committed_as_its_rank_dies_is_recorded_when_loaded():
    script = Script(die_after_commit={(1, 1, 4)})
    pool = scripted_pool(script, capacity=2)
    script.on_kill = lambda: setattr(pool, "capacity", 1)
    spec = tiny_job(steps=12, resources={"dp": 2, "min_dp": 1, "max_dp": 2})
    ctl = _controller(spec, pool)
    assert _steps(ctl, 4)[2:] == [(Running, Resizing), (Resizing, Running)]
    assert ctl.group.dp == 1 and ctl.record.step == 4
    (found,) = _events(ctl, "checkpoint")
    assert found["reason"] == "saved" and found["step"] == 4 and found["found"]
    assert found["path"] == "step-00000004"
    ctl.run()
    assert ctl.record.status == JobState.SUCCEEDED
    assert [e["step"] for e in _events(ctl, "checkpoint")] == [4, 8, 12]


def test_returned_capacity_grows_the_job_at_a_checkpoint_boundary():
    script = Script()
    pool = scripted_pool(script, capacity=1)
    script.on_save = lambda step: setattr(pool, "capacity", 2) if step == 4 else None
    spec = tiny_job(steps=12, resources={"dp": 2, "min_dp": 1, "max_dp": 2})
    ctl = _controller(spec, pool)
    assert _steps(ctl, 4) == [
        (Queued, Starting),
        (Starting, Running),
        (Running, Resizing),
        (Resizing, Running),
    ]
    (grown,) = _events(ctl, "resize")
    assert grown["reason"] == "grown" and ctl.group.dp == 2
    assert not _events(ctl, "restart")  # growing costs no restart
    assert ctl.run() == Succeeded(message="12 steps")
    assert ctl.record.restarts == 0


def test_a_frozen_rank_is_a_stall_that_spends_the_budget():
    script = Script(freeze={(1, 1, 2)})
    spec = tiny_job(steps=8, max_restarts=0, timeouts={"bootstrap_s": 60, "step_s": 0.4})
    ctl = _controller(spec, scripted_pool(script, capacity=2))
    assert _steps(ctl, 3)[-1] == (Running, Failed)
    assert ctl.state.reason == "stalled"
    assert "restart budget of 0 spent" in ctl.state.message
    (stall,) = _events(ctl, "restart")
    assert stall["reason"] == "stalled" and stall["ranks"] == [1]
    assert "not responding" in stall["message"]
    assert ctl.pool.used == 0  # the group was torn down


def test_a_stall_within_the_budget_restarts():
    script = Script(freeze={(1, 0, 6)})
    spec = tiny_job(steps=8, timeouts={"bootstrap_s": 60, "step_s": 0.4})
    ctl = _controller(spec, scripted_pool(script, capacity=2))
    assert _steps(ctl, 5)[2:] == [(Running, Running), (Running, Resizing), (Resizing, Running)]
    assert ctl.run() == Succeeded(message="8 steps")
    assert ctl.record.restarts == 1


def test_the_restart_budget_spent_fails_the_job():
    script = Script(kill={(1, 0, 2), (2, 1, 3)})
    spec = tiny_job(steps=8, max_restarts=1)
    ctl = _controller(spec, scripted_pool(script, capacity=2))
    assert _steps(ctl, 5)[1:] == [
        (Starting, Running),
        (Running, Resizing),  # first loss: restart 1 of 1
        (Resizing, Running),
        (Running, Failed),  # second loss: budget spent
    ]
    assert ctl.state.reason == "worker_lost"
    assert "(restart budget of 1 spent)" in ctl.state.message
    assert ctl.record.restarts == 2 and ctl.record.status == JobState.FAILED


@pytest.mark.parametrize(
    "fault,reason,message",
    [
        ({"error": {(1, 1, 3)}}, "training_error", "rank 1: ValueError: loss is nan at step 3"),
        (  # the engine's ConfigError: every retry would fail alike
            {"refuse_step": {(1, 0, 2)}},
            "config_error",
            "rank 0: ConfigError: stage 3: this forward read experts.1.w",
        ),
    ],
    ids=["error", "refused"],
)
def test_an_error_in_training_fails_the_job_without_a_restart(fault, reason, message):
    ctl = _controller(tiny_job(steps=8), scripted_pool(Script(**fault), capacity=2))
    assert _steps(ctl, 3)[-1] == (Running, Failed)
    assert ctl.state.reason == reason
    assert message in ctl.state.message
    assert ctl.record.restarts == 0


def test_a_failed_start_counts_a_restart_and_tries_again():
    script = Script(fail_setup={1})
    ctl = _controller(tiny_job(steps=4), scripted_pool(script, capacity=2))
    assert _steps(ctl, 3) == [(Queued, Starting), (Starting, Resizing), (Resizing, Running)]
    (restart,) = _events(ctl, "restart")
    assert restart["reason"] == "bootstrap_failed"
    assert "the rendezvous timed out" in restart["message"]
    assert ctl.run() == Succeeded(message="4 steps")


def test_a_configuration_the_engine_refuses_fails_the_job_without_a_restart():
    script = Script(refuse_setup={1})
    ctl = _controller(tiny_job(steps=4), scripted_pool(script, capacity=2))
    assert _steps(ctl, 2) == [(Queued, Starting), (Starting, Failed)]
    assert ctl.state.reason == "config_error"
    assert "'MoE' names no module with parameters" in ctl.state.message
    assert ctl.record.restarts == 0 and not _events(ctl, "restart")


def test_a_full_disk_fails_the_save_not_the_job():
    script = Script(full_disk={4}, kill={(1, 0, 10)})
    spec = tiny_job(steps=12, checkpoint={"interval_steps": 4})
    ctl = _controller(spec, scripted_pool(script, capacity=2))
    assert _steps(ctl, 4)[2:] == [(Running, Running), (Running, Running)]
    saves = [(e["reason"], e["step"]) for e in _events(ctl, "checkpoint")]
    assert saves == [("save_failed", 4), ("saved", 8)]  # the next save tried again
    assert "ENOSPC" in _events(ctl, "checkpoint")[0]["message"]
    assert ctl.state.failed_saves == 0 and ctl.record.restarts == 0
    ctl.run()  # a rank lost at step 10 restarts from step 8, the newest sound one
    assert _events(ctl, "placed")[1]["from_checkpoint"] == "step-00000008"
    assert ctl.record.status == JobState.SUCCEEDED


@pytest.mark.parametrize("loss", [float("nan"), float("inf")])
def test_a_loss_that_is_not_finite_fails_the_job_before_its_chunk_is_saved(loss):
    """See [Note: a diverged job] in workers/controller.py."""
    script = Script(nan={(1, 6): loss, (0, 7): loss, (1, 7): loss})
    spec = tiny_job(steps=12, checkpoint={"interval_steps": 4})
    ctl = _controller(spec, scripted_pool(script, capacity=2))
    assert _steps(ctl, 4) == [
        (Queued, Starting),
        (Starting, Running),
        (Running, Running),  # steps 1-4, saved at 4
        (Running, Failed),  # steps 5-8: step 6's loss on rank 1
    ]
    assert ctl.state.reason == "diverged"
    assert f"the loss is {loss} at step 6" in ctl.state.message
    assert "the newest checkpoint, step 4, is from before it" in ctl.state.message
    assert [e["step"] for e in _events(ctl, "checkpoint")] == [4]
    assert script.saved == 4 and ctl.record.restarts == 0
    assert ctl.record.status == JobState.FAILED


def test_a_loss_not_finite_in_the_first_chunk_says_no_checkpoint_was_saved():
    script = Script(nan={(0, 1): float("nan")})
    ctl = _controller(tiny_job(steps=8), scripted_pool(script, capacity=2))
    assert _steps(ctl, 3)[2] == (Running, Failed)
    assert ctl.state.reason == "diverged" and "no checkpoint was saved" in ctl.state.message
    assert script.saved == 0


def test_the_final_save_is_tried_again_then_fails_the_job():
    script = Script(full_disk={4})
    ctl = _controller(tiny_job(steps=4), scripted_pool(script, capacity=2))
    assert _steps(ctl, 5)[2:] == [(Running, Running), (Running, Running), (Running, Failed)]
    assert ctl.state.reason == "checkpoint_failed"
    assert "the final checkpoint failed 3 times" in ctl.state.message
    assert [e["reason"] for e in _events(ctl, "checkpoint")] == ["save_failed"] * 3
    assert script.trained.count((1, 0, 4)) == 1  # the steps were not trained again


def test_the_final_save_succeeds_on_a_retry():
    script = Script(full_disk={4})
    pool = scripted_pool(script, capacity=2)
    ctl = _controller(tiny_job(steps=4), pool)
    _steps(ctl, 3)
    script.full_disk.clear()  # space was freed
    assert _steps(ctl, 1) == [(Running, Succeeded)]
    assert [e["reason"] for e in _events(ctl, "checkpoint")] == ["save_failed", "saved"]


def test_no_room_fails_the_job_with_what_is_free():
    ctl = _controller(tiny_job(), scripted_pool(Script(), capacity=1))
    assert _steps(ctl, 2)[-1] == (Starting, Failed)
    assert ctl.state.reason == "insufficient_resources"
    assert "free now: 1 replica(s)" in ctl.state.message


@pytest.mark.parametrize("after", [1, 2])
def test_cancel_while_starting_or_running(after):
    ctl = _controller(tiny_job(steps=100), scripted_pool(Script(), capacity=2))
    _steps(ctl, after)
    ctl.request_cancel("stopped by alice")
    previous, following = ctl.step()
    assert following == Cancelled(message="stopped by alice")
    assert ctl.record.status == JobState.CANCELLED and ctl.pool.used == 0
    assert ctl.record.finished_at is not None


def test_an_unexpected_error_fails_the_job_and_frees_the_group():
    ctl = _controller(tiny_job(steps=8), scripted_pool(Script(), capacity=2))
    _steps(ctl, 2)
    ctl.state.group.begin = None  # a bug in the controller's own code path
    assert _steps(ctl, 1) == [(Running, Failed)]
    assert ctl.state.reason == "internal_error" and "TypeError" in ctl.state.message
    assert ctl.pool.used == 0


def test_a_replacement_supervisor_goes_on_from_the_newest_checkpoint():
    script = Script(saved=8)  # what the lost supervisor's job had saved
    spec = tiny_job(steps=12, max_restarts=1)
    record = JobRecord("job", 1, spec.steps, "/ckpt")
    ctl = JobController(spec, scripted_pool(script, 2), record, succession=Succession(1, 8))
    assert record.status == JobState.RESIZING and record.reason == "supervisor_lost"
    assert _steps(ctl, 2) == [(Resizing, Running), (Running, Succeeded)]
    assert _events(ctl, "placed")[0]["from_checkpoint"] == "step-00000008"
    assert sorted(record.losses) == [9, 10, 11, 12] and record.restarts == 1


@pytest.mark.parametrize("stored", [0, 4], ids=["none-stored", "four-stored"])
def test_a_checkpoint_carries_the_points_the_control_plane_has_not_stored(stored):
    """A supervisor lost before the control plane stored its last points: the new one
    gets them back from the checkpoint it resumes from, however many saves ago the
    control plane last read (each save carries every point not yet stored, not only
    those since the save before)."""
    script = Script()
    spec = tiny_job(steps=12)
    first = _controller(spec, scripted_pool(script, 2))
    _steps(first, 3)  # placed; steps 1-4, saved at 4
    first.record.mark_stored(stored)  # a poll: the control plane has the first points
    _steps(first, 1)  # steps 5-8, saved at 8
    assert [p["step"] for p in script.saved_history] == list(range(stored + 1, 9))
    first.record.mark_stored(99)  # beyond what it has: it has everything
    assert first.record.unstored(8) == []
    record = JobRecord("job", 1, spec.steps, "/ckpt")
    ctl = JobController(spec, scripted_pool(script, 2), record, succession=Succession(1, 8))
    ctl.run()
    assert [p["step"] for p in record.history_since(0)[0]] == list(range(stored + 1, 13))


def _orphan(script, pool, trained_to):
    """The group a lost supervisor left: set up, trained to ``trained_to``, saved at
    the step before the last chunk."""
    placement = pool.place(2, 2, 60)
    group = pool.start(placement, 0)
    for rank in group.ranks:
        rank.train(trained_to - 4)
        rank.save(2)
        rank.train(trained_to)  # its supervisor died before the save
    pool.orphan = group
    return group


def _replacement(spec, pool, reported_save=4):
    """A supervisor replacing a lost one; the control plane has the ``saved`` event
    of ``reported_save``."""
    record = JobRecord("job", 1, spec.steps, "/ckpt")
    return JobController(spec, pool, record, succession=Succession(1, reported_save))


def test_a_replacement_supervisor_adopts_the_running_ranks():
    script = Script()
    pool = scripted_pool(script, capacity=2)
    orphan = _orphan(script, pool, trained_to=8)
    ctl = _replacement(tiny_job(steps=12, max_restarts=1), pool)
    assert _steps(ctl, 1) == [(Resizing, Running)]
    assert ctl.group is orphan and ctl.state.save_first and ctl.record.step == 4
    (adopted,) = _events(ctl, "placed")
    assert adopted["reason"] == "adopted" and "at step 8" in adopted["message"]
    assert _steps(ctl, 1) == [(Running, Running)]  # the save the lost supervisor missed
    assert [e["step"] for e in _events(ctl, "checkpoint")] == [8] and ctl.record.step == 8
    ctl.run()
    assert ctl.record.status == JobState.SUCCEEDED and pool.attempts == 1  # no new group
    assert sorted(ctl.record.losses) == list(range(5, 13))  # the lost chunk's included
    # One point per step, the lost chunk's included.
    assert [h["step"] for h in ctl.record.history_since(0)[0]] == list(range(5, 13))


def test_a_lost_supervisors_call_that_arrives_after_the_adoption_is_refused():
    """The lost supervisor's last train was still on its way when its successor
    settled the ranks: run then, it would move the ranks past the step the successor
    adopted them at, and nobody would receive its steps. The ranks refuse it (see
    [Note: supervisor terms] in workers/rank.py), and the history keeps every step."""
    script = Script()
    pool = scripted_pool(script, capacity=2)
    orphan = _orphan(script, pool, trained_to=8)
    ctl = _replacement(tiny_job(steps=12, max_restarts=1), pool)
    assert _steps(ctl, 1) == [(Resizing, Running)]  # adopted at step 8
    late = [rank.train(12) for rank in orphan.ranks]  # the lost supervisor's term, 0
    assert [c.losses for c in late] == [{}, {}] and {r.step for r in orphan.ranks} == {8}
    assert orphan.ranks[0].save(2).path is None
    ctl.run()
    assert ctl.record.status == JobState.SUCCEEDED and pool.attempts == 1
    assert [h["step"] for h in ctl.record.history_since(0)[0]] == list(range(5, 13))
    assert sorted(ctl.record.losses) == list(range(5, 13))


def test_a_replacement_supervisor_re_forms_the_adopted_group_under_its_own_term():
    """The ranks a successor settled refuse re-formings of older terms (see [Note:
    supervisor terms] in workers/rank.py), so its own must carry its term: a rank
    lost after the adoption is then left behind in place, from host memory."""
    script = Script(redundancy=1)
    pool = scripted_pool(script, capacity=2)
    orphan = _orphan(script, pool, trained_to=8)
    script.kill.add((orphan.ranks[1].attempt, 1, 10))
    script.on_kill = lambda: setattr(pool, "capacity", 1)  # its node is gone
    ctl = _replacement(_live_job(), pool)
    ctl.run()
    assert ctl.record.status == JobState.SUCCEEDED
    regrouped = _events(ctl, "placed")[-1]
    assert regrouped["reason"] == "regrouped" and regrouped["from_peers"], regrouped
    assert pool.attempts == 1  # adopted, then shrunk in place: no group started
    with pytest.raises(RuntimeError, match="term 0 after term 1"):
        orphan.ranks[0].regroup(1, 0, 0, False)  # the lost supervisor's, late
    assert sorted(ctl.record.losses) == list(range(5, 13))


def test_a_replacement_supervisor_hands_on_the_steps_its_predecessor_held():
    """The lost supervisor saved at step 8 (the save carried steps 5-8) and its ranks
    trained on to 10; the control plane had polled none of steps 5-10 when it was
    lost. The new supervisor hands on each of them once: the save's points from the
    ranks, then their reports since."""
    script = Script()
    pool = scripted_pool(script, capacity=2)
    group = pool.start(pool.place(2, 2, 60), 0)
    held = [{"step": s, "steps": 1, "loss": 1.0 / s} for s in range(5, 9)]
    for rank in group.ranks:
        rank.train(4)
        rank.save(2)
        rank.train(8)
        rank.save(2, held)
        rank.train(10)  # its supervisor died before the chunk's report reached it
    pool.orphan = group
    ctl = _replacement(tiny_job(steps=12, max_restarts=1), pool)
    ctl.run()
    assert ctl.record.status == JobState.SUCCEEDED and pool.attempts == 1
    assert [h["step"] for h in ctl.record.history_since(0)[0]] == list(range(5, 13))
    assert sorted(ctl.record.losses) == list(range(9, 13))


@pytest.mark.parametrize("reported_save", [4, 8])
def test_a_replacement_supervisor_reports_the_save_whose_event_was_lost(reported_save):
    """The lost supervisor's ranks committed the save at step 8; its ``saved`` event
    reached the control plane (reported_save 8) or was lost with the supervisor
    (reported_save 4). The new one reports the save once, whether it adopts the
    ranks or loads that checkpoint."""
    script = Script()
    pool = scripted_pool(script, capacity=2)
    for rank in _orphan(script, pool, trained_to=8).ranks:
        rank.save(2)  # committed; its supervisor died before its event was read
    ctl = _replacement(tiny_job(steps=12, max_restarts=1), pool, reported_save)
    ctl.run()
    assert ctl.record.status == JobState.SUCCEEDED and pool.attempts == 1  # adopted
    expected = [(8, "/ckpt/step-00000008", True)] if reported_save == 4 else []
    expected.append((12, "/ckpt/step-00000012", False))
    saved = [(e["step"], e["path"], e.get("found", False)) for e in _events(ctl, "checkpoint")]
    assert saved == expected

    pool = scripted_pool(Script(saved=8), capacity=2)  # no ranks left: it loads step 8
    ctl = _replacement(tiny_job(steps=12, max_restarts=1), pool, reported_save)
    ctl.run()
    (placed,) = _events(ctl, "placed")
    assert placed["reason"] == "started" and placed["from_checkpoint"] == "step-00000008"
    if reported_save == 4:
        expected[0] = (8, "step-00000008", True)  # the scripted load names it so
    saved = [(e["step"], e["path"], e.get("found", False)) for e in _events(ctl, "checkpoint")]
    assert saved == expected


def test_a_replacement_supervisor_falls_back_on_the_checkpoint_without_its_ranks():
    script = Script()
    pool = scripted_pool(script, capacity=2)
    orphan = _orphan(script, pool, trained_to=8)
    orphan._gone.add(1)  # one of them died with the supervisor's node
    ctl = _replacement(tiny_job(steps=12, max_restarts=1), pool)
    assert _steps(ctl, 1) == [(Resizing, Running)]
    assert ctl.group is not orphan and pool.attempts == 2
    (placed,) = _events(ctl, "placed")
    assert placed["reason"] == "started" and placed["from_checkpoint"] == "step-00000004"
    assert ctl.record.restarts == 1  # the control plane counted this restart
    ctl.run()
    assert ctl.record.status == JobState.SUCCEEDED


def test_a_replacement_supervisor_does_not_adopt_a_group_whose_last_call_failed():
    """The lost supervisor's last call reached rank 1 only: rank 0 never joined its
    collective, so rank 1's call ended in the group's timeout (a broken pair). Both
    ranks stand at the same step, but going on with that group would fail its next
    collective: the job restarts from the checkpoint instead."""
    script = Script()
    pool = scripted_pool(script, capacity=2)
    orphan = _orphan(script, pool, trained_to=8)
    script.error.add((1, 1, 9))
    with pytest.raises(ValueError):
        orphan.ranks[1].train(12)
    ctl = _replacement(tiny_job(steps=12, max_restarts=1), pool)
    assert _steps(ctl, 1) == [(Resizing, Running)]
    assert ctl.group is not orphan and pool.attempts == 2
    (refused,) = [e for e in _events(ctl, "resize") if e["reason"] == "adoption_refused"]
    assert refused["ranks"] == [1] and "rank 1 (dp 1, mp 0" in refused["message"]
    assert "ValueError: loss is nan at step 9" in refused["message"]
    (placed,) = _events(ctl, "placed")
    assert placed["reason"] == "started" and placed["from_checkpoint"] == "step-00000004"
    ctl.run()
    assert ctl.record.status == JobState.SUCCEEDED


def test_the_transition_graph():
    for state, successors in TRANSITIONS.items():
        assert state.is_terminal == (not successors)
    assert JobState.RUNNING.can_become(JobState.RUNNING)
    assert not JobState.STARTING.can_become(JobState.SUCCEEDED)
    with pytest.raises(IllegalTransition, match="from succeeded to running"):
        check_transition(JobState.SUCCEEDED, JobState.RUNNING)
    assert set(TRANSITIONS) == set(JobState)


def test_callbacks_see_every_move():
    ctl = _controller(tiny_job(steps=4), scripted_pool(Script(), capacity=2))
    seen = []
    ctl.callbacks.append(lambda a, b: seen.append((a.kind, b.kind)))
    ctl.run()
    assert seen == [
        (JobState.QUEUED, JobState.STARTING),
        (JobState.STARTING, JobState.RUNNING),
        (JobState.RUNNING, JobState.SUCCEEDED),
    ]


# -- live resize: see [Note: live resize] -------------------------------------------------


def _live_job(resources=None, **overrides):
    engine = {"stage": 2, "bucket_elements": 4096, "redundancy": "host-copy"}
    resources = {"dp": 2, "min_dp": 1, "max_dp": 2, **(resources or {})}
    return tiny_job(steps=12, engine=engine, resources=resources, **overrides)


def test_a_killed_rank_shrinks_the_group_in_place_from_host_memory():
    script = Script(kill={(1, 1, 6)}, redundancy=1)
    pool = scripted_pool(script, capacity=2)
    script.on_kill = lambda: setattr(pool, "capacity", 1)  # its node is gone
    ctl = _controller(_live_job(), pool)
    assert _steps(ctl, 5)[2:] == [
        (Running, Running),  # steps 1-4, saved at 4
        (Running, Regrouping),  # rank 1 lost at step 6
        (Regrouping, Running),
    ]
    assert ctl.group.dp == 1 and ctl.state.step == 5  # the copies of step 5, not the disk
    assert pool.attempts == 1  # the same rank actors: no new group was started
    (restart,) = _events(ctl, "restart")
    assert restart["reason"] == "worker_lost" and restart["ranks"] == [1]
    regrouped = _events(ctl, "placed")[-1]
    assert regrouped["reason"] == "regrouped" and regrouped["from_peers"]
    assert "(dp 2 -> 1) in place from host memory at step 5" in regrouped["message"]
    (shrunk,) = _events(ctl, "resize")
    assert shrunk["reason"] == "shrunk"
    ctl.run()
    assert ctl.record.status == JobState.SUCCEEDED and ctl.record.restarts == 1
    assert sorted(ctl.record.losses) == list(range(1, 13))
    assert pool.used == 0


def test_a_survivor_blocked_on_the_lost_rank_is_interrupted_not_waited_for():
    """On gloo a survivor receiving from a rank killed mid-message waits for the group's
    timeout: dropping the lost rank must interrupt it, or the regroup fails (after
    SETTLE_S) and the job restarts from the checkpoint."""
    script = Script(kill={(1, 1, 6)}, stuck={(1, 0, 6)}, redundancy=1)
    pool = scripted_pool(script, capacity=2)
    script.on_kill = lambda: setattr(pool, "capacity", 1)
    ctl = _controller(_live_job(), pool)
    assert _steps(ctl, 5)[3:] == [(Running, Regrouping), (Regrouping, Running)]
    assert ctl.group.dp == 1 and ctl.state.step == 5 and pool.attempts == 1
    assert not [e for e in _events(ctl, "resize") if e["reason"] == "regroup_failed"]
    ctl.run()
    assert ctl.record.status == JobState.SUCCEEDED and ctl.record.restarts == 1
    assert sorted(ctl.record.losses) == list(range(1, 13))


def test_a_lost_rank_ends_the_wait_at_once_while_the_others_are_blocked():
    """WorkerGroup.wait returns the moment a call fails: the survivors' calls may be
    blocked on the lost rank until they are interrupted, and waiting for them (or for
    the watcher's poll to run out) would be counted in the time to recover."""
    script = Script(kill={(1, 1, 1)}, stuck={(1, 0, 1)})
    pool = scripted_pool(script, capacity=2)
    group = pool.start(pool.place(2, 2, 1.0), 0)
    group.begin("train", 1)
    ends_by_itself = threading.Timer(5.0, script.release.set)  # rank 0's call, later
    ends_by_itself.start()
    answers = group.wait(60.0)
    ends_by_itself.cancel()
    assert list(answers) == [1] and isinstance(answers[1], RankDied), answers
    group.shutdown(clean=False)


def test_a_lost_rank_is_replaced_at_the_next_step_boundary():
    script = Script(kill={(1, 1, 6)}, redundancy=2)
    pool = scripted_pool(script, capacity=2)  # the lost rank's seat stays usable
    ctl = _controller(_live_job(), pool)
    _steps(ctl, 5)
    assert ctl.group.dp == 1 and ctl.state.step == 4  # K = 2: back to the copies of step 4
    assert _steps(ctl, 2) == [(Running, Regrouping), (Regrouping, Running)]
    assert ctl.group.dp == 2 and ctl.state.step == 4
    assert [e["reason"] for e in _events(ctl, "resize")] == ["shrunk", "grown"]
    assert ctl.record.restarts == 1  # growing back costs none
    shrunk, grown = [e for e in _events(ctl, "placed") if e["reason"] == "regrouped"]
    # Where each re-forming's time went: the slowest rank's phases.
    assert shrunk["slowest_rank"] == 0 and shrunk["phases"] == {"rendezvous": 0.1, "restore": 0.2}
    assert grown["slowest_rank"] == 1 and grown["phases"] == {"rendezvous": 0.2, "restore": 0.2}
    # And, for a grow, where each newcomer's start went (in process: only its rank).
    assert shrunk["newcomers"] == [] and grown["newcomers"] == [{"rank": 1}]
    ctl.run()
    assert ctl.record.status == JobState.SUCCEEDED
    assert sorted(ctl.record.losses) == list(range(1, 13))


def test_returned_capacity_joins_at_a_step_boundary_not_a_checkpoint():
    script = Script()
    pool = scripted_pool(script, capacity=1)
    ctl = _controller(_live_job(), pool)
    _steps(ctl, 2)
    assert ctl.group.dp == 1
    assert _steps(ctl, 2) == [(Running, Running), (Running, Running)]
    assert ctl.state.step == 2  # one step per chunk while below max_dp
    pool.capacity = 2
    assert _steps(ctl, 2) == [(Running, Regrouping), (Regrouping, Running)]
    assert ctl.group.dp == 2 and ctl.state.step == 2 and pool.attempts == 2
    assert not _events(ctl, "restart")
    ctl.run()
    assert ctl.record.status == JobState.SUCCEEDED and ctl.record.restarts == 0
    assert [e["step"] for e in _events(ctl, "checkpoint")] == [4, 8, 12]  # boundaries only


def test_copies_that_lack_a_lost_rank_fall_back_on_the_checkpoint_in_place():
    script = Script(kill={(1, 1, 6)}, redundancy=1, peers_incomplete=True)
    pool = scripted_pool(script, capacity=2)
    script.on_kill = lambda: setattr(pool, "capacity", 1)
    ctl = _controller(_live_job(), pool)
    _steps(ctl, 5)
    assert ctl.state.step == 4 and pool.attempts == 1
    regrouped = _events(ctl, "placed")[-1]
    assert not regrouped["from_peers"] and regrouped["from_checkpoint"] == "step-00000004"
    assert "the peers' memory lacked: no copy of old rank 1" in regrouped["message"]


def test_a_failed_regroup_restarts_from_the_checkpoint():
    script = Script(kill={(1, 1, 6)}, fail_regroup=True)
    pool = scripted_pool(script, capacity=2)
    ctl = _controller(_live_job(), pool)
    assert _steps(ctl, 5)[3:] == [(Running, Regrouping), (Regrouping, Resizing)]
    assert [e["reason"] for e in _events(ctl, "restart")] == ["worker_lost", "bootstrap_failed"]
    script.fail_regroup = False
    assert _steps(ctl, 1) == [(Resizing, Running)] and ctl.record.step == 4
    ctl.run()
    assert ctl.record.status == JobState.SUCCEEDED and ctl.record.restarts == 2


def test_a_model_parallel_replica_leaves_whole_and_comes_back_whole():
    """MP 2: rank 3 is lost, so its partner rank 2 (the same replica) is stopped with
    it; the group re-forms at one replica from host memory, and when capacity returns a
    whole replica (two newcomers) joins at a step boundary."""
    script = Script(kill={(1, 3, 6)}, redundancy=1)
    pool = scripted_pool(script, capacity=2, mp=2)
    ctl = _controller(_live_job(resources={"mp": 2}), pool)
    assert _steps(ctl, 4)[3:] == [(Running, Regrouping)]
    assert ctl.state.message.startswith("re-forming without replica(s) [1] (ranks [2, 3]): lost")
    assert _steps(ctl, 1) == [(Regrouping, Running)]
    assert ctl.group.dp == 1 and ctl.group.world == 2 and ctl.state.step == 5
    assert len(script.living) == 2 and pool.attempts == 1  # rank 2 closed, none started
    (restart,) = _events(ctl, "restart")
    assert restart["ranks"] == [3]
    regrouped = _events(ctl, "placed")[-1]
    assert "2 ranks (dp 2 -> 1) in place from host memory at step 5" in regrouped["message"]
    assert _steps(ctl, 2) == [(Running, Regrouping), (Regrouping, Running)]  # the seat is free
    assert ctl.group.dp == 2 and ctl.group.world == 4 and len(script.living) == 4
    assert [e["reason"] for e in _events(ctl, "resize")] == ["shrunk", "grown"]
    ctl.run()
    assert ctl.record.status == JobState.SUCCEEDED and ctl.record.restarts == 1
    assert sorted(ctl.record.losses) == list(range(1, 13))


def test_losing_every_replica_restarts_from_the_checkpoint():
    """MP 2 at DP 1 (min_dp 1): the lost rank's replica is the only one, so nothing is
    left to re-form: the job restarts from the checkpoint."""
    script = Script(kill={(1, 0, 6)}, redundancy=1)
    pool = scripted_pool(script, capacity=1, mp=2)
    ctl = _controller(_live_job(resources={"mp": 2, "dp": 1, "max_dp": 1}), pool)
    assert _steps(ctl, 5)[3:] == [(Running, Resizing), (Resizing, Running)]
    assert ctl.group.dp == 1 and ctl.state.step == 4 and pool.attempts == 2


@pytest.mark.parametrize("when", ["after_last_step", "in_final_save"])
def test_a_rank_lost_at_the_end_leaves_a_final_checkpoint_saved_and_reported(when):
    """The survivors restore step 12 from host memory: the job succeeds only once the
    final checkpoint is saved again and reported, not at the restored step."""
    where = {(1, 1, 12)}
    script = Script(redundancy=1, die_after_commit=where if when == "in_final_save" else set())
    pool = scripted_pool(script, capacity=2)

    def lost():
        pool.capacity = 1
        script.lost_copy = 12  # K = 1: its neighbour holds the lost rank's copy of step 12

    script.on_kill = lost
    if when == "after_last_step":  # the rank trains step 12, then dies before answering
        original = pool.make_rank

        def make_rank(rank, world, attempt):
            made = original(rank, world, attempt)
            if rank == 1 and attempt == 1:
                train = made.train

                def dies_after_training(until, term=0):
                    chunk = train(until, term)
                    if made.step == 12:
                        script.lost_copy = made.copied
                        pool.capacity = 1
                        raise RankDied(1, "the actor died unexpectedly")
                    return chunk

                made.train = dies_after_training
            return made

        pool.make_rank = make_rank
    ctl = _controller(_live_job(), pool)
    ctl.run()
    assert ctl.record.status == JobState.SUCCEEDED and ctl.group is None
    saved = [e["step"] for e in _events(ctl, "checkpoint") if e["reason"] == "saved"]
    assert saved[-1] == 12 and ctl.record.step == 12 and script.saved == 12
    assert sorted(ctl.record.losses) == list(range(1, 13))


def test_ranks_lost_together_are_dropped_together_and_fall_back_in_place():
    """A node of two replicas lost at once (ring neighbours: the copies lack their
    shards): one restart, both dropped, every survivor loads the checkpoint in place."""
    script = Script(redundancy=1, kill={(1, 1, 6), (1, 2, 6)}, peers_incomplete=True)
    pool = scripted_pool(script, capacity=4)
    script.on_kill = lambda: setattr(pool, "capacity", 2)
    ctl = _controller(_live_job(resources={"dp": 4, "min_dp": 1, "max_dp": 4}), pool)
    assert _steps(ctl, 5)[3:] == [(Running, Regrouping), (Regrouping, Running)]
    (restart,) = _events(ctl, "restart")
    assert restart["ranks"] == [1, 2] and restart["restarts"] == 1
    assert ctl.group.dp == 2 and ctl.state.step == 4 and pool.attempts == 1
    regrouped = _events(ctl, "placed")[-1]
    assert "(dp 4 -> 2) in place from checkpoint step-00000004" in regrouped["message"]
    assert "the peers' memory lacked" in regrouped["message"]


@pytest.mark.parametrize("mp", [1, 2])
def test_a_rank_found_dead_after_the_others_were_dropped_is_dropped_too(mp):
    """With model parallelism its MP partner leaves with it: a replica is whole or gone."""
    script = Script(redundancy=1, kill={(1, 1, 6)})
    pool = scripted_pool(script, capacity=3, mp=mp)
    resources = {"dp": 3, "min_dp": 1, "max_dp": 3, "mp": mp}
    ctl = _controller(_live_job(resources=resources), pool)
    _steps(ctl, 4)
    assert isinstance(ctl.state, Regrouping)
    group = ctl.state.group
    drop = group.drop

    def drop_then_another_dies(ranks, settle_s):
        dropped = drop(ranks, settle_s)
        if dropped and group.world == 2 * mp:
            group._gone.add(mp)  # a rank of the second replica left: its process died
        return dropped

    group.drop = drop_then_another_dies
    assert _steps(ctl, 1) == [(Regrouping, Running)]
    assert ctl.group.dp == 1 and ctl.group.world == mp and ctl.record.restarts == 1


def test_a_cancel_while_waiting_for_room_ends_cancelled_at_once():
    script = Script()
    pool = scripted_pool(script, capacity=1)  # dp 2 needs 2: placing waits for room
    place = pool.place
    waited = []

    def waits_for_room(lowest, highest, wait_s, cancel=None):
        got = place(lowest, highest, wait_s, cancel)
        if got is None:
            waited.append(cancel.wait(30.0))  # as placement.place, ended by the cancel
        return got

    pool.place = waits_for_room
    ctl = _controller(tiny_job(steps=8), pool)
    ctl.step()
    threading.Timer(0.2, lambda: ctl.request_cancel("stopped by alice")).start()
    assert _steps(ctl, 1) == [(Starting, Cancelled)] and waited == [True]
    assert ctl.record.status == JobState.CANCELLED and pool.used == 0


def test_a_cancel_during_a_start_or_a_re_forming_is_kept():
    script = Script(kill={(1, 1, 6)}, redundancy=1)
    pool = scripted_pool(script, capacity=2)
    script.on_kill = lambda: setattr(pool, "capacity", 1)
    ctl = _controller(_live_job(), pool)
    _steps(ctl, 4)
    assert isinstance(ctl.state, Regrouping)
    regroup = ctl.state.group.regroup

    def cancelled_meanwhile(*args):
        ctl.request_cancel("stopped by alice")
        return regroup(*args)

    ctl.state.group.regroup = cancelled_meanwhile
    assert _steps(ctl, 1) == [(Regrouping, Cancelled)] and pool.used == 0


def test_a_start_that_fails_changes_no_size():
    """The job's size (and its resize events) follows the groups that started."""
    script = Script(kill={(1, 1, 6)}, fail_setup={2})
    pool = scripted_pool(script, capacity=2)
    script.on_kill = lambda: setattr(pool, "capacity", 1)
    ctl = _controller(tiny_job(steps=12, resources={"dp": 2, "min_dp": 1}), pool)
    _steps(ctl, 4)
    assert _steps(ctl, 1) == [(Resizing, Resizing)]  # dp 1 fits, and its start fails
    pool.capacity = 2
    assert _steps(ctl, 1) == [(Resizing, Running)]
    assert ctl.group.dp == 2 and not _events(ctl, "resize")


def test_a_live_fallback_with_no_checkpoint_says_it_starts_from_scratch():
    script = Script(kill={(1, 1, 2)}, peers_incomplete=True)
    pool = scripted_pool(script, capacity=2)
    script.on_kill = lambda: setattr(pool, "capacity", 1)
    original = pool.make_rank

    def make_rank(rank, world, attempt):
        made = original(rank, world, attempt)
        regroup = made.regroup  # as RankWorker.regroup: no checkpoint to load, none named
        made.regroup = lambda *a: dataclasses.replace(regroup(*a), loaded=None)
        return made

    pool.make_rank = make_rank
    ctl = _controller(_live_job(), pool)
    _steps(ctl, 4)
    regrouped = _events(ctl, "placed")[-1]
    assert (
        "in place from scratch (no checkpoint yet) (the peers' memory lacked"
        in (regrouped["message"])
    )
    assert "None" not in regrouped["message"]


def test_an_unexpected_error_after_a_start_frees_the_new_group():
    ctl = _controller(tiny_job(steps=8), scripted_pool(Script(), capacity=2))
    ctl.step()
    ctl._carried = None  # a bug in what follows a start
    assert _steps(ctl, 1) == [(Starting, Failed)] and ctl.state.reason == "internal_error"
    assert ctl.pool.used == 0


def test_a_re_forming_below_min_dp_says_why_it_restarts():
    script = Script(kill={(1, 1, 6)}, redundancy=1)
    pool = scripted_pool(script, capacity=2)
    ctl = _controller(_live_job(resources={"min_dp": 2}), pool)
    assert _steps(ctl, 5)[3:] == [(Running, Regrouping), (Regrouping, Resizing)]
    (below,) = [e for e in _events(ctl, "resize") if e["reason"] == "below_min_dp"]
    assert "1 replica(s) left, fewer than min_dp 2" in below["message"]
    ctl.run()
    assert ctl.record.status == JobState.SUCCEEDED


def test_a_shrink_drops_the_stats_of_ranks_no_longer_in_the_group():
    script = Script(kill={(1, 2, 6)}, redundancy=1)
    pool = scripted_pool(script, capacity=3)
    script.on_kill = lambda: setattr(pool, "capacity", 2)
    ctl = _controller(_live_job(resources={"dp": 3, "min_dp": 1, "max_dp": 3}), pool)
    _steps(ctl, 3)  # steps 1-4 at dp 3
    assert sorted(ctl.record.metrics()) == ["0", "1", "2"]
    assert _steps(ctl, 2) == [(Running, Regrouping), (Regrouping, Running)]
    kept = ctl.record.metrics()
    assert sorted(kept) == ["0", "1"]  # rank 2 is gone with its node
    assert kept["0"]["tokens_per_second"] == 1.0  # the steps handed back kept rank 0's stats
