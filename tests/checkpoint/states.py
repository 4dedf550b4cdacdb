"""A checkpoint's whole tensors by kind, to hold two checkpoints against each other."""

from __future__ import annotations

import torch

from zeroservice.checkpoint import iter_tensors

KINDS = ("master", "exp_avg", "exp_avg_sq")


def consolidated(directory) -> dict[str, dict[str, torch.Tensor]]:
    """Masters and both Adam moments, whole, by parameter name (read on the host)."""
    return {kind: dict(iter_tensors(directory, kind)) for kind in KINDS}


def assert_same_states(a: dict, b: dict) -> None:
    """Bit for bit: the same kinds, names and values."""
    assert a.keys() == b.keys()
    for kind in a:
        assert a[kind].keys() == b[kind].keys()
        for name, value in a[kind].items():
            assert torch.equal(value, b[kind][name]), (kind, name)
