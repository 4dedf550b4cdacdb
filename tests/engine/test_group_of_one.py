"""A job of one rank issues no collective and still trains as DDP does. See [Note: a
group of one] in zeroservice/comm.py."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from tests.engine.harness import assert_matches_ddp, combine_ranks
from tests.engine.scenarios import TINY, Spec, ledgers, parity
from tests.engine.test_parity import CASES, STAGES
from zeroservice import comm
from zeroservice.launch import run_local

# Cases of the parity suite (test_parity.py), at every stage or at stage 3 alone.
SPECS = {(s, c): Spec(stage=s, **CASES[c]) for c in ("plain", "accum4", "clip") for s in STAGES}
SPECS |= {(3, c): Spec(stage=3, **CASES[c]) for c in ("tight-prefetch", "persistent-units")}


def _collectives_refused(monkeypatch) -> None:
    """Every collective of torch.distributed the engine could reach raises."""

    def refused(*args, **kwargs):
        raise AssertionError("a collective was issued on a group of one")

    for name in ("all_reduce", "broadcast", "all_to_all_single", "isend", "irecv"):
        monkeypatch.setattr(dist, name, refused)
    monkeypatch.setattr(comm, "_all_gather_single", refused)
    monkeypatch.setattr(comm, "_reduce_scatter_single", refused)


def _ops_alone() -> dict:
    """Each op of a Communicator over the one-rank world, with torch.distributed's
    collectives refused: what each leaves in its tensors, and the ledger."""
    with pytest.MonkeyPatch.context() as mp:
        _collectives_refused(mp)
        c = comm.Communicator(None, comm.CommLedger())
        out = {}
        for op in ("all_reduce", "broadcast", "reduce_scatter", "all_gather"):
            t = torch.arange(6.0)
            getattr(c, op)(t, "test").wait()
            out[op] = t.tolist()
        for name, reduction in (("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
            t = torch.arange(6.0)
            c.all_reduce(t, "test", op=reduction).wait()
            out[f"all_reduce {name}"] = t.tolist()
        send, recv = torch.arange(4.0), torch.zeros(4)
        c.all_to_all(send, recv, "test").wait()
        out["all_to_all"] = recv.tolist()
        out["entries"] = c.ledger.as_list()
    return out


def test_every_op_leaves_its_tensor_and_issues_nothing():
    r = run_local(_ops_alone, 1)[0]
    for op in ("all_reduce", "broadcast", "reduce_scatter", "all_gather"):
        assert r[op] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], op
    for name in ("max", "min"):
        assert r[f"all_reduce {name}"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert r["all_to_all"] == [0.0, 1.0, 2.0, 3.0]
    calls = {e["op"]: e["calls"] for e in r["entries"]}
    assert calls == {
        "all_reduce": 3,
        "broadcast": 1,
        "reduce_scatter": 1,
        "all_gather": 1,
        "all_to_all": 1,
    }
    for e in r["entries"]:
        assert e["impl"] == "local", e
        assert e["seconds"] == 0.0 and e["intra_node_bytes"] == e["cross_node_bytes"] == 0, e


def _trained_alone(specs: list[Spec]) -> tuple[list[dict], list[dict]]:
    """Parity with DDP, and one step's ledger."""
    return parity(specs), ledgers(specs)


@functools.cache
def _results() -> dict:
    keys = list(SPECS)
    runs, steps = run_local(_trained_alone, 1, [SPECS[k] for k in keys])[0]
    return {k: (combine_ranks([run]), step) for k, run, step in zip(keys, runs, steps, strict=True)}


@pytest.mark.parametrize("stage,case", list(SPECS), ids=lambda v: str(v))
def test_one_rank_trains_as_ddp(stage, case):
    r, _ = _results()[(stage, case)]
    assert_matches_ddp(r)


@pytest.mark.parametrize("stage", STAGES)
def test_one_rank_step_is_local_and_counted(stage):
    """Every entry of a step is local, and the ledger still counts its payloads: the
    gradients' Ψ, and at stage 3 the gathers' 2Ψ less the position embedding, which
    backward never reads."""
    _, r = _results()[(stage, "plain")]
    assert r["entries"] and all(e["impl"] == "local" for e in r["entries"]), r["entries"]
    payload = {(e["op"], e["tag"]): e["payload_elements"] for e in r["entries"]}
    m = r["memory"]
    psi = m["psi_padded"]
    assert payload[("all_reduce", "grads")] == psi
    if stage == 3:
        assert payload[("all_gather", "params")] == 2 * psi - TINY["seq_len"] * TINY["dim"]
    # Nothing is partitioned away: one rank holds the paper's 16Ψ of model states.
    assert m["n_d"] == 1 and m["model_states"] == m["expected_padded"] == 16 * psi
