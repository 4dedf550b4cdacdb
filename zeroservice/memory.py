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

import torch

_PARAM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_MASTER_BYTES = {"fp32": 0, "bf16": 4, "fp16": 4}


def optimizer_state_bytes_per_param(optimizer: torch.optim.Optimizer) -> int | None:
    """Bytes of per-element state the optimizer keeps for fp32 weights, if known."""
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        amsgrad = any(g.get("amsgrad", False) for g in optimizer.param_groups)
        return 12 if amsgrad else 8
    if isinstance(optimizer, torch.optim.SGD):
        return 4 if any(g.get("momentum", 0) for g in optimizer.param_groups) else 0
    return None


def expected_model_state_bytes(
    stage: int, precision: str, psi: int, n_d: int, optimizer_bytes: int = 8
) -> int:
    """Per-rank bytes of model states. See [Note: model-state bytes]."""
    p = g = _PARAM_BYTES[precision]
    k = _MASTER_BYTES[precision] + optimizer_bytes
    if stage == 0:
        return (p + g + k) * psi
    if stage == 1:
        return (p + g) * psi + k * psi // n_d
    if stage == 2:
        return p * psi + (g + k) * psi // n_d
    if stage == 3:
        return (p + g + k) * psi // n_d
    raise ValueError(f"stage: no model-state formula for stage {stage}")


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

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.master + self.optimizer_states

    @property
    def total(self) -> int:
        return self.model_states + self.optimizer_other + self.comm_buffers + self.gathered_params

    def as_dict(self) -> dict[str, int | str | None]:
        out = asdict(self)
        out["model_states"] = self.model_states
        out["total"] = self.total
        return out


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_tensors(
    optimizer: torch.optim.Optimizer,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Split the optimizer's state into shard-sized tensors and small ones (counters)."""
    big: list[torch.Tensor] = []
    small: list[torch.Tensor] = []
    for param, state in optimizer.state.items():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                same = value.numel() == param.numel() and value.numel() > 1
                (big if same else small).append(value)
    return big, small
