"""The paper's model-state formula and the live ledger of what this rank holds.

[Note: model-state bytes]
Per parameter, a rank holds p bytes of training-dtype parameters, g bytes of
gradients, m bytes of fp32 master weights and k bytes of optimizer state
(Adam: 8, its two fp32 moments). Mixed precision: p = g = 2, m = 4, so K = m + k = 12
as in the paper. fp32: p = g = 4 and the parameters are their own master (m = 0).
With Ψ parameters and N_d data-parallel ranks:

    stage 0:  (p + g + m + k) Ψ
    stage 1:  (p + g) Ψ + (m + k) Ψ / N_d
    stage 2:   p Ψ + (g + m + k) Ψ / N_d
    stage 3:  (p + g + m + k) Ψ / N_d

(mixed precision with Adam: 16Ψ, 4Ψ + 12Ψ/N_d, 2Ψ + 14Ψ/N_d, 16Ψ/N_d; fp32 with
Adam: 16Ψ, 8Ψ + 8Ψ/N_d, 4Ψ + 12Ψ/N_d, 16Ψ/N_d.) At stage 3 the gathered (live)
parameters are transient and reported apart: ``gathered_params`` now and
``gathered_peak`` since the last reset. The engine pads each
unit to a multiple of N_d; with Ψ counted after padding the ledger equals the formula
to the byte.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

PARAM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes of a parameter (and of its gradient) in the training dtype."""
MASTER_BYTES = {"fp32": 0, "bf16": 4, "fp16": 4}
"""Bytes of the fp32 master copy (fp32 training: the parameters are their own master)."""


def optimizer_state_bytes_per_param(optimizer: torch.optim.Optimizer) -> int | None:
    """Bytes of per-element state the optimizer keeps for fp32 weights, if known."""
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        amsgrad = any(g.get("amsgrad", False) for g in optimizer.param_groups)
        return 12 if amsgrad else 8
    if isinstance(optimizer, torch.optim.SGD):
        return 4 if any(g.get("momentum", 0) for g in optimizer.param_groups) else 0
    return None


def model_state_kinds(
    stage: int,
    precision: str,
    psi: int,
    n_d: int,
    optimizer_bytes: int = 8,
    offload: bool = False,
) -> tuple[int, int, int, int]:
    """(params, grads, master, optimizer states) bytes per rank. See [Note: model-state
    bytes]. A shard's rounding (under 3 bytes when N_d does not divide Ψ) is counted with
    the optimizer states. With ``offload`` (ZeRO-Offload) the master is a separate fp32
    copy on the host even in fp32 (m = 4): the same total, split between device and host.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage: no model-state formula for stage {stage}")
    p = g = PARAM_BYTES[precision]
    m = 4 if offload else MASTER_BYTES[precision]
    k = optimizer_bytes
    if stage == 0:
        return p * psi, g * psi, m * psi, k * psi
    if stage == 1:
        return p * psi, g * psi, m * psi // n_d, (m + k) * psi // n_d - m * psi // n_d
    if stage == 2:
        sharded = (g + m + k) * psi // n_d
        grads, master = g * psi // n_d, m * psi // n_d
        return p * psi, grads, master, sharded - grads - master
    total = (p + g + m + k) * psi // n_d
    params, grads, master = p * psi // n_d, g * psi // n_d, m * psi // n_d
    return params, grads, master, total - params - grads - master


def expected_model_state_bytes(
    stage: int,
    precision: str,
    psi: int,
    n_d: int,
    optimizer_bytes: int = 8,
    offload: bool = False,
) -> int:
    """Per-rank bytes of model states. See [Note: model-state bytes]."""
    return sum(model_state_kinds(stage, precision, psi, n_d, optimizer_bytes, offload))


@dataclass
class MemoryLedger:
    """Bytes of every buffer the engine owns on this rank, by kind, beside the formula."""

    stage: int
    precision: str
    n_d: int
    psi: int
    """Trainable parameters of the model."""
    psi_padded: int
    """The same after padding each unit to a multiple of N_d."""
    params: int
    grads: int
    master: int
    optimizer_states: int
    """Optimizer tensors of the shard's size (Adam's two moments)."""
    optimizer_other: int
    """Small optimizer tensors (e.g. Adam's per-tensor step counter)."""
    comm_buffers: int
    """Staging buffers, the ring's receive scratch, and (stage 3) released gather
    buffers kept for reuse: all of them together."""
    comm_buffer_largest: int
    """The largest single one of those: C_B x the reduction dtype's bytes whenever some
    unit reaches C_B, whatever the model's size (the paper's constant buffers)."""
    expected: int | None
    """The formula with Ψ = psi (None if the optimizer's state size is unknown)."""
    expected_padded: int | None
    """The formula with Ψ = psi_padded: equal to ``model_states`` to the byte."""
    gathered_params: int = 0
    """Stage 3: bytes of whole (gathered or in-flight) units held right now."""
    gathered_peak: int = 0
    """Stage 3: the most such bytes held at once since the last reset."""
    mp: int = 1
    """Model-parallel degree: Ψ here is this MP rank's slice of the model."""
    offloaded: bool = False
    """Master weights and optimizer states live in host memory (ZeRO-Offload)."""
    host_grads: int = 0
    """ZeRO-Offload: the host buffer the reduced gradient shard is copied into."""
    activations: int = 0
    """Checkpointed activations held on the device now (activation checkpointing)."""
    activations_host: int = 0
    """Checkpointed activations held in host memory now (CPU offload)."""
    activations_peak: int = 0
    """The most checkpointed-activation bytes held at once since the last reset."""
    activation_arena: int = 0
    """Bytes of the contiguous checkpoint arena (M_D), whatever it holds now."""
    comm_buffers_peak: int = 0
    """The most communication-buffer bytes held at once: ``comm_buffers`` plus the
    temporary staging buffers alive together (gradients arriving out of unit order)."""
    frozen: int = 0
    """Resident bytes of frozen (``requires_grad=False``) parameters: 2 or 4 bytes per
    element of their padded units, /N_d at stage 3. No gradient, master or optimizer
    state exists for them; they are not part of ``model_states`` or Ψ."""
    frozen_psi: int = 0
    """Frozen parameters of the model (Ψ_f)."""
    redundancy_host: int = 0
    """Host bytes of the peers' redundancy copies this rank holds (its own state and its
    ring neighbour's, ``redundancy="host-copy"``); 0 without redundancy."""
    redundancy_spare: int = 0
    """Host bytes of the previous copies' buffers, kept for the next refresh to write
    into (see [Note: reused copy buffers] in redundancy.py): as many as
    ``redundancy_host`` from the second copy on."""

    secondary_params: int = 0
    """hpZ: bytes of the secondary shards held now (1/ranks_per_node of every unit a
    forward gathered, kept for the backward gather within the node)."""
    secondary_peak: int = 0
    """hpZ: the most secondary-shard bytes held at once so far."""
    quantization_scratch: int = 0
    """qwZ/qgZ: bytes of the quantized send and receive buffers alive now."""
    quantization_scratch_peak: int = 0
    """qwZ/qgZ: the most such bytes alive at once so far."""

    @property
    def host_bytes(self) -> int:
        """Model states in host memory: master + optimizer states when offloaded."""
        offloaded = self.master + self.optimizer_states + self.host_grads
        return offloaded if self.offloaded else 0

    @property
    def device_model_states(self) -> int:
        return self.model_states - (self.master + self.optimizer_states if self.offloaded else 0)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.master + self.optimizer_states

    @property
    def total(self) -> int:
        return (
            self.model_states
            + self.frozen
            + self.optimizer_other
            + self.comm_buffers
            + self.gathered_params
            + self.secondary_params
            + self.quantization_scratch
        )

    def as_dict(self) -> dict[str, int | str | None]:
        out = asdict(self)
        out["model_states"] = self.model_states
        out["device_model_states"] = self.device_model_states
        out["host_bytes"] = self.host_bytes
        out["total"] = self.total
        return out


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_tensors(
    optimizer: torch.optim.Optimizer,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Split the optimizer's state into shard-sized tensors and small ones (counters).
    Shard-sized by shape, as checkpoints tell them apart: a one-element shard's moments
    are shard-sized, Adam's 0-dim ``step`` is not."""
    big: list[torch.Tensor] = []
    small: list[torch.Tensor] = []
    for param, state in optimizer.state.items():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                same = value.dim() > 0 and value.shape == param.shape
                (big if same else small).append(value)
    return big, small


def allocator_stats(device: torch.device) -> dict[str, int] | None:
    """The CUDA caching allocator's own figures (None off CUDA).

    ``fragmentation`` is reserved − allocated: memory the allocator holds but cannot
    hand out as one block; ``alloc_retries`` counts allocations that succeeded only
    after freeing cached blocks (the symptom M_D removes)."""
    if device.type != "cuda":
        return None
    s = torch.cuda.memory_stats(device)
    reserved = s.get("reserved_bytes.all.current", 0)
    allocated = s.get("allocated_bytes.all.current", 0)
    return {
        "allocated": allocated,
        "reserved": reserved,
        "peak_allocated": s.get("allocated_bytes.all.peak", 0),
        "peak_reserved": s.get("reserved_bytes.all.peak", 0),
        "fragmentation": reserved - allocated,
        "alloc_retries": s.get("num_alloc_retries", 0),
        "ooms": s.get("num_ooms", 0),
    }


def process_status_kib(field: str) -> int:
    """A size from /proc/self/status in KiB (``VmRSS``: resident now, ``VmHWM``: its
    peak). Raises RuntimeError where the field is missing (not Linux)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")
