"""The peak bytes of one rank while it trains the reference GPT, before anything runs.

[Note: peak model]
``memory.py`` and ``planner.plan`` count what stays (model states) and a formula for
activations; the peak of a real step is more: what autograd saves in *our* GPT, the
cross-entropy's fp32 tensors, the gradient of the logits, stage 3's gathered units, the
staging buffers and the ring's scratch, the fp32 gradient copies of a mixed-precision
step. ``predict_peak`` adds those up at the moments a step can peak and returns the
largest:

* ``forward``: inside the loss, every block's saved tensors (or, checkpointed, the
  checkpoint arena) still held and the logits, their fp32 copy and the log-softmax (or
  shifted logits and their exponentials with a vocabulary split over MP) alive at once;
  ``head`` (stage 3, an untied head): the head gathered whole beside the logits it makes;
* ``backward``: at its first node, the log-softmax's backward holds its output, its
  incoming gradient and the gradient it makes (3 fp32 logits) beside all saved
  tensors; ``head backward`` (stage 3, an untied head): the head gathered again, the
  logits' gradient and the head's weight gradient. With ``vocab_tiles`` (models/
  tiled_head.py) one tile's logits stand for the whole (the logits, their fp32 copy
  and their exponentials in forward), and the loss's backward is the head's too: the
  head's whole weight gradient, the input's gradient in fp32, and one tile's logits
  again, their fp32 softmax gradient, its 16-bit cast and its product with the tile
  of the head; ``recompute`` (checkpointed): the
  last block's recomputation and the first node of its backward beside the arena;
  ``blocks`` (stage 3 without checkpointing): the saved tensors beside two unit-sized
  gradient staging buffers borrowed from the gather cache; ``pieces`` (stage 3, an
  untied head larger than C_B): the head's whole gradient reduced through two C_B pool
  buffers into its shard, beside the saved tensors; ``embedding`` (stage 3, an untied
  embedding larger than C_B): the last reduction, its dense gradient through the same
  buffers once every other shard is written;
* ``step``: mixed precision casts every gradient shard to fp32 before the update.

At stage 3 the gather cache keeps nothing idle after the forward's last gather and no
buffer of a unit larger than C_B (buffers.py, gather.py), so at the loss, around the
head and at ``pieces`` only the units that stay gathered (persistent, the root's) are
held beside the head where it is gathered; the ring's receive scratch is held only while
a backward reduces (ring.py): ``blocks``, ``recompute``, ``pieces`` and ``embedding``.

At stages 2 and 3 the gradient shards exist only from the backward's first reduction to
the step (reduce.py, [Note: gradient lifetime]), and on a CPU a shard's pages are
resident once its reduction wrote them: ``forward``, ``backward`` and ``pieces`` count
none but the head's own, ``blocks`` and ``recompute`` those of the units holding only
ln_f's and the head's parameters (reduced before any block's), ``step`` all. The model is
one micro-batch per step: with accumulation the shards are held from the first
micro-batch's backward on.

Every term is a count of tensors in the code (models/gpt.py, tensor_parallel.py,
activations.py, reduce.py, gather.py, ring.py, optim.py), in elements of this rank:

with b·s = B tokens, h = dim, f = 4h, t = N_m, a = heads, p the training dtype's bytes,
per block and micro-batch autograd saves (see ``block_saved_elements``): the block's
input x (saved by ln1), ln1's output (by qkv), qkv's output 3h/t (q, k and v are views
of it, saved by attention), attention's output h/t (its (b, s, a, d) layout makes the
transposed reshape a view, saved by proj), x + attn (by ln2), ln2's output (by fc),
fc's output f/t (by gelu) and gelu's output f/t (by proj): 4h + (4h + 2f)/t elements of
p bytes per token, plus the layer norms' mean and rstd (2 x 2 fp32 per token) and
attention's log-sum-exp (a/t fp32 per token). Dropout is 0 in the reference model
(p = 0 returns its input: no mask).

The model states are ``memory.model_state_kinds`` with Ψ counted after each unit's
padding (the ledger's figure to the byte); units come from the same packing the engine
uses (``units.budgets``, reverse registration order at stages 0-2, module groups at
stage 3), so the staging buffers (2 x min(largest unit, C_B) at stage 2, counted as far
as the units staged in them write: a page is resident once written; pieces of an
oversized unit at stage 3) and the ring's receive scratch (min(largest shard, C_B /
N_d) elements) follow the engine's sizes.

One term is a measured constant, not a count of our tensors: on a CPU whose oneDNN runs
bf16 matrix products natively (AVX512-BF16 or AMX), each distinct product shape keeps a
compiled kernel and its buffers resident for the life of the process, 0.55-0.72 MiB
per shape on an AMD EPYC with AVX512-BF16 (``python -m benchmarks.bf16_kernels``; fp32
products, and bf16 products on a CPU without those instructions, keep none). The
reference GPT's step multiplies in ``BF16_MATMUL_SHAPES`` shapes whatever its depth
(layers share them), so a bf16 rank on such a CPU holds ``BF16_MATMUL_SHAPES x
BF16_KERNEL_BYTES`` from its first step on (``PeakConfig.native_bf16``; ``None`` asks
this host: ``native_bf16_matmul``).

A second is measured per host, when given: fp32 products keep MKL's buffer cache
resident (2-7 MiB on ~6 M-parameter GPTs, by CPU), which ``PeakConfig.mkl_cache`` adds
to every moment (see [Note: MKL's buffer cache] in mkl_cache.py).

Nothing else is fitted to a measurement, and no allocator term is added: with
``MALLOC_MMAP_THRESHOLD_=131072`` glibc maps every block above 128 KiB on its own and
unmaps it when freed, so RSS follows the tensors. Measured against this prediction
(benchmarks/planner_oracle.py, docs/planner.md) a resident excess the ledger does not
see remains at stages 0-2: 0.5-1.3 MiB in bf16, whose source is not identified, so it
is left out rather than fitted; in fp32 the 2-7 MiB of it that is MKL's cache is the
measured term above.

[Note: peak on a GPU]
With ``device="cuda"`` the peak is what the CUDA caching allocator hands out
(``torch.cuda.max_memory_allocated`` above the bytes held before the model was built),
and three things differ from a CPU rank, each a matter of where a tensor lives or how
it is allocated, not a fitted term:

* ZeRO-Offload's fp32 master, Adam's moments and the fp32 gradient shard are in host
  memory (``offload_optimizer``), and so are the offloaded checkpoints
  (``cpu_offload_activations``): none of them counts on the device;
* the allocator hands out a whole tensor at once: stage 2's staging buffers count whole,
  and the gradient shards (one buffer, reduce.py) count whole from the backward's first
  reduction, where on a CPU only the pages written so far are resident. That first
  reduction is a moment of its own (``reduction``): the shards' buffer beside every
  block's saved tensors, the head's weight gradient and the gradient entering ln_f;
* collectives are the backend's own (NCCL's; gloo's stage GPU tensors through the host),
  so there is no ring scratch, and no oneDNN bf16 kernels.

The CUDA context, cuBLAS's workspace and the allocator's rounding of reserved blocks are
outside the figure (a budget must leave room for them).
"""

from __future__ import annotations

import bisect
import itertools
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from .flat import padded_size
from .memory import PARAM_BYTES, model_state_kinds
from .shm import HEADER_BYTES, half_bytes_for

if TYPE_CHECKING:
    from .models.gpt import GPTConfig
    from .units import Budgets

TAIL = ("ln_f", "head")
"""The modules after the blocks: backward reduces their units before any block's."""
BF16_MATMUL_SHAPES = 15
"""Distinct matrix-product shapes in one step of the reference GPT: five linear maps
(qkv, attention's projection, fc, the MLP's projection, the head), each with a forward
product and two in backward (the input's and the weight's gradient)."""
BF16_KERNEL_BYTES = 3 * 2**18
"""Resident bytes per bf16 product shape on a CPU with native bf16 kernels: 0.75 MiB,
above the 0.55-0.72 MiB measured per shape (benchmarks/bf16_kernels.py: 90 products of
30 linear maps, and steps of GPTs of dim 96-384) on an AMD EPYC with AVX512-BF16."""


def native_bf16_matmul() -> bool:
    """Whether this host's torch multiplies bf16 matrices with oneDNN's native kernels
    (AVX512-BF16 or AMX, oneDNN enabled and not held below them by ONEDNN_MAX_CPU_ISA)."""
    import torch

    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    isa = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    if isa and isa != "ALL" and not any(k in isa for k in ("BF16", "AMX", "AVX10")):
        return False
    cpu = torch.cpu
    return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())


@dataclass(frozen=True)
class PeakConfig:
    """One rank's training configuration: the reference GPT and the engine's options."""

    gpt: GPTConfig
    stage: int
    dp: int
    mp: int = 1
    precision: str = "fp32"
    micro_batch: int = 1
    seq_len: int | None = None
    """Tokens per sample (default: the model's seq_len)."""
    activation_checkpointing: bool = False
    partition_activations: bool = False
    cpu_offload_activations: bool = False
    offload_optimizer: bool = False
    optimizer_bytes: int = 8
    bucket_elements: int | None = None
    prefetch_elements: int | None = None
    persistence_elements: int | None = None
    """Stage 3's ``stage3_persistence_elements``: units up to it stay gathered."""
    native_bf16: bool | None = None
    """Whether the rank's CPU keeps bf16 kernels resident (see [Note: peak model]);
    ``None``: as this host does (``native_bf16_matmul``)."""
    collectives: str = "auto"
    """The engine's ``collectives``: with "shm" the shared segments replace the ring's
    scratch (shm.py)."""
    device: str = "cpu"
    """Where the rank trains: "cpu" (the peak is resident host bytes) or "cuda" (bytes the
    CUDA allocator hands out; see [Note: peak on a GPU])."""
    mkl_cache: int = 0
    """fp32 on a CPU: bytes MKL's buffer cache keeps resident from the first products on,
    as ``mkl_cache.measure_mkl_cache`` measures it on the rank's host (see [Note: MKL's
    buffer cache] in mkl_cache.py); 0: not counted."""

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage: {self.stage!r} is not a ZeRO stage (0, 1, 2 or 3)")
        if self.precision not in PARAM_BYTES:
            raise ValueError(f"precision: {self.precision!r} is not one of {list(PARAM_BYTES)}")
        for name in ("dp", "mp", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.gpt.n_head % self.mp or self.gpt.vocab_size % self.mp:
            raise ValueError(f"mp: {self.mp} does not divide the model's heads and vocab")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device: {self.device!r} is not 'cpu' or 'cuda'")
        if self.device == "cuda" and self.collectives in ("ring", "shm"):
            raise ValueError(
                f"collectives: {self.collectives!r} moves host tensors only; a GPU rank "
                "uses the backend's own ('auto' or 'native')"
            )
        for name in ("partition_activations", "cpu_offload_activations"):
            if getattr(self, name) and not self.activation_checkpointing:
                raise ValueError(f"{name}: applies to activation checkpoints; set them on")
        if type(self.mkl_cache) is not int or self.mkl_cache < 0:
            raise ValueError(f"mkl_cache: a number of bytes >= 0, not {self.mkl_cache!r}")


@dataclass(frozen=True)
class PeakPrediction:
    """Bytes one rank holds at its peak, by kind, and where the peak happens."""

    phase: str
    """"forward", "head", "backward" (its first node), "head backward", "recompute" (a
    checkpointed block's recomputation, later in backward), "blocks", "pieces",
    "embedding" (stage 3), "reduction" (stages 2 and 3 on a GPU: [Note: peak on a
    GPU]) or "step": the moment of the largest total. See [Note: peak model]."""
    peak: int
    """The largest of ``phases``: what VmHWM above start-up should read on CPU, and
    ``max_memory_allocated`` above the model's start on a GPU."""
    model_states: int
    """params + grads + master + optimizer states: the ledger's ``model_states``."""
    host_grads: int
    """ZeRO-Offload's fp32 gradient shard in host memory (the ledger's ``host_grads``)."""
    staging: int
    """Gradient staging buffers (reduce.py's pool) as allocated: the ledger counts them
    in ``comm_buffers``. The totals count the pages the units staged in them write."""
    ring: int
    """The ring's receive scratch (ring.py), or with ``collectives="shm"`` the shared
    segments this rank maps (shm.py): also in the ledger's ``comm_buffers``."""
    gathered: int
    """Stage 3: whole units gathered at once, at their most (the ledger's
    ``gathered_peak``)."""
    arena: int
    """The checkpoint arena (the ledger's ``activation_arena``)."""
    kernels: int = 0
    """bf16 matrix-product kernels a CPU with native bf16 keeps resident (not in the
    ledger: they are the library's, not the engine's)."""
    mkl_cache: int = 0
    """MKL's buffer cache, as given (``PeakConfig.mkl_cache``), where it applies: fp32 on a
    CPU (not in the ledger either)."""
    phases: dict[str, int] = field(default_factory=dict)
    """Total bytes at each moment."""
    breakdown: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per moment, bytes by kind."""

    def as_dict(self) -> dict:
        return asdict(self)


# -- the reference GPT's parameters, as one MP rank holds them ---------------------------


def gpt_parameters(cfg: GPTConfig, mp: int) -> list[tuple[str, int]]:
    """(name, elements) of one tensor-parallel rank's parameters, in registration order
    (a tied head is the embedding itself: listed once)."""
    d, v, f, t = cfg.dim, cfg.vocab_size, cfg.dim * cfg.mlp_ratio, mp
    out = [("wte.weight", v // t * d), ("wpe.weight", cfg.seq_len * d)]
    for i in range(cfg.n_layer):
        p = f"blocks.{i}."
        block = [
            ("ln1.weight", d),
            ("ln1.bias", d),
            ("attn.qkv.weight", 3 * d // t * d),
            ("attn.qkv.bias", 3 * d // t),
            ("attn.proj.weight", d * (d // t)),
            ("attn.proj.bias", d),
            ("ln2.weight", d),
            ("ln2.bias", d),
            ("mlp.fc.weight", f // t * d),
            ("mlp.fc.bias", f // t),
            ("mlp.proj.weight", d * (f // t)),
            ("mlp.proj.bias", d),
        ]
        out += [(p + n, k) for n, k in block if cfg.bias or not n.endswith("bias")]
    out += [("ln_f.weight", d), ("ln_f.bias", d)]
    if not cfg.tie_weights:
        out.append(("head.weight", v // t * d))
    return out


def _pack(params: list[tuple[str, int]], cap: int) -> list[tuple[int, bool]]:
    """flat.split_into_units on (name, size): consecutive, a unit closes before passing
    ``cap``. Per unit: its elements, and whether all its parameters are ln_f's or the
    head's (backward reduces such a unit before any block's)."""
    units: list[tuple[int, bool]] = []
    current, tail = 0, True
    for name, n in params:
        if current and current + n > cap:
            units.append((current, tail))
            current, tail = 0, True
        current += n
        tail = tail and name.split(".")[0] in TAIL
    if current:
        units.append((current, tail))
    return units


@dataclass(frozen=True)
class _Units:
    sizes: list[int]
    """Padded elements of each unit."""
    groups: list[list[int]]
    """Stage 3: per gathered group in forward order (the root, then wte, wpe, each block,
    ln_f, head: partition.build_groups), its units' padded sizes."""
    names: list[str]
    """Stage 3: the groups' module names ("" the root)."""
    tail: int
    """Padded elements of the units backward reduces before any block's (ln_f's and an
    untied head's)."""
    budgets: Budgets
    block: int
    """C_B padded to a multiple of N_d: the staging size and N_d x the ring's chunk."""


_UNITS_CACHE: dict[tuple, _Units] = {}
"""_units by what they depend on: the automatic configuration predicts hundreds of
configurations that share a layout (they differ in micro-batch, checkpointing,
offload...), and a 1024-layer model's layout takes tens of milliseconds."""


def _units(c: PeakConfig) -> _Units:
    """The engine's units (units.plan_layout) for the reference GPT, by name and size
    (read only: shared between predictions of one layout)."""
    key = (
        tuple(asdict(c.gpt).items()),
        c.mp,
        c.dp,
        c.stage,
        c.bucket_elements,
        c.prefetch_elements,
        c.persistence_elements,
    )
    units = _UNITS_CACHE.get(key)
    if units is None:
        if len(_UNITS_CACHE) >= 256:
            _UNITS_CACHE.clear()
        units = _UNITS_CACHE[key] = _layout(c)
    return units


def _layout(c: PeakConfig) -> _Units:
    """What _units caches."""
    from .flat import padded_size
    from .units import budgets

    params = gpt_parameters(c.gpt, c.mp)
    psi = sum(n for _, n in params)
    b = budgets(psi, c.dp, c.bucket_elements, c.prefetch_elements, c.persistence_elements)
    cap = b.unit_elements
    shard_world = c.dp if c.stage > 0 else 1
    names = [""]
    if c.stage < 3:
        raw = [_pack(params[::-1], cap)]
    else:
        # Stage 3 groups (partition._block_modules): each block, and each module beside
        # the blocks unless it shares a parameter (a tied wte stays with the root).
        def owner(name: str) -> str:
            if name.startswith("blocks."):
                return ".".join(name.split(".")[:2])
            module = name.split(".")[0]
            return "" if module == "wte" and c.gpt.tie_weights else module

        owned: dict[str, list[tuple[str, int]]] = {"": []}
        for n, k in params:
            owned.setdefault(owner(n), []).append((n, k))
        names = list(owned)
        raw = [_pack(owned[g], cap) for g in names]
    groups = [[padded_size(n, shard_world) for n, _ in g] for g in raw]
    sizes = [n for g in groups for n in g]
    tail = sum(padded_size(n, shard_world) for g in raw for n, last in g if last)
    return _Units(sizes, groups, names, tail, b, padded_size(cap, c.dp))


# -- activations, counted from models/gpt.py ----------------------------------------------


def block_saved_elements(h: int, f: int, t: int) -> int:
    """Elements of the training dtype one block saves for backward, per token.
    See [Note: peak model]."""
    return 4 * h + (4 * h + 2 * f) // t


def block_saved_fp32(heads: int, t: int) -> int:
    """fp32 elements per token one block saves beside them: two layer norms' mean and
    rstd, attention's log-sum-exp."""
    return 4 + heads // t


# -- the peak ------------------------------------------------------------------------------


def predict_peak(c: PeakConfig) -> PeakPrediction:
    """The peak bytes of one rank (the worst over ranks: they hold the same here).
    See [Note: peak model]."""
    cfg, t = c.gpt, c.mp
    p = PARAM_BYTES[c.precision]
    units = _units(c)
    psi_padded = sum(units.sizes)
    params, grads, master, opt = model_state_kinds(
        c.stage, c.precision, psi_padded, c.dp, c.optimizer_bytes, c.offload_optimizer
    )
    shard = psi_padded // c.dp if c.stage > 0 else psi_padded
    host_grads = 4 * shard if c.offload_optimizer else 0
    states = params + grads + master + opt

    # Resident buffers (reduce.py, ring.py, gather.py's cache at stage 3).
    largest = max(units.sizes)
    staging = written = 0
    if c.stage == 2:
        # Two buffers of min(largest unit, C_B). A page is resident once written: the
        # units staged in them reach that far, and with one unit one buffer is written.
        staging = 2 * min(largest, units.block) * p
        written = sum(min(n, units.block) for n in sorted(units.sizes)[-2:]) * p
        if c.device == "cuda":
            written = staging  # the allocator hands out whole buffers
    elif c.stage == 3 and largest > units.block:
        # Allocated for an oversized unit's pieces only (reduce.py): see ``pieces`` below.
        staging = 2 * units.block * p
    ring = 0
    if c.device == "cuda":
        pass  # native collectives (NCCL's, or gloo's staged through the host): no scratch
    elif c.dp > 1 and c.collectives == "shm":
        ring = c.dp * (HEADER_BYTES + 2 * half_bytes_for(c.dp, units.block // c.dp))
    elif c.dp > 1:
        largest_shard = largest // (c.dp if c.stage > 0 else 1)
        ring = min(largest_shard, units.block // c.dp) * p
    gathered = _gathered_elements(units) * p if c.stage == 3 else 0
    # Stage 3 at the loss and around the head's backward: the head's buffer released, and
    # nothing idle (an oversized unit's buffer is never kept, and the cache is emptied
    # after the forward's last gather: buffers.py, gather.py): only the units that stay
    # gathered (persistent, the root's).
    settled = _persistent_and_root(units)[1] * p if c.stage == 3 else 0

    # Activations (models/gpt.py, activations.py), B tokens on this rank.
    s = cfg.seq_len if c.seq_len is None else c.seq_len
    tokens = c.micro_batch * s
    h, f, v = cfg.dim, cfg.dim * cfg.mlp_ratio, cfg.vocab_size // t
    block = tokens * (block_saved_elements(h, f, t) * p + block_saved_fp32(cfg.n_head, t) * 4)
    tail = 2 * tokens * h * p + 2 * tokens * 4  # ln_f's input and output; its mean, rstd
    checkpoint = -(-tokens * h // t) if c.partition_activations else tokens * h
    arena = cfg.n_layer * checkpoint * p if c.activation_checkpointing else 0
    # On a GPU, offloaded checkpoints are in host memory (pinned): none on the device.
    arena_here = 0 if c.device == "cuda" and c.cpu_offload_activations else arena
    # Checkpointed, the blocks' tensors are gone after each block; the arena holds inputs.
    saved = 0 if c.activation_checkpointing else cfg.n_layer * block
    native = c.device == "cpu" and (
        native_bf16_matmul() if c.native_bf16 is None else c.native_bf16
    )
    tiles = cfg.vocab_tiles if t == 1 else 1
    # Vocabulary tiles multiply in the head's three shapes per tile width (the last
    # tile's, when shorter, three more).
    shapes = BF16_MATMUL_SHAPES + (3 if tiles > 1 and v % -(-v // tiles) else 0)
    kernels = shapes * BF16_KERNEL_BYTES if native and c.precision == "bf16" else 0
    # The ring's scratch is held only while a backward's reductions run (ring.py); the
    # shared segments of "shm" stay mapped.
    ring_held = ring if c.collectives == "shm" else 0
    reducing = ring - ring_held
    resident = states + host_grads + written + ring_held + gathered
    if c.device == "cuda" and c.offload_optimizer:
        resident -= master + opt + host_grads  # in host memory
    # Stages 2/3 hold no gradient shard from the step until the backward's first
    # reduction (reduce.py, [Note: gradient lifetime]); one micro-batch per step.
    before_reduction = resident - (grads if c.stage >= 2 else 0)
    at_loss = before_reduction - gathered + settled
    loss_fwd, loss_bwd = _loss_bytes(tokens, v, h, p, t, tiles)
    forward = {
        "resident": at_loss,
        "activations": saved + tail,
        "arena": arena_here,
        "loss": loss_fwd,
    }
    backward_start = {
        "resident": at_loss,
        "activations": forward["activations"],
        "arena": arena_here,
        "loss": loss_bwd,
    }
    phases = {"forward": forward, "backward": backward_start}
    head = v * h if not cfg.tie_weights else 0
    if c.stage == 3 and head:
        # An untied head is gathered for its product: in forward beside the logits it
        # makes; in backward beside the logits' gradient and its own weight's gradient.
        whole = padded_size(head, c.dp) * p
        phases["head"] = {
            "resident": at_loss,
            "activations": forward["activations"],
            "arena": arena_here,
            "gathered head": whole,
            "logits": loss_fwd if tiles > 1 else tokens * v * p,
        }
        phases["head backward"] = {
            "resident": at_loss,
            "activations": forward["activations"],
            "arena": arena_here,
            "gathered head": whole,
            "gradients": loss_bwd if tiles > 1 else tokens * v * p + head * p,
        }
    # Stage 3 stages gradients in unit-sized buffers borrowed from the gather cache, at
    # most two in flight (reduce.py): beside the blocks' backward, not at its first node.
    borrowed = 0
    if c.stage == 3:
        others = sorted(n for g in units.groups[1:] for n in g if n <= units.block)
        borrowed = sum(others[-2:]) * p
    # On a CPU a gradient shard's pages are resident once its reduction wrote them: inside
    # the blocks' backward, those of the units reduced before them.
    written_grads = units.tail // c.dp * p if c.stage >= 2 else 0
    if c.device == "cuda" and c.stage >= 2:
        written_grads = grads  # one buffer, allocated whole at the first reduction
    if c.activation_checkpointing:
        phases["recompute"] = {
            "resident": before_reduction + written_grads,
            "arena": arena_here,
            "activations": _recompute_bytes(c, block, tokens, p),
            "gradient staging": borrowed + reducing,
        }
    elif borrowed:
        phases["blocks"] = {
            "resident": before_reduction + written_grads,
            "activations": saved + tokens * h * p,
            "gradient staging": borrowed + reducing,
        }
    if c.stage == 3 and padded_size(head, c.dp) > units.block:
        # An untied head above C_B is the backward's first unit to reduce: its whole
        # gradient, as autograd made it, goes through the two pool buffers in pieces
        # into its shard, beside every block's saved tensors. The untied embedding, as
        # large, is the last: its dense gradient goes the same way once every other
        # shard is written and the saved tensors are gone.
        # Its shard's pages on a CPU; on a GPU the shards' one buffer, whole.
        shard = grads if c.device == "cuda" else padded_size(head, c.dp) // c.dp * p
        phases["pieces"] = {
            "resident": at_loss,
            "activations": forward["activations"],
            "arena": arena_here,
            "gradient staging": staging + reducing + head * p + shard,
        }
        phases["embedding"] = {
            "resident": at_loss + grads,
            "gradient staging": staging + reducing + head * p,
        }
    if c.device == "cuda" and c.stage >= 2:
        # The backward's first reduction allocates the shards' one buffer whole, every
        # block's saved tensors still held, beside the head's weight gradient (made, or
        # tied and waiting for the embedding's) and the gradient entering ln_f.
        phases["reduction"] = {
            "resident": at_loss + grads,
            "activations": forward["activations"],
            "arena": arena_here,
            "gradients": (v * h + tokens * h) * p,
        }
    phases["step"] = {"resident": resident + arena_here, "fp32 gradients": _step_casts(c, units)}
    if kernels:
        for moment in phases.values():
            moment["bf16 kernels"] = kernels
    mkl = c.mkl_cache if c.device == "cpu" and c.precision == "fp32" else 0
    if mkl:  # from the first product on: every moment holds it
        for moment in phases.values():
            moment["mkl cache"] = mkl
    totals = {k: sum(v.values()) for k, v in phases.items()}
    where = max(totals, key=lambda k: totals[k])
    return PeakPrediction(
        phase=where,
        peak=totals[where],
        model_states=states,
        host_grads=host_grads,
        staging=staging,
        ring=ring,
        gathered=gathered,
        arena=arena,
        kernels=kernels,
        mkl_cache=mkl,
        phases=totals,
        breakdown=phases,
    )


def _loss_bytes(tokens: int, v: int, h: int, p: int, t: int, tiles: int) -> tuple[int, int]:
    """Bytes the loss holds at the forward's peak and at the backward's first node, for
    ``tokens`` x ``v`` logits (this rank's B x V/t) in a dtype of ``p`` bytes (the head
    h x v), computed in ``tiles`` vocabulary tiles."""
    logits = tokens * v
    cast = 4 if p != 4 else 0  # .float() copies 16-bit logits; on fp32 it is a no-op
    if tiles > 1:
        # models/tiled_head.py: a tile's logits, their fp32 copy and exp(logits - max);
        # the running max, sum, target logit and the log-sum-exp (fp32 per token). Its
        # backward: the head's weight gradient (whole), the input's gradient in fp32, a
        # tile's logits, their fp32 softmax gradient (in place), its cast back and its
        # product with the tile of the head (tokens x h).
        tile = tokens * -(-v // tiles)
        running = 4 * tokens * 4
        back = v * h * p + tokens * h * 4 + tile * (p + cast + (p if p != 4 else 0))
        return tile * (p + cast + 4) + running, back + tokens * h * p + running
    if t == 1:
        # F.cross_entropy(logits.float()): logits, their fp32 copy, the log-softmax; its
        # backward: the log-softmax, nll's gradient and its own gradient, all fp32.
        return logits * (p + cast + 4), 3 * logits * 4
    # tensor_parallel._VocabParallelCrossEntropy: logits, fp32 copy, shifted, exp; its
    # backward turns exp into the gradient in place and casts it back (16-bit).
    return logits * (p + cast + 4 + 4), logits * (4 + (p if p != 4 else 0))


def _recompute_bytes(c: PeakConfig, block: int, tokens: int, p: int) -> int:
    """The last block's recomputation and the first node of its backward (activations.py):
    its input loaded whole (a clone of the arena slot, or gathered over MP with P_a), the
    block's saved tensors again, the gradient arriving at its output, and mlp.proj's
    backward making the gradient of its input (B x f/t) and of its weight (f/t x h).
    A tied head's weight gradient waits in autograd's buffer for the embedding's
    (V/t x h) all through the blocks' backward."""
    h, f, t = c.gpt.dim, c.gpt.dim * c.gpt.mlp_ratio, c.mp
    tied = c.gpt.vocab_size // t * h if c.gpt.tie_weights else 0
    return block + (2 * tokens * h + tokens * f // t + f // t * h + tied) * p


def _step_casts(c: PeakConfig, units: _Units) -> int:
    """Bytes the optimizer step makes in fp32 from 16-bit gradients (optim.py): the norm
    reads each unit's shard with ``vector_norm(dtype=float32)``, one fp32 copy at a time;
    then, without offload, every shard's ``g.float()`` is alive together for the update
    (with offload they are copied into the resident host buffer instead). fp32: none."""
    if c.precision == "fp32":
        return 0
    shard_world = c.dp if c.stage > 0 else 1
    shards = [n // shard_world for n in units.sizes]
    return 4 * (max(shards) if c.offload_optimizer else sum(shards))


def _persistent_and_root(units: _Units) -> tuple[set[int], int]:
    """Stage 3: the persistent units (indices into the groups' units, flattened) and the
    elements gathered outside any group's window: those and the root's units."""
    b = units.budgets
    flat = [(g, n) for g, sizes in enumerate(units.groups) for n in sizes]
    persistent: set[int] = set()
    held = 0
    for i in sorted(range(len(flat)), key=lambda i: flat[i][1]):
        n = flat[i][1]
        if n > b.persistence_elements:
            continue
        if b.persistent_total is not None and held + n > b.persistent_total:
            break
        persistent.add(i)
        held += n
    return persistent, held + sum(
        n for i, (g, n) in enumerate(flat) if g == 0 and i not in persistent
    )


def _gathered_elements(units: _Units) -> int:
    """Stage 3: the most unit elements gathered at once (gather.py). Units of at most
    ``persistence_elements`` stay gathered (smallest first, within ``persistent_total``);
    the root's stay gathered through the forward; each group's are gathered when it
    runs, and the next ones in pass order ahead of use while all live units fit the
    prefetch budget. The forward and the backward (reverse order, without the
    embeddings, whose backward reads no weight) are walked; the larger is kept."""
    budget = units.budgets.prefetch_elements
    flat = [(g, n) for g, sizes in enumerate(units.groups) for n in sizes]
    persistent, base = _persistent_and_root(units)
    gathered = [0] * len(units.groups)  # per group, its units that are not persistent
    for i, (g, n) in enumerate(flat):
        if i not in persistent:
            gathered[g] += n
    forward = list(range(1, len(units.groups)))
    backward = [g for g in reversed(forward) if units.names[g] not in ("wte", "wpe")]
    most = base
    for order in (forward, backward):
        # Prefetch takes the next groups in order while all fit: with the prefix sums
        # of their sizes, the last that fits is a binary search (walking ahead from
        # every group was quadratic in the layers: minutes for a 1024-layer plan).
        before = list(itertools.accumulate((gathered[g] for g in order), initial=0))
        for k, g in enumerate(order):
            live = base + gathered[g]
            room = budget - live
            if room >= 0:
                last = bisect.bisect_right(before, before[k + 1] + room) - 1
                live += before[last] - before[k + 1]
            most = max(most, live)
    return most
