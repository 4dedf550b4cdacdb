"""The engine's parity and checkpoint scenarios on CUDA (skipped without a GPU).

The same scenarios as tests/engine and tests/checkpoint, with the models and batches on
the GPU (``ZEROSERVICE_TEST_DEVICE=cuda``, tests/engine/harness.py): one rank on NCCL,
and two ranks sharing the one GPU over gloo, which stages GPU tensors through the host
(NCCL refuses two ranks on one device). The reference is DDP on the same device.
"""

from __future__ import annotations

import pytest
import torch

from tests.checkpoint import scenarios as ck
from tests.checkpoint.states import assert_same_states, consolidated
from tests.engine import harness, scenarios
from tests.engine.scenarios import Spec
from tests.engine.test_leaf_modules import (
    assert_refused_without_leaves,
    assert_variants_follow_stage_0,
    train_variants,
    train_without_leaves,
)
from tests.engine.test_precision import (
    BF16_CASES,
    FP16_CASES,
    assert_follows_ddp,
    assert_fp16_follows_ddp,
    assert_overflow_skips,
    mixed_and_overflow,
)
from tests.gpu.cuda_scenarios import on_gpu, ring_refused
from zeroservice.launch import run_local

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ON_GPU = {harness.DEVICE_ENV: "cuda"}
ON_CPU = {harness.DEVICE_ENV: "cpu"}
STAGES = (0, 1, 2, 3)


def _run_on_gpu(fn, world: int, *args, backend: str = "nccl") -> list:
    """Each rank's result of ``fn(*args)`` run on the GPU; fails if any ran elsewhere."""
    ranks = run_local(on_gpu, world, fn, *args, env=ON_GPU, backend=backend)
    assert all(r["cuda_bytes"] > 0 for r in ranks), "a rank allocated nothing on the GPU"
    return [r["result"] for r in ranks]


@pytest.mark.parametrize(
    "world,backend,collectives",
    [(1, "nccl", "auto"), (2, "gloo", "native"), (2, "gloo", "auto")],
    ids=["nccl-1", "gloo-2-native", "gloo-2-auto"],
)
def test_fp32_stages_match_ddp_on_cuda(world, backend, collectives):
    specs = [Spec(stage=s, collectives=collectives) for s in STAGES]
    per_rank = _run_on_gpu(scenarios.parity, world, specs, backend=backend)
    for i, stage in enumerate(STAGES):
        r = harness.combine_ranks([rank[i] for rank in per_rank])
        try:
            harness.assert_matches_ddp(r)
        except AssertionError as exc:
            raise AssertionError(f"stage {stage}: {exc}") from exc


def test_the_ring_is_refused_for_gpu_tensors():
    """gloo's point-to-point sends read host memory ("writev: Bad address" on a GPU
    pointer): ``collectives="ring"`` is refused by name, and "auto" takes gloo's native
    ops for GPU tensors (the gloo-2-auto case above)."""
    (message,) = _run_on_gpu(ring_refused, 1, backend="gloo")
    assert message.startswith("collectives: 'ring' is refused for a model on cuda"), message


@pytest.mark.parametrize("world,backend", [(1, "nccl"), (2, "gloo")], ids=["nccl-1", "gloo-2"])
def test_bf16_and_fp16_follow_ddp_on_cuda(world, backend):
    """bf16 at stages 0-3 and fp16 with loss scaling (an overflowing scale among them)
    against DDP under CUDA autocast and GradScaler; an overflow skips the step."""
    results = _run_on_gpu(mixed_and_overflow, world, backend=backend)
    for i, case in enumerate(BF16_CASES):
        try:
            assert_follows_ddp([r[0][i] for r in results], "bf16")
        except AssertionError as exc:
            raise AssertionError(f"bf16 {case}: {exc}") from exc
    for i, (stage, scale) in enumerate(FP16_CASES):
        try:
            assert_fp16_follows_ddp([r[1][i] for r in results], scale)
        except AssertionError as exc:
            raise AssertionError(f"fp16 stage {stage} {scale}: {exc}") from exc
    assert_overflow_skips([r[2] for r in results])


def test_leaf_modules_on_cuda():
    """Stage 3 with leaf modules, two ranks whose tokens pick different experts: the
    variants of tests/engine/test_leaf_modules.py (both groupings, checkpointing, no
    prefetch) train to stage 0's losses and weights on the GPU."""
    assert_variants_follow_stage_0(_run_on_gpu(train_variants, 2, backend="gloo"))


def test_divergent_reads_are_refused_on_cuda():
    """Without the leaf named, the forward's read consensus (its counts on the GPU, over
    gloo) refuses the divergent steps on both ranks with the same message."""
    config = {
        "stage": 3,
        "bucket_elements": 1024,
        "stage3_persistence_elements": 0,
        "stage3_check_gathers": False,
    }
    assert_refused_without_leaves(_run_on_gpu(train_without_leaves, 2, config, backend="gloo"))


@pytest.mark.parametrize("stage", STAGES)
def test_exact_resume_on_cuda(tmp_path, stage):
    r = _run_on_gpu(ck.exact_resume, 1, Spec(stage=stage, steps=6), str(tmp_path), 3)[0]
    assert r["step"] == 3
    assert r["resumed"] == r["straight"]


def _newest(root) -> str:
    return str(sorted(p for p in root.iterdir() if p.is_dir())[-1])


def test_a_cuda_checkpoint_reshards_onto_cpus_and_back(tmp_path):
    """Saved on the GPU at N_d = 1 (stage 2), loaded on two CPU ranks at stage 3 and
    saved again, loaded back on the GPU at stage 1 and saved again: every master and
    optimizer state is bit-identical to the first save, and training goes on."""
    gpu, cpu, back = tmp_path / "gpu", tmp_path / "cpu", tmp_path / "back"
    _run_on_gpu(ck.train_and_save, 1, Spec(stage=2), str(gpu), 3)
    on_cpu = run_local(
        ck.load_and_continue, 2, Spec(stage=3), _newest(gpu), 2, str(cpu), env=ON_CPU
    )[0]
    back_on_gpu = _run_on_gpu(ck.load_and_continue, 1, Spec(stage=1), _newest(cpu), 2, str(back))[0]
    same_on_cpu = run_local(ck.load_and_continue, 1, Spec(stage=1), _newest(cpu), 2, env=ON_CPU)[0]
    assert on_cpu["step"] == back_on_gpu["step"] == 3
    first = consolidated(_newest(gpu))
    for other in (_newest(cpu), _newest(back)):
        assert_same_states(first, consolidated(other))
    # The same two steps after the load, on one CPU rank and on the GPU: the same
    # losses to float rounding (other kernels, so not bit for bit).
    torch.testing.assert_close(
        torch.tensor(back_on_gpu["losses"]), torch.tensor(same_on_cpu["losses"]), rtol=1e-4, atol=0
    )
