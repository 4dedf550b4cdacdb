"""Bytes per rank before anything runs: ZeRO's memory arithmetic, and a recommender.

[Note: memory plan]
Model states use the per-parameter bytes of memory.py (see [Note: model-state bytes]):
p = g = 2 (bf16/fp16) or 4 (fp32), m = 4 in mixed precision and 0 in fp32, k the
optimizer's bytes (Adam: 8), with Ψ the parameters held by one model-parallel rank:

    stage 0:  (p + g + m + k) Ψ
    stage 1:  (p + g) Ψ + (m + k) Ψ / N_d
    stage 2:   p Ψ + (g + m + k) Ψ / N_d
    stage 3:  (p + g + m + k) Ψ / N_d

Beside them: activations (``activation_bytes``), two gradient staging buffers at
stages 2 and 3, and at stage 3 the parameters gathered for the running layer and the
one prefetched after it. ZeRO++ (zeropp.py) adds hpZ's secondary shards, Ψ / L of
parameter bytes kept from forward to backward (L = ``ranks_per_node``), and the
quantized send and receive rows: qwZ's of the gathered parameters (int8 and a scale per
block), qgZ's of two buffers of C_B in flight (one hop: each sent and received whole;
two hops: one in its first hop, L rows of C_B / L, the other in its second, N_d / L rows
of C_B / N_d); both at once, except with hpZ, whose backward gathers are not quantized
(``MemoryPlan.secondary_params`` and ``quantization_scratch``). ``offload_optimizer``
moves master weights and optimizer states to host memory; ``cpu_offload_activations``
moves activation checkpoints there.

This module is arithmetic only: planning a 1T-parameter model allocates nothing (a
module passed in is only inspected, its shards laid out on the meta device).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .config import KNOWN_MOE_LEAVES, MIN_BUCKET_ELEMENTS, ConfigError
from .memory import PARAM_BYTES, model_state_kinds
from .quantize import BITS, packed_bytes

if TYPE_CHECKING:
    from torch import nn

    from .models.gpt import GPTConfig
    from .units import Layout

PAPER_PSI = (7_500_000_000, 128_000_000_000, 1_000_000_000_000)
PAPER_N_D = (1, 4, 16, 64, 256, 1024)


class PlanError(ValueError):
    """An input the planner cannot use; the message starts with the field's name."""


@dataclass(frozen=True)
class ModelSpec:
    """A model by its parameter count Ψ, with its shape where known.

    The shape (layers, dim, heads, seq_len, vocab) feeds activation estimates and
    model-parallel traffic. ``gpt``: the reference GPT's config, whose tensor-parallel
    layout is known exactly (``gpt_params_per_mp_rank``); a plain count is assumed to
    shard entirely over model-parallel ranks (Ψ / N_m).
    """

    params: int
    layers: int | None = None
    dim: int | None = None
    heads: int | None = None
    seq_len: int | None = None
    vocab: int | None = None
    gpt: GPTConfig | None = None

    def __post_init__(self) -> None:
        _check_int("params", self.params, 1)
        for name in ("layers", "dim", "heads", "seq_len", "vocab"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        if self.dim is not None and self.heads is not None and self.dim % self.heads:
            raise PlanError(f"dim: {self.dim} is not divisible by heads {self.heads}")

    def params_per_mp_rank(self, mp: int) -> int:
        if self.gpt is not None:
            return gpt_params_per_mp_rank(self.gpt, mp)
        return -(-self.params // mp)


def describe(model: int | float | ModelSpec | GPTConfig) -> ModelSpec:
    """A parameter count, a ModelSpec or the reference GPT's config, as a ModelSpec."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, int | float) and not isinstance(model, bool):
        if model != model or model in (float("inf"), float("-inf")) or model < 1:
            raise PlanError(f"params: must be a count >= 1, got {model}")
        return ModelSpec(round(model))
    # An instance of GPTConfig exists only once its module is imported: no torch here.
    gpt = sys.modules.get("zeroservice.models.gpt")
    if gpt is not None and isinstance(model, gpt.GPTConfig):
        return ModelSpec(
            model.num_params(),
            layers=model.n_layer,
            dim=model.dim,
            heads=model.n_head,
            seq_len=model.seq_len,
            vocab=model.vocab_size,
            gpt=model,
        )
    raise PlanError(
        f"model: expected a parameter count, a ModelSpec or a GPTConfig, got {type(model).__name__}"
    )


def gpt_params_per_mp_rank(cfg: GPTConfig, mp: int) -> int:
    """Parameters one tensor-parallel rank holds of the reference GPT (Megatron layout).

    Sharded over ``mp``: wte and an untied head (vocab rows), each block's attn.qkv
    (weight and bias), attn.proj weight, mlp.fc (weight and bias) and mlp.proj weight.
    Replicated: wpe, the layer norms, attn.proj and mlp.proj biases.
    """
    _check_int("mp", mp, 1)
    if cfg.n_head % mp:
        raise PlanError(f"mp: {mp} does not divide the model's heads ({cfg.n_head})")
    if cfg.vocab_size % mp:
        raise PlanError(f"mp: {mp} does not divide the model's vocab ({cfg.vocab_size})")
    d, v, f = cfg.dim, cfg.vocab_size, cfg.dim * cfg.mlp_ratio
    b = 1 if cfg.bias else 0
    block_sharded = (3 * d * d + 3 * d * b) + d * d + (d * f + f * b) + f * d
    block_replicated = 2 * 2 * d + d * b + d * b
    sharded = v * d * (1 if cfg.tie_weights else 2) + cfg.n_layer * block_sharded
    replicated = cfg.seq_len * d + cfg.n_layer * block_replicated + 2 * d
    return sharded // mp + replicated


@dataclass(frozen=True)
class MemoryPlan:
    """Expected bytes per rank, by kind. See [Note: memory plan]."""

    stage: int
    precision: str
    dp: int
    mp: int
    psi: int
    """Parameters of the whole model."""
    psi_local: int
    """Parameters one model-parallel rank holds (the Ψ of the formula)."""
    params: int
    grads: int
    master: int
    optimizer_states: int
    model_states: int
    """params + grads + master + optimizer_states: memory.py's formula to the byte."""
    activations: int
    """Activations kept on the device for one micro-batch (0 without ``micro_batch``)."""
    activations_offloaded: int
    """Activation checkpoints moved to host memory (``cpu_offload_activations``)."""
    comm_buffers: int
    gathered_params: int
    """Stage 3: the running layer's gathered parameters and the next one's."""
    device_total: int
    host_total: int
    redundancy_host: int = 0
    """``redundancy="host-copy"``: host copies of the fp32 masters and optimizer states,
    this rank's and its ring neighbour's (one whole copy at stage 0; none with N_d = 1):
    within 1% of the ledger's ``redundancy_host``, which adds the frozen shards, the
    buffers and each item's 8-byte alignment. Counted in ``host_total``."""
    redundancy_spare: int = 0
    """The previous copies' buffers, kept for the next refresh to write into (as many
    bytes as ``redundancy_host``; the ledger's ``redundancy_spare`` from the second
    copy on): a refresh holds both sets at once. Counted in ``host_total``."""
    secondary_params: int = 0
    """hpZ: the secondary shards, Ψ / ``ranks_per_node`` parameter bytes, held from the
    end of forward until backward ends (the ledger's ``secondary_peak``, which counts
    padded units). Counted in ``device_total``."""
    quantization_scratch: int = 0
    """qwZ / qgZ: the quantized rows in flight (the ledger's
    ``quantization_scratch_peak``). Counted in ``device_total``."""

    def as_dict(self) -> dict[str, int | str]:
        return asdict(self)


def plan(
    model: int | float | ModelSpec | GPTConfig,
    *,
    dp: int,
    mp: int = 1,
    stage: int,
    precision: str = "bf16",
    optimizer_bytes: int = 8,
    offload_optimizer: bool = False,
    activation_checkpointing: bool = False,
    partition_activations: bool = False,
    cpu_offload_activations: bool = False,
    seq_len: int | None = None,
    micro_batch: int | None = None,
    bucket_elements: int | None = None,
    redundancy: str = "none",
    quantized_weights: bool = False,
    quantized_gradients: str = "none",
    hierarchical_partition: bool = False,
    ranks_per_node: int | None = None,
    quantization_block: int = 256,
) -> MemoryPlan:
    """Bytes per rank of a ZeRO configuration, by kind. See [Note: memory plan]."""
    spec = describe(model)
    if redundancy not in ("none", "host-copy"):
        raise PlanError(f"redundancy: {redundancy!r} is not 'none' or 'host-copy'")
    _check_int("dp", dp, 1)
    _check_int("mp", mp, 1)
    _check_stage(stage)
    _check_precision(precision)
    for name, value in (
        ("offload_optimizer", offload_optimizer),
        ("activation_checkpointing", activation_checkpointing),
        ("partition_activations", partition_activations),
        ("cpu_offload_activations", cpu_offload_activations),
        ("quantized_weights", quantized_weights),
        ("hierarchical_partition", hierarchical_partition),
    ):
        _check_bool(name, value)
    _check_zeropp(
        stage,
        dp,
        quantized_weights,
        quantized_gradients,
        hierarchical_partition,
        ranks_per_node,
        quantization_block,
    )
    _check_int("optimizer_bytes", optimizer_bytes, 0)
    if bucket_elements is not None:
        _check_int("bucket_elements", bucket_elements, MIN_BUCKET_ELEMENTS)
    _check_mp(spec, mp)
    for name, on in (
        ("partition_activations", partition_activations),
        ("cpu_offload_activations", cpu_offload_activations),
    ):
        if on and not activation_checkpointing:
            raise PlanError(
                f"{name}: applies to activation checkpoints; set activation_checkpointing"
            )
    psi_local = spec.params_per_mp_rank(mp)
    params, grads, master, opt = model_state_kinds(
        stage, precision, psi_local, dp, optimizer_bytes, offload_optimizer
    )
    acts, acts_host = activation_bytes(
        spec,
        mp=mp,
        precision=precision,
        seq_len=seq_len,
        micro_batch=micro_batch,
        checkpointing=activation_checkpointing,
        partition=partition_activations,
        cpu_offload=cpu_offload_activations,
    )
    p = PARAM_BYTES[precision]
    # Staging buffers hold C_B, capped so stage 2 stays below stage 1 (units.py).
    from .units import budgets

    c_b = budgets(psi_local, dp, bucket_elements).unit_elements
    comm = 2 * min(c_b, psi_local) * p if stage >= 2 else 0
    gathered = 0
    if stage == 3:
        per_layer = psi_local // spec.layers if spec.layers else c_b
        gathered = min(psi_local, 2 * per_layer) * p
    secondary = 0
    if hierarchical_partition and ranks_per_node is not None:  # checked: hpZ names L
        secondary = -(-psi_local // ranks_per_node) * p
    weight_rows = gradient_rows = 0
    if quantized_weights:
        weight_rows = qwz_scratch(gathered // p, dp, quantization_block)
    if quantized_gradients != "none":
        bits = BITS[quantized_gradients]
        gradient_rows = qgz_scratch(
            min(c_b, psi_local), dp, bits, quantization_block, ranks_per_node
        )
    # With hpZ, backward gathers come from the secondary shards, unquantized: qwZ's rows
    # live in forward only and qgZ's in backward only.
    if hierarchical_partition:
        scratch = max(weight_rows, gradient_rows)
    else:
        scratch = weight_rows + gradient_rows
    # Offloaded: the master and optimizer states, and the fp32 gradient shard the
    # reduced gradients are copied into for the host step.
    shard = psi_local if stage == 0 else -(-psi_local // dp)
    moved = master + opt if offload_optimizer else 0
    host_states = moved + 4 * shard if offload_optimizer else 0
    model_states = params + grads + master + opt
    copies = 0 if dp == 1 else 1 if stage == 0 else 2
    held = copies * (4 + optimizer_bytes) * shard if redundancy == "host-copy" else 0
    return MemoryPlan(
        stage=stage,
        precision=precision,
        dp=dp,
        mp=mp,
        psi=spec.params,
        psi_local=psi_local,
        params=params,
        grads=grads,
        master=master,
        optimizer_states=opt,
        model_states=model_states,
        activations=acts,
        activations_offloaded=acts_host,
        comm_buffers=comm,
        gathered_params=gathered,
        device_total=model_states - moved + acts + comm + gathered + secondary + scratch,
        host_total=host_states + acts_host + 2 * held,
        redundancy_host=held,
        redundancy_spare=held,
        secondary_params=secondary,
        quantization_scratch=scratch,
    )


def qwz_scratch(gathered: int, dp: int, block: int) -> int:
    """qwZ's int8 rows of ``gathered`` elements in flight: N_d shards each, a scale per
    block (the ledger counts each unit's shards, rounded up to whole blocks apiece). A
    shard cut where a parameter begins adds at most one block per cut (zeropp.py), not
    counted here."""
    return dp * packed_bytes(-(-gathered // dp), 8, block)


def qgz_scratch(bucket: int, dp: int, bits: int, block: int, ranks_per_node: int | None) -> int:
    """qgZ's quantized rows of two buffers of ``bucket`` elements reduced at once (the
    engine's two staging buffers). One hop: each sends and receives N_d rows of
    bucket / N_d. Two hops: the first hop is waited for at launch, so at most one buffer
    is in it (L rows of bucket / L, sent and received) while the other is in its second
    (N_d / L rows of bucket / N_d)."""
    width = -(-bucket // dp)
    one_hop = 2 * dp * packed_bytes(width, bits, block)
    if ranks_per_node is None or ranks_per_node in (1, dp):
        return 2 * one_hop
    nodes = dp // ranks_per_node
    first = 2 * ranks_per_node * packed_bytes(nodes * width, bits, block)
    second = 2 * nodes * packed_bytes(width, bits, block)
    return first + second


def _check_zeropp(
    stage: int,
    dp: int,
    quantized_weights: bool,
    quantized_gradients: str,
    hierarchical_partition: bool,
    ranks_per_node: int | None,
    block: int,
) -> None:
    """ZeRO++'s switches as ZeroConfig checks them, named by field."""
    for name, on in (
        ("quantized_weights", quantized_weights),
        ("hierarchical_partition", hierarchical_partition),
    ):
        if not isinstance(on, bool):
            raise PlanError(f"{name}: expected true or false, got {on!r}")
        if on and stage != 3:
            raise PlanError(f"{name}: needs stage 3; stage is {stage}")
    if quantized_gradients not in ("none", *BITS):
        raise PlanError(
            f"quantized_gradients: {quantized_gradients!r} is not 'none', 'int8' or 'int4'"
        )
    if quantized_gradients != "none" and stage == 0:
        raise PlanError("quantized_gradients: needs stage 1, 2 or 3")
    if ranks_per_node is not None:
        _check_int("ranks_per_node", ranks_per_node, 1)
        if dp % ranks_per_node:
            raise PlanError(f"ranks_per_node: {ranks_per_node} does not divide dp {dp}")
    if hierarchical_partition and ranks_per_node is None:
        raise PlanError("hierarchical_partition: needs ranks_per_node")
    _check_int("quantization_block", block, 8)
    if block % 8:
        raise PlanError(f"quantization_block: must be a multiple of 8, got {block}")


def activation_bytes(
    model: int | float | ModelSpec | GPTConfig,
    *,
    mp: int = 1,
    precision: str = "bf16",
    seq_len: int | None = None,
    micro_batch: int | None = None,
    checkpointing: bool = False,
    partition: bool = False,
    cpu_offload: bool = False,
) -> tuple[int, int]:
    """(device, host) bytes of activations per rank for one micro-batch of a transformer.

    With s = seq_len, b = micro_batch, h = dim, a = heads, L = layers, t = N_m (tensor
    parallel) and V = vocab, in 16-bit bytes (doubled in fp32), after Korthikanti et
    al. 2022, "Reducing Activation Recomputation in Large Transformer Models":

    * without checkpointing: L * s*b*h * (10 + 24/t + 5*a*s/(h*t)) bytes;
    * with checkpointing: each layer keeps its input, L * 2*s*b*h bytes (divided by t
      with ``partition``, on the host with ``cpu_offload``), plus one layer's full
      working set s*b*h * (10 + 24/t + 5*a*s/(h*t)) while it is recomputed;
    * both: the logits, s*b*V/t * 4 bytes (the loss is taken in fp32), when V is known;
      for a GPT with ``vocab_tiles``, one tile's (V / tiles).

    Embeddings, the final norm and dropout masks beyond the formula's are left out.
    No ``micro_batch``: (0, 0).
    """
    spec = describe(model)
    _check_precision(precision)
    if micro_batch is None:
        return 0, 0
    _check_int("micro_batch", micro_batch, 1)
    s = spec.seq_len if seq_len is None else seq_len
    if s is None:
        raise PlanError("seq_len: activation estimates need the sequence length")
    _check_int("seq_len", s, 1)
    if spec.gpt is not None and s > spec.gpt.seq_len:
        raise PlanError(f"seq_len: {s} exceeds the model's seq_len {spec.gpt.seq_len}")
    if spec.layers is None or spec.dim is None or spec.heads is None:
        raise PlanError("model: activation estimates need its layers, dim and heads")
    _check_mp(spec, mp)
    b, h, a, t = micro_batch, spec.dim, spec.heads, mp
    scale = PARAM_BYTES[precision] // 2
    sbh = s * b * h
    layer = (10 * sbh + 24 * sbh // t + 5 * a * s * s * b // t) * scale
    tiles = spec.gpt.vocab_tiles if spec.gpt is not None and t == 1 else 1
    logits = s * b * -(-spec.vocab // (t * tiles)) * 4 if spec.vocab else 0
    if not checkpointing:
        return spec.layers * layer + logits, 0
    kept = spec.layers * 2 * sbh * scale
    if partition:
        kept = -(-kept // t)
    if cpu_offload:
        return layer + logits, kept
    return kept + layer + logits, 0


# -- the paper's Table 1 ------------------------------------------------------------------


@dataclass(frozen=True)
class PaperRow:
    """One cell group of Table 1: model-state GB per device at one Ψ and N_d."""

    psi: int
    n_d: int
    baseline: float
    p_os: float
    p_os_g: float
    p_os_g_p: float


def paper_table() -> list[PaperRow]:
    """Table 1 of Rajbhandari et al. 2019 (mixed precision, Adam, K = 12), in GB of 1e9
    bytes, computed by ``plan``."""
    rows = []
    for psi in PAPER_PSI:
        for n_d in PAPER_N_D:
            gb = [plan(psi, dp=n_d, stage=s).model_states / 1e9 for s in (0, 1, 2, 3)]
            rows.append(PaperRow(psi, n_d, *gb))
    return rows


# -- the recommender ----------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One configuration the recommender weighed."""

    stage: int
    dp: int
    mp: int
    activation_checkpointing: bool
    plan: MemoryPlan
    dp_comm_bytes: int
    mp_comm_bytes: int

    @property
    def comm_bytes(self) -> int:
        """Bytes one rank sends per optimizer step. See ``communication_bytes``."""
        return self.dp_comm_bytes + self.mp_comm_bytes

    def describe(self) -> str:
        ckpt = "on" if self.activation_checkpointing else "off"
        return (
            f"ZeRO stage {self.stage}, N_d = {self.dp}, N_m = {self.mp}, "
            f"activation checkpointing {ckpt}"
        )

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["comm_bytes"] = self.comm_bytes
        return out


@dataclass(frozen=True)
class Recommendation:
    """The chosen configuration, or why none fits (``fits`` False, ``choice`` None)."""

    fits: bool
    choice: Candidate | None
    smallest: Candidate
    """The candidate needing the least device memory, fitting or not."""
    device_memory_bytes: int
    usable_bytes: int
    """device_memory_bytes * headroom: what a configuration may use."""
    candidates: tuple[Candidate, ...]
    """Every configuration weighed."""
    reason: str

    @property
    def considered(self) -> int:
        return len(self.candidates)

    def as_dict(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "choice": self.choice.as_dict() if self.choice else None,
            "smallest": self.smallest.as_dict(),
            "device_memory_bytes": self.device_memory_bytes,
            "usable_bytes": self.usable_bytes,
            "considered": self.considered,
            "reason": self.reason,
        }


def communication_bytes(
    model: int | float | ModelSpec | GPTConfig,
    *,
    stage: int,
    dp: int,
    mp: int,
    precision: str = "bf16",
    activation_checkpointing: bool = False,
    seq_len: int | None = None,
    micro_batch: int = 1,
    micro_batches_per_step: int = 1,
) -> tuple[int, int]:
    """(data-parallel, model-parallel) bytes one rank sends per optimizer step.

    Data parallel: 2 Ψ elements at stages 0-2 (reduce-scatter + all-gather, or one
    all-reduce), 3 Ψ at stage 3 (parameters gathered in forward and in backward), in
    the parameter dtype, times (N_d - 1) / N_d, the share a ring sends (the paper rounds
    it to 1; with N_d = 1 nothing moves). Model parallel (Megatron): per layer and
    micro-batch 4 all-reduces of s*b*h elements (2 forward, 2 backward), 6 when
    checkpointed activations are recomputed, each sending 2 (t - 1) / t of its size.
    """
    spec = describe(model)
    _check_int("dp", dp, 1)
    _check_int("mp", mp, 1)
    _check_precision(precision)
    _check_mp(spec, mp)
    p = PARAM_BYTES[precision]
    psi = spec.params_per_mp_rank(mp)
    dp_bytes = (3 if stage == 3 else 2) * psi * p * (dp - 1) // dp
    if mp == 1:
        return dp_bytes, 0
    s = spec.seq_len if seq_len is None else seq_len
    if s is None or spec.layers is None or spec.dim is None:
        raise PlanError("model: model-parallel traffic needs its layers, dim and seq_len")
    per_layer = (6 if activation_checkpointing else 4) * s * micro_batch * spec.dim * p
    mp_bytes = spec.layers * micro_batches_per_step * per_layer * 2 * (mp - 1) // mp
    return dp_bytes, mp_bytes


def recommend(
    model: int | float | ModelSpec | GPTConfig,
    *,
    ranks: int,
    devices_per_node: int,
    device_memory_bytes: int,
    precision: str = "bf16",
    seq_len: int | None = None,
    micro_batch: int = 1,
    micro_batches_per_step: int = 1,
    optimizer_bytes: int = 8,
    offload_optimizer: bool = False,
    partition_activations: bool = False,
    cpu_offload_activations: bool = False,
    bucket_elements: int | None = None,
    headroom: float = 0.9,
) -> Recommendation:
    """The configuration with the least communication per rank per step that fits.

    Weighs stages 1-3 (stage 0 moves as much as stage 1 and holds more), every N_m that
    divides ``ranks``, is at most ``devices_per_node`` (model parallelism stays inside
    a node) and divides the heads (and a GPT's vocab), with activation checkpointing off
    and on (``partition_activations`` and ``cpu_offload_activations`` apply to the
    checkpointed ones). A configuration fits when its ``device_total`` is at most
    ``headroom`` of ``device_memory_bytes``. Ties: stage 1 before 2 before 3, then the
    smaller N_m, then no checkpointing. Never raises for lack of memory: ``fits`` is
    False and ``reason`` gives the smallest requirement found and the usable memory.
    """
    spec = describe(model)
    _check_int("ranks", ranks, 1)
    _check_int("devices_per_node", devices_per_node, 1)
    _check_int("device_memory_bytes", device_memory_bytes, 1)
    _check_int("micro_batch", micro_batch, 1)
    _check_int("micro_batches_per_step", micro_batches_per_step, 1)
    if not 0 < headroom <= 1:
        raise PlanError(f"headroom: must be in (0, 1], got {headroom}")
    if spec.layers is None or spec.dim is None or spec.heads is None:
        raise PlanError("model: recommend needs its layers, dim and heads")
    usable = int(device_memory_bytes * headroom)
    candidates = []
    for mp in range(1, min(ranks, devices_per_node) + 1):
        if ranks % mp or spec.heads % mp or (spec.gpt is not None and spec.gpt.vocab_size % mp):
            continue
        for stage in (1, 2, 3):
            for ckpt in (False, True):
                memory = plan(
                    spec,
                    dp=ranks // mp,
                    mp=mp,
                    stage=stage,
                    precision=precision,
                    optimizer_bytes=optimizer_bytes,
                    offload_optimizer=offload_optimizer,
                    activation_checkpointing=ckpt,
                    partition_activations=partition_activations and ckpt,
                    cpu_offload_activations=cpu_offload_activations and ckpt,
                    seq_len=seq_len,
                    micro_batch=micro_batch,
                    bucket_elements=bucket_elements,
                )
                dp_bytes, mp_bytes = communication_bytes(
                    spec,
                    stage=stage,
                    dp=ranks // mp,
                    mp=mp,
                    precision=precision,
                    activation_checkpointing=ckpt,
                    seq_len=seq_len,
                    micro_batch=micro_batch,
                    micro_batches_per_step=micro_batches_per_step,
                )
                dp = ranks // mp
                candidates.append(Candidate(stage, dp, mp, ckpt, memory, dp_bytes, mp_bytes))

    def rank(c: Candidate) -> tuple[int, int, int, bool]:
        return c.comm_bytes, c.stage, c.mp, c.activation_checkpointing

    smallest = min(candidates, key=lambda c: (c.plan.device_total, *rank(c)))
    fitting = [c for c in candidates if c.plan.device_total <= usable]
    if not fitting:
        reason = (
            f"nothing fits: the smallest requirement is {human_bytes(smallest.plan.device_total)} "
            f"per device ({smallest.describe()}), above the usable "
            f"{human_bytes(usable)} ({headroom:.0%} of {human_bytes(device_memory_bytes)})"
        )
        return Recommendation(
            False, None, smallest, device_memory_bytes, usable, tuple(candidates), reason
        )
    choice = min(fitting, key=rank)
    reason = (
        f"{choice.describe()}: {human_bytes(choice.plan.device_total)} per device of "
        f"{human_bytes(usable)} usable, {human_bytes(choice.comm_bytes)} sent per rank per step"
    )
    return Recommendation(
        True, choice, smallest, device_memory_bytes, usable, tuple(candidates), reason
    )


# -- a module's exact model states ---------------------------------------------------------


def unit_sizes_for_module(
    module: nn.Module,
    *,
    dp: int,
    stage: int,
    bucket_elements: int | None = None,
    stage3_grouping: str = "blocks",
    stage3_leaf_modules: Sequence[str] = KNOWN_MOE_LEAVES,
) -> list[tuple[int, int]]:
    """(elements, padded elements) of every trainable unit the engine would form for
    ``module`` (frozen units hold no gradient, master or optimizer state).

    The units of ``units.plan_layout``, each padded to a multiple of N_d (stage 0
    shards over one rank: no padding). The module is only inspected.
    """
    from .units import unit_sizes

    layout = _layout(module, dp, stage, bucket_elements, stage3_grouping, stage3_leaf_modules)
    return unit_sizes(layout, dp if stage > 0 else 1)


def _layout(
    module: nn.Module,
    dp: int,
    stage: int,
    bucket: int | None,
    grouping: str,
    leaves: Sequence[str] = (),
) -> Layout:
    """The engine's units for ``module`` (units.plan_layout), the arguments checked."""
    from .units import plan_layout

    _check_int("dp", dp, 1)
    _check_stage(stage)
    if bucket is not None:
        _check_int("bucket_elements", bucket, MIN_BUCKET_ELEMENTS)
    if grouping not in ("blocks", "size"):
        raise PlanError(f"stage3_grouping: {grouping!r} is not 'blocks' or 'size'")
    try:
        return plan_layout(
            module,
            stage=stage,
            world=dp,
            bucket_elements=bucket,
            stage3_grouping=grouping,
            stage3_leaf_modules=leaves,
        )
    except ConfigError as exc:
        raise PlanError(str(exc)) from None


def model_state_bytes_for_module(
    module: nn.Module,
    *,
    dp: int,
    stage: int,
    precision: str,
    optimizer_bytes: int = 8,
    bucket_elements: int | None = None,
    stage3_grouping: str = "blocks",
    stage3_leaf_modules: Sequence[str] = KNOWN_MOE_LEAVES,
    offload_optimizer: bool = False,
) -> int:
    """Model-state bytes per rank the engine will hold for this module, padding included:
    the engine's ``memory_ledger().model_states`` before it runs (Adam: 8 bytes). With
    ``offload_optimizer`` the fp32 master is a host copy of its own even in fp32."""
    _check_precision(precision)
    _check_int("optimizer_bytes", optimizer_bytes, 0)
    _check_bool("offload_optimizer", offload_optimizer)
    sizes = unit_sizes_for_module(
        module,
        dp=dp,
        stage=stage,
        bucket_elements=bucket_elements,
        stage3_grouping=stage3_grouping,
        stage3_leaf_modules=stage3_leaf_modules,
    )
    psi_padded = sum(padded for _, padded in sizes)
    kinds = model_state_kinds(stage, precision, psi_padded, dp, optimizer_bytes, offload_optimizer)
    return sum(kinds)


def frozen_bytes_for_module(
    module: nn.Module,
    *,
    dp: int,
    stage: int,
    precision: str,
    bucket_elements: int | None = None,
    stage3_grouping: str = "blocks",
    stage3_leaf_modules: Sequence[str] = KNOWN_MOE_LEAVES,
) -> int:
    """Bytes per rank of the module's frozen parameters (``requires_grad=False``): their
    padded units in the training dtype, this rank's 1/N_d of them at stage 3; no
    gradient, master or optimizer state. The engine's ``memory_ledger().frozen``."""
    from .flat import padded_size

    _check_precision(precision)
    layout = _layout(module, dp, stage, bucket_elements, stage3_grouping, stage3_leaf_modules)
    shard_world = dp if stage > 0 else 1
    frozen = [c for c in layout.chunks if not c[0][1].requires_grad]
    padded = sum(padded_size(sum(p.numel() for _, p in c), shard_world) for c in frozen)
    held = padded // dp if stage == 3 else padded
    return held * PARAM_BYTES[precision]


# -- helpers ------------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    """Bytes in binary units: 1.50 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"):
        if abs(n) < 1024 or unit == "YiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise PlanError(f"{name}: expected an integer, got {value!r}")
    if value < minimum:
        raise PlanError(f"{name}: must be >= {minimum}, got {value}")


def _check_stage(stage: object) -> None:
    if type(stage) is not int or stage not in (0, 1, 2, 3):  # 1.0 and True are refused
        raise PlanError(f"stage: {stage!r} is not a ZeRO stage (0, 1, 2 or 3)")


def _check_bool(name: str, value: object) -> None:
    """A switch is True or False: a string such as "no" would read as on."""
    if not isinstance(value, bool):
        raise PlanError(f"{name}: expected true or false, got {value!r}")


def _check_precision(precision: str) -> None:
    if precision not in PARAM_BYTES:
        raise PlanError(f"precision: {precision!r} is not one of {', '.join(PARAM_BYTES)}")


def _check_mp(spec: ModelSpec, mp: int) -> None:
    if spec.heads is not None and spec.heads % mp:
        raise PlanError(f"mp: {mp} does not divide the model's heads ({spec.heads})")
    if spec.gpt is not None and spec.gpt.vocab_size % mp:
        raise PlanError(f"mp: {mp} does not divide the model's vocab ({spec.gpt.vocab_size})")
    if spec.gpt is not None and mp > 1 and spec.gpt.vocab_tiles > 1:
        raise PlanError(
            f"mp: the model's vocab_tiles ({spec.gpt.vocab_tiles}) are refused with model "
            "parallelism (the vocabulary is already split over the N_m ranks)"
        )
