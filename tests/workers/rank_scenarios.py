"""A rank's engine built to be restored, run inside spawned ranks (zeroservice.launch):
what ``RankWorker`` does when a start or a re-forming group loads a checkpoint."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

import zeroservice
from workers.rank import Laps, RankWorker, SupervisorSuperseded


def _worker(spec_json: str, root: str, restoring: bool) -> RankWorker:
    worker = RankWorker("job", dist.get_rank(), spec_json)
    worker.root, worker.use_cuda = root, False
    worker.topo = zeroservice.build_topology(1)
    worker._build(restoring)
    return worker


def _weights(worker: RankWorker) -> dict[str, torch.Tensor]:
    assert worker.engine is not None
    return {k: v.clone() for k, v in worker.engine.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def load_or_initialise(spec_json: str, root: str, saved: bool) -> dict:
    """A worker built with ``restoring`` loads the newest checkpoint under ``root``
    (``saved``: one was written by a worker built as usual, after two steps); with
    none (``root`` holds only a damaged step directory) it is built again with the
    initial weights a fresh start has."""
    fresh = _worker(spec_json, root, restoring=False)
    assert fresh.engine is not None
    initial = _weights(fresh)
    if saved:
        engine, spec = fresh.engine, fresh.spec
        for _ in range(2):
            x = torch.randint(0, spec.model.vocab_size, (2, spec.model.seq_len))
            engine.backward(engine(x, x))
            engine.step()
        engine.save_checkpoint(root)
        trained = _weights(fresh)
    else:
        Path(root, "step-00000004").mkdir(parents=True, exist_ok=True)  # never committed
        dist.barrier()
        trained = initial
    fresh.engine.close()
    worker = _worker(spec_json, root, restoring=True)
    assert worker.engine is not None
    awaiting = worker.engine.awaiting_state
    loaded = worker._load_newest()
    return {
        "awaiting_before": awaiting,
        "awaiting_after": worker.engine.awaiting_state,
        "loaded": loaded,
        "step": worker.step,
        "equals_saved": _equal(_weights(worker), trained),
        "equals_initial": _equal(_weights(worker), initial),
    }


def frees_its_engine(spec_json: str, root: str) -> dict:
    """After a step, ``_drop_engine`` leaves nothing of the engine alive, even with
    the cyclic collector switched off (it collects itself)."""
    worker = _worker(spec_json, root, restoring=False)
    assert worker.engine is not None
    engine, spec = worker.engine, worker.spec
    x = torch.randint(0, spec.model.vocab_size, (2, spec.model.seq_len))
    engine.backward(engine(x, x))
    engine.step()
    probes = [weakref.ref(engine), weakref.ref(engine.units[0].flat)]
    del engine
    gc.disable()
    try:
        worker._drop_engine()
        alive = [p() is not None for p in probes]
    finally:
        gc.enable()
    return {"alive": alive}


def joins_through_the_opened_rendezvous(spec_json: str, root: str) -> dict:
    """Every rank opens a rendezvous (as rank 0 does when the supervisor asks it for
    the port); the group then forms at rank 0's port only: rank 0 serves it with the
    store it opened, the others join it as clients and drop the store they opened."""
    worker = RankWorker("job", dist.get_rank(), spec_json)
    worker.root, worker.use_cuda = root, False
    ports = [None] * dist.get_world_size()
    dist.all_gather_object(ports, worker.open_rendezvous("127.0.0.1"))
    opened = worker._store
    dist.destroy_process_group()
    laps = Laps()
    worker._join("127.0.0.1", ports[0], len(ports), restoring=False, laps=laps)
    total = torch.ones(1)
    dist.all_reduce(total)
    return {
        "world": dist.get_world_size(),
        "sum": total.item(),
        "opened": opened is not None,
        "kept": worker._store is not None,
        "phases": list(laps.seconds),
    }


def refuses_an_older_supervisors_calls(spec_json: str, root: str) -> dict:
    """A rank settled by a supervisor of term 1 refuses the train, save and regroup
    calls of term 0 (its lost predecessor's, delivered late) and takes those of term 1."""
    from workers.messages import RankSetup
    from workers.metrics import LABELS, RankMetrics

    worker = _worker(spec_json, root, restoring=False)
    # What ``_ready`` sets, without its Ray-served endpoint.
    worker.metrics, worker.peak = RankMetrics(dict.fromkeys(LABELS, "0")), 0.0
    worker._start_step, worker._comm_start = 0, worker._comm_totals()
    worker._setup = RankSetup(0, 0, 0, 0, None)
    first = worker.train(2, 0)
    idle = worker.settle(1)
    late = worker.train(4, 0)
    late_save = worker.save(2, None, 0)
    engine = worker.engine
    try:  # a rendezvous nobody serves: joining it would wait out the bootstrap timeout
        worker.regroup("127.0.0.1", 1, 2, 0, root, 0, "node", False, 0)
        late_regroup = "ran"
    except SupervisorSuperseded as exc:
        late_regroup = str(exc)
    kept_engine = worker.engine is engine and dist.is_initialized()
    after_late = worker.step
    then = worker.train(3, 1)
    saved = worker.save(2, None, 1)
    return {
        "first": sorted(first.losses),
        "settled_at": idle.progress.step,
        "late": sorted(late.losses),
        "late_saved": late_save.path,
        "late_regroup": late_regroup,
        "kept_engine": kept_engine,
        "after_late": after_late,
        "then": sorted(then.losses),
        "saved": saved.path,
        "failed": worker._failed,
        "newest": worker.settle(1).newest_checkpoint,
    }


def metrics_of_a_step(spec_json: str, root: str) -> dict:
    """A rank's exported gauges after one step of its loop that follows a larger batch
    trained by hand: the memory peaks are that step's, the bus bandwidth its
    collectives'."""
    from workers.metrics import RankMetrics
    from zeroservice.comm import bus_factor
    from zeroservice.memory import process_status_kib

    worker = _worker(spec_json, root, restoring=False)
    engine, spec = worker.engine, worker.spec
    assert engine is not None
    labels = {"job_id": "j", "rank": str(worker.rank), "dp_rank": "0", "mp_rank": "0", "node": "n"}
    worker.metrics, worker.peak = RankMetrics(labels), 0.0
    worker._comm_start, worker._start_step = worker._comm_totals(), 0
    worker._collectives()  # the baseline setup takes: start-up traffic is no step's
    x = torch.randint(0, spec.model.vocab_size, (8 * spec.micro_batch, spec.model.seq_len))
    engine.backward(engine(x, x))
    engine.step()
    large = engine.memory_ledger()

    def totals() -> dict[str, tuple[float, float]]:
        """Per op: bus bytes (each entry's payload times its own group's nccl-tests
        factor) and seconds so far, summed in the ledger's order as the rank sums them
        (so the step's difference is the same float)."""
        out: dict[str, tuple[float, float]] = {}
        for s in engine.comm_ledger().entries.values():
            bus, sec = out.get(s.op, (0.0, 0.0))
            out[s.op] = (bus + s.payload_bytes * bus_factor(s.op, s.world_size), sec + s.seconds)
        return out

    before = totals()
    worker._collectives()  # the hand-trained step is not the loop's either
    worker.tokens = 10**6  # the job's position, as a restart restores it
    held = torch.ones(64 * 2**20)  # 256 MiB the process held and gave back before the step
    del held
    lifetime_peak = process_status_kib("VmHWM") * 1024
    worker._train(1)
    after = engine.memory_ledger()
    expected_busbw: dict[str, float] = {}
    for op, (bus, sec) in totals().items():
        bus0, s0 = before.get(op, (0.0, 0.0))
        seconds = sec - s0
        expected_busbw[op] = (bus - bus0) / seconds if seconds > 0 else 0.0
    exported = {
        (
            fam,
            tuple(sorted((k, v) for k, v in sample.labels.items() if k not in labels)),
        ): sample.value
        for fam_obj in worker.metrics.registry.collect()
        for fam in [fam_obj.name]
        for sample in fam_obj.samples
    }
    engine.close()
    return {
        "large": (large.activations_peak, large.gathered_peak),
        "after": (after.activations_peak, after.gathered_peak),
        "exported_memory": {
            kind: exported[("zeroservice_memory_bytes", (("kind", kind),))]
            for kind in ("activations", "gathered")
        },
        "busbw": {
            op: exported[
                ("zeroservice_collective_busbw_bytes_per_second", (("group", "dp"), ("op", op)))
            ]
            for op in expected_busbw
        },
        "expected_busbw": expected_busbw,
        "peak": exported[("zeroservice_memory_bytes", (("kind", "peak"),))],
        "lifetime_peak": lifetime_peak,
        "tokens": exported[("zeroservice_tokens", ())],
        "tokens_per_step": worker._tokens_per_step(),
    }


def set_up_error(spec_json: str, root: str) -> str:
    """What a rank's set-up raises (its type and message), or "" when it builds."""
    try:
        worker = _worker(spec_json, root, restoring=False)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    assert worker.engine is not None
    worker.engine.close()
    return ""


def counters_through_a_regroup(spec_json: str, root: str) -> dict:
    """The collective counters a rank exports before, right after and one step after
    a live re-forming in the same process (its new engine's ledger starts at 0)."""
    import ray.util
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    ray.util.get_node_ip_address = lambda: "127.0.0.1"  # no Ray here: the node is loopback
    worker = RankWorker("job", dist.get_rank(), spec_json)
    worker.root, worker.use_cuda = root, False
    worker.topo = zeroservice.build_topology(1)
    worker._rendezvous = "local"
    worker._build(restoring=False)
    worker._ready(dist.get_world_size(), 0, "node", None, laps=Laps())

    def totals() -> dict[str, float]:
        assert worker.metrics is not None
        text = generate_latest(worker.metrics.registry).decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("zeroservice_collective_") and sample.name.endswith(
                    "_total"
                ):
                    out[sample.name] = out.get(sample.name, 0.0) + sample.value
        return out

    worker.train(3)
    before = totals()
    world, rank = dist.get_world_size(), dist.get_rank()
    port = worker.open_rendezvous("127.0.0.1") if rank == 0 else None
    ports = [None] * world
    dist.all_gather_object(ports, port)
    worker.regroup("127.0.0.1", ports[0], world, rank, root, 0, "node", False, 0)
    regrouped = totals()
    worker.train(4)
    after = totals()
    worker.close()
    return {"before": before, "regrouped": regrouped, "after": after}
