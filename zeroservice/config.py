"""Typed, validated engine configuration.

Every field is checked in ``__post_init__`` so that a config that makes no sense fails
at construction with a message naming the field, never later inside a collective.
The control plane accepts the same fields (it builds these dataclasses from its
pydantic job spec).
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

Precision = Literal["fp32", "bf16", "fp16"]
ReduceDtype = Literal["param", "fp32"]
ScheduleKind = Literal["constant", "cosine", "linear"]
Collectives = Literal["auto", "native", "ring", "shm"]
Grouping = Literal["blocks", "size"]
Redundancy = Literal["none", "host-copy"]
GradientQuantization = Literal["none", "int8", "int4"]

PRECISIONS = ("fp32", "bf16", "fp16")


KNOWN_MOE_LEAVES = (
    "MixtralSparseMoeBlock",
    "Qwen2MoeSparseMoeBlock",
    "Qwen3MoeSparseMoeBlock",
    "DeepseekV3MoE",
    "OlmoeSparseMoeBlock",
    "PhimoeSparseMoeBlock",
)
"""transformers' Mixture-of-Experts layers (their experts a ModuleList, each called only
for the tokens routed to it), the default of ``stage3_leaf_modules``: each trains at
stage 3 as a leaf to data parallelism's losses (5e-8; docs/configuration.md). A model
without them is not affected, and none of them is refused for being absent."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{field_name}: {message}")


MAX_COUNT = 2**53
"""The largest integer a field takes (steps, elements, intervals): beyond it a count
is no longer exact as a JSON number, and no run comes near it."""

MIN_BUCKET_ELEMENTS = 1024
"""The smallest ``bucket_elements`` (C_B) the engine takes; the planner refuses what the
engine refuses."""


def _shown(value: Any) -> str:
    """``value`` for a message, cut short (a 300-digit integer names nothing)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_types(config: Any, prefix: str = "") -> None:
    """Each field's value against its annotation (bool, int, float, str literal, None,
    a nested config), before any comparison: a string where a number belongs must be
    named, not raise a TypeError (or pass) deep inside a check or a run."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value, hint = getattr(config, f.name), hints[f.name]
        options = typing.get_args(hint) if type(hint) is types.UnionType else (hint,)
        if value is None and type(None) in options:
            continue
        kind = next(o for o in options if o is not type(None))
        name = prefix + f.name
        if kind is bool:
            _require(isinstance(value, bool), name, "must be true or false")
        elif kind is int:
            _require(
                _is_int(value) and abs(value) <= MAX_COUNT,
                name,
                f"{_shown(value)} must be an integer (at most 2**53)",
            )
        elif kind is float:
            _require(
                (_is_int(value) and abs(value) <= MAX_COUNT)
                or (isinstance(value, float) and math.isfinite(value)),
                name,
                f"{_shown(value)} must be a finite number",
            )
        elif typing.get_origin(kind) is Literal:
            _require(
                isinstance(value, str) and value in typing.get_args(kind),
                name,
                f"{_shown(value)} is not one of {', '.join(map(repr, typing.get_args(kind)))}",
            )


def _sub_config(cls: type, value: Any, name: str) -> Any:
    """A nested config from plain data, unknown keys refused by name."""
    if isinstance(value, cls):
        return value
    _require(isinstance(value, dict), name, f"{_shown(value)} must be an object of its fields")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in set(value) - known)
    _require(not unknown, name, f"unknown field(s) {', '.join(unknown)}")
    return cls(**value)


def check_collectives(collectives: str, backend: str, device_type: str = "cpu") -> None:
    """Refuse ``collectives="ring"`` and ``"shm"`` on NCCL, and for GPU tensors.

    The ring runs point-to-point sends on a background thread beside the main stream;
    on NCCL that thread's kernels race the compute stream and the backend's own
    reduce-scatter/all-gather are already fast, so there is nothing to gain. Shared
    memory holds host tensors; NCCL's are on the GPU.
    """
    _require(
        not (collectives == "ring" and backend == "nccl"),
        "collectives",
        "'ring' is refused on the nccl backend (point-to-point sends on a background "
        "thread beside the main stream); use 'auto' or 'native'",
    )
    _require(
        not (collectives == "shm" and backend == "nccl"),
        "collectives",
        "'shm' is refused on the nccl backend (shared memory holds host tensors, NCCL's "
        "are on the GPU); use 'auto' or 'native'",
    )
    _require(
        not (collectives in ("ring", "shm") and device_type != "cpu"),
        "collectives",
        f"{collectives!r} is refused for a model on {device_type} (the ring's point-to-point "
        "sends on gloo and the shared segments take host memory); use 'auto' or 'native'",
    )


@dataclass
class LossScaleConfig:
    """Dynamic loss scaling for fp16 (ignored by fp32 and bf16)."""

    initial_scale: float = 2.0**16
    """Scale applied to the loss before the first step."""
    growth_interval: int = 1000
    """Consecutive steps without overflow after which the scale doubles."""
    backoff_factor: float = 0.5
    """Factor applied to the scale on an overflow."""
    growth_factor: float = 2.0
    """Factor applied to the scale after ``growth_interval`` clean steps."""
    min_scale: float = 1.0
    """The scale never drops below this value."""
    hysteresis: int = 1
    """Overflows tolerated before the scale first backs off (the step is skipped every
    time); after that every overflow backs off until the scale next grows."""
    consecutive_hysteresis: bool = False
    """Restore the allowance after every step without overflow, so only consecutive
    overflows back off (DeepSpeed's ``consecutive_hysteresis``)."""

    def __post_init__(self) -> None:
        _check_types(self, "loss_scale.")
        _require(self.initial_scale > 0, "loss_scale.initial_scale", "must be > 0")
        _require(self.growth_interval >= 1, "loss_scale.growth_interval", "must be >= 1")
        _require(0 < self.backoff_factor < 1, "loss_scale.backoff_factor", "must be in (0, 1)")
        _require(self.growth_factor > 1, "loss_scale.growth_factor", "must be > 1")
        _require(self.min_scale > 0, "loss_scale.min_scale", "must be > 0")
        _require(
            self.min_scale <= self.initial_scale,
            "loss_scale.min_scale",
            f"{self.min_scale} exceeds initial_scale {self.initial_scale}",
        )
        _require(self.hysteresis >= 1, "loss_scale.hysteresis", "must be >= 1")


@dataclass
class ScheduleConfig:
    """Learning-rate schedule: linear warm-up, then constant, cosine or linear decay.

    The factor multiplies each optimizer group's initial learning rate; steps skipped
    on an fp16 overflow do not advance it.
    """

    kind: ScheduleKind = "constant"
    warmup_steps: int = 0
    """Steps of linear warm-up from ``warmup_start_ratio`` to 1."""
    total_steps: int | None = None
    """Step at which decay ends (required for cosine and linear)."""
    min_ratio: float = 0.0
    """Floor of the decay, as a fraction of the base learning rate."""
    warmup_start_ratio: float = 0.0

    def __post_init__(self) -> None:
        _check_types(self, "lr_schedule.")
        _require(
            self.kind in ("constant", "cosine", "linear"),
            "lr_schedule.kind",
            f"unknown schedule {self.kind!r}; choose constant, cosine or linear",
        )
        _require(self.warmup_steps >= 0, "lr_schedule.warmup_steps", "must be >= 0")
        _require(0 <= self.min_ratio <= 1, "lr_schedule.min_ratio", "must be in [0, 1]")
        _require(
            0 <= self.warmup_start_ratio <= 1,
            "lr_schedule.warmup_start_ratio",
            "must be in [0, 1]",
        )
        if self.kind != "constant":
            _require(
                self.total_steps is not None,
                "lr_schedule.total_steps",
                f"required by the {self.kind} schedule",
            )
        if self.total_steps is not None:
            _require(
                self.total_steps > self.warmup_steps,
                "lr_schedule.total_steps",
                f"{self.total_steps} must exceed warmup_steps {self.warmup_steps}",
            )


@dataclass
class ZeroConfig:
    """What the engine partitions, in which precision, and how it communicates."""

    stage: int = 2
    """0: plain data parallel; 1: optimizer states partitioned (P_os);
    2: gradients too (P_os+g); 3: parameters too (P_os+g+p)."""
    precision: Precision = "fp32"
    """fp32; bf16 (bf16 params/grads, fp32 master and optimizer states); fp16 (the same
    with dynamic loss scaling)."""
    reduce_dtype: ReduceDtype = "param"
    """dtype of gradient reduction: the parameters' dtype, or fp32 (costs 2x bytes in
    bf16/fp16, gains accuracy)."""
    bucket_elements: int | None = None
    """Constant size of the fused communication buffers and of parameter units, in
    elements (the paper's C_B), rounded up to a multiple of the data-parallel world.
    A single parameter larger than this forms a unit of its own; its gradient is
    reduced in pieces of at most this size, so no staging buffer (nor the ring's
    receive scratch) grows with the model. None (the default): 2^23, capped at
    Psi (1 - 1/N_d) / 2 so that no stage holds more than the stage below it (see [Note:
    stage order] in units.py); a number is used as given."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; ``engine.step()`` is called after each one."""
    gradient_clipping: float = 0.0
    """Max global gradient norm (0 disables clipping)."""
    overlap_comm: bool = True
    """Launch gradient reductions from backward hooks while backward continues."""
    collectives: Collectives = "auto"
    """How reduce-scatter and all-gather run: "native" (the backend's own ops), "ring"
    (point-to-point rings on a background thread), "shm" (these two and all-reduce
    through shared memory; every rank of the data-parallel group on one host, CPU
    tensors: see [Note: shared-memory collectives] in shm.py), or "auto": rings on
    gloo, whose own ops are slow, native elsewhere (NCCL)."""
    broadcast_buffers: bool = True
    """Before every forward, copy the module's buffers (BatchNorm running statistics)
    from rank 0 to every rank, as DDP does by default: ranks then agree on them and a
    run matches DDP's. False keeps each rank's own buffers (one broadcast fewer per
    forward; right for models whose buffers are constants)."""
    trim_host_memory: bool = False
    """On a CPU, hand the heap pages malloc holds free back to the system before each
    forward and backward and after each unit's backward (glibc's ``malloc_trim``, when
    the heaps hold at least 64 MiB free): under glibc's default settings the resident
    size then follows the live tensors rather than everything a pass freed, at the cost
    of faulting the pages in again. Off by default: on the 106M GPT at stage 3 it cuts
    the peak by a sixth for 6-9% of step time, on a 7.4M GPT it costs 23-28%. See [Note:
    host heap trimming] in host_memory.py."""
    fuse_optimizer: bool = True
    """When the factory returns torch's Adam or AdamW with neither ``foreach`` nor
    ``fused`` chosen, rebuild it with ``fused=True``: one pass over each flat shard
    instead of seven (the same update, to float rounding). An explicit choice is kept."""
    stage3_grouping: Grouping = "blocks"
    """Stage 3: which modules gather their parameters as one group. "blocks": every
    item of an nn.ModuleList (the transformer blocks) and each module beside the lists
    (embeddings, head) unless it shares a parameter elsewhere (then: the root module);
    "size": the largest modules of at most ``bucket_elements`` parameters, so that
    gather buffers stay constant as the model grows. Models without a ModuleList fall
    back to "size"."""
    stage3_leaf_modules: list[str] = field(default_factory=lambda: list(KNOWN_MOE_LEAVES))
    """Stage 3: modules (by class name, e.g. "MixtralSparseMoeBlock", or by qualified
    name) each gathered as one group whose backward gathers and reduces all of its
    parameters together, whichever this rank's forward used: a Mixture-of-Experts
    layer, whose router sends each rank's tokens to different experts, then trains as
    at stage 0. A name that matches no module is refused at ``initialize``, except the
    default's, transformers' MoE layers (``KNOWN_MOE_LEAVES``), which a list
    given replaces and ``[]`` turns off. See [Note: leaf modules] in leaf_modules.py."""
    stage3_prefetch_elements: int | None = None
    """Stage 3: budget of gathered (live) parameter elements, counting in-flight
    gathers; the next groups, in the recorded order, are gathered ahead of use only
    while they fit. The group in use is always gathered, so the peak is at most this
    budget plus one group. None (the default): 2^25 (32 Mi elements: 128 MiB in fp32,
    64 MiB in bf16; it holds the root's parameters and a few blocks of models up to a
    few billion parameters), capped like ``bucket_elements``; a number is used as
    given: raise it for wider models, lower it to save memory."""
    stage3_persistence_elements: int | None = None
    """Stage 3: a unit of at most this many elements stays gathered between steps (one
    all-gather per step instead of two). None (the default): 2^16 (64 Ki elements, 128
    KiB in bf16: such a unit's gather is latency-bound, so keeping it costs little
    memory and saves two collective launches per step), with all persistent units
    together capped like ``bucket_elements``; a number is used as given."""
    stage3_check_gathers: bool = field(
        default_factory=lambda: os.environ.get("ZEROSERVICE_CHECK_GATHERS", "") == "1"
    )
    """Stage 3 debug mode: before each gather, every rank confirms (one small all-reduce
    on a group of its own) that all ranks gather the same unit, and raises naming each
    rank's unit when they do not (rank-divergent control flow would otherwise hand a
    rank another unit's shard of the same size). Off by default (one extra collective
    per gather); ``ZEROSERVICE_CHECK_GATHERS=1`` turns it on (the test suite does).
    Without it a divergence is still refused, at the step, naming no unit (see
    [Note: rank-divergent control flow] in gather_check.py)."""
    activation_checkpointing: bool = False
    """Checkpoint every item of every nn.ModuleList (the transformer blocks): forward
    keeps only each block's input and backward recomputes the block."""
    partition_activations: bool = False
    """With activation checkpointing and model parallelism (P_a): each MP rank keeps
    1/mp of a block's (replicated) input and all-gathers it before recomputation."""
    cpu_offload_activations: bool = False
    """With activation checkpointing (P_a+cpu): checkpoints live in host memory
    (pinned on CUDA) and come back to the device for recomputation."""
    contiguous_activations: bool = True
    """With activation checkpointing (M_D): checkpoints are copied into one
    pre-allocated arena instead of being allocated one by one."""
    offload_optimizer: bool = False
    """ZeRO-Offload: fp32 master weights and optimizer states live in host memory and
    the optimizer step runs on the host; gradients go down, parameters come back."""
    redundancy: Redundancy = "none"
    """"host-copy": after every ``redundancy_interval``-th optimizer step each rank keeps a
    host-memory copy of what it would checkpoint and of its ring neighbour's (rank r holds
    r's and r+1's), so that survivors of a lost rank restore from peers
    (``Engine.restore_from_peers``) without reading a file. "none": no copy."""
    redundancy_interval: int = 1
    """K: the host copy is refreshed after every K-th optimizer step (at most K steps of
    work are lost on a recovery from peers)."""
    quantized_weights: bool = False
    """ZeRO++ qwZ (stage 3): each rank quantizes its parameter shard to int8 in blocks
    of ``quantization_block`` elements with an fp32 scale each before the all-gather,
    and every rank, its own chunk included, dequantizes what arrives, so all ranks
    compute with the same weights. Shards and masters stay full precision (see
    [Note: block quantization] in quantize.py)."""
    quantized_gradients: GradientQuantization = "none"
    """ZeRO++ qgZ (stages 1-3): "int8" or "int4" replaces the gradient reduce-scatter by
    an all-to-all of quantized slices; each rank dequantizes what it receives and sums
    in fp32. With ``ranks_per_node`` set it goes in two hops (within the node, then
    across nodes), quantizing once per hop. "none": the plain reduce-scatter."""
    hierarchical_partition: bool = False
    """ZeRO++ hpZ (stage 3, needs ``ranks_per_node``): after a unit's forward gather each
    rank keeps a secondary shard, its 1/ranks_per_node slice of the whole unit, so the
    backward gather runs only among the ranks of its node."""
    ranks_per_node: int | None = None
    """Ranks of the data-parallel group per node (consecutive ranks share a node). It
    splits the communication ledger's bytes into intra-node and cross-node, and is the
    topology of hpZ and of two-hop qgZ. None: all ranks on one node."""
    quantization_block: int = 256
    """Elements per quantization block (one fp32 scale each) for qwZ and qgZ."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    lr_schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train_micro_batch_size: int | None = None
    """Samples per rank per micro-batch; used by launchers and data loaders, not the engine."""

    def __post_init__(self) -> None:
        self.loss_scale = _sub_config(LossScaleConfig, self.loss_scale, "loss_scale")
        self.lr_schedule = _sub_config(ScheduleConfig, self.lr_schedule, "lr_schedule")
        _check_types(self)
        _require(
            isinstance(self.stage, int)
            and not isinstance(self.stage, bool)
            and self.stage in (0, 1, 2, 3),
            "stage",
            f"{self.stage!r} is not a supported ZeRO stage (0, 1, 2 or 3)",
        )
        _require(
            self.stage3_grouping in ("blocks", "size"),
            "stage3_grouping",
            f"{self.stage3_grouping!r} is not 'blocks' or 'size'",
        )
        leaves = self.stage3_leaf_modules
        _require(
            isinstance(leaves, (list, tuple))
            and all(isinstance(x, str) and x.strip() for x in leaves),
            "stage3_leaf_modules",
            f"{_shown(leaves)} must be a list of module class names or qualified names",
        )
        self.stage3_leaf_modules = list(leaves)
        for name in ("stage3_prefetch_elements", "stage3_persistence_elements"):
            value = getattr(self, name)
            _require(
                value is None or (_is_int(value) and value >= 0),
                name,
                f"{value!r} must be an integer >= 0 (or null: the default)",
            )
        _require(
            self.precision in PRECISIONS,
            "precision",
            f"{self.precision!r} is not one of {', '.join(PRECISIONS)}",
        )
        _require(
            self.reduce_dtype in ("param", "fp32"),
            "reduce_dtype",
            f"{self.reduce_dtype!r} is not 'param' or 'fp32'",
        )
        _require(
            self.bucket_elements is None
            or (_is_int(self.bucket_elements) and self.bucket_elements >= MIN_BUCKET_ELEMENTS),
            "bucket_elements",
            f"{self.bucket_elements!r} must be an integer >= {MIN_BUCKET_ELEMENTS} "
            "(or null: the default)",
        )
        _require(
            isinstance(self.gradient_accumulation_steps, int)
            and self.gradient_accumulation_steps >= 1,
            "gradient_accumulation_steps",
            f"{self.gradient_accumulation_steps!r} must be an integer >= 1",
        )
        _require(
            self.collectives in ("auto", "native", "ring", "shm"),
            "collectives",
            f"{self.collectives!r} is not 'auto', 'native', 'ring' or 'shm'",
        )
        for name in (
            "activation_checkpointing",
            "partition_activations",
            "cpu_offload_activations",
            "contiguous_activations",
            "offload_optimizer",
            "broadcast_buffers",
            "trim_host_memory",
        ):
            _require(isinstance(getattr(self, name), bool), name, "must be true or false")
        for name in ("partition_activations", "cpu_offload_activations"):
            _require(
                not getattr(self, name) or self.activation_checkpointing,
                name,
                "needs activation_checkpointing = true",
            )
        _require(
            self.redundancy in ("none", "host-copy"),
            "redundancy",
            f"{self.redundancy!r} is not 'none' or 'host-copy'",
        )
        _require(
            _is_int(self.redundancy_interval) and self.redundancy_interval >= 1,
            "redundancy_interval",
            f"{self.redundancy_interval!r} must be an integer >= 1",
        )
        self._check_zeropp()
        _require(self.gradient_clipping >= 0, "gradient_clipping", "must be >= 0 (0 disables)")
        if self.train_micro_batch_size is not None:
            _require(self.train_micro_batch_size >= 1, "train_micro_batch_size", "must be >= 1")

    def _check_zeropp(self) -> None:
        for name in ("quantized_weights", "hierarchical_partition"):
            _require(isinstance(getattr(self, name), bool), name, "must be true or false")
            _require(
                not getattr(self, name) or self.stage == 3,
                name,
                f"needs stage 3 (parameters are gathered only there); stage is {self.stage}",
            )
        _require(
            self.quantized_gradients in ("none", "int8", "int4"),
            "quantized_gradients",
            f"{self.quantized_gradients!r} is not 'none', 'int8' or 'int4'",
        )
        _require(
            self.quantized_gradients == "none" or self.stage >= 1,
            "quantized_gradients",
            "needs stage 1, 2 or 3 (stage 0 all-reduces gradients, there is no "
            "reduce-scatter to replace)",
        )
        _require(
            self.ranks_per_node is None
            or (_is_int(self.ranks_per_node) and self.ranks_per_node >= 1),
            "ranks_per_node",
            f"{self.ranks_per_node!r} must be an integer >= 1 (or null: one node)",
        )
        _require(
            not self.hierarchical_partition or self.ranks_per_node is not None,
            "hierarchical_partition",
            "needs ranks_per_node (the secondary shard is partitioned within a node)",
        )
        _require(
            _is_int(self.quantization_block)
            and self.quantization_block >= 8
            and self.quantization_block % 8 == 0,
            "quantization_block",
            f"{self.quantization_block!r} must be a multiple of 8, at least 8",
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ZeroConfig:
        """Build from plain data (JSON, YAML, a REST body); unknown keys are refused by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{', '.join(unknown)}: unknown ZeroConfig field(s)")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
