"""Which parameters train is fixed at ``initialize``; a ``requires_grad`` changed later is
refused by name.

[Note: the trainable set]
At ``initialize`` the engine plans which parameters train: each gets a place in a
trainable unit with a gradient buffer, an fp32 master and optimizer state; a frozen
one gets a unit of its own with none of them (see "Frozen parameters" in
docs/configuration.md). A flag flipped afterwards would be ignored without a word: a
parameter frozen since keeps its master and optimizer state, and the step goes on
moving it (momentum, weight decay, a zero gradient), while one unfrozen since has
nothing to train it with and stays as it was. So every training forward compares each
parameter's ``requires_grad`` with the plan, and a change is refused before the
forward runs. A checkpoint loads into an engine built over the model with more of it
frozen; a parameter unfrozen since has no optimizer state in a checkpoint, and the
loader says so (checkpoint/load.py).
"""

from __future__ import annotations

from torch import nn

from .naming import some_names


class TrainableSet:
    """Every parameter's ``requires_grad`` as ``initialize`` saw it."""

    def __init__(self, module: nn.Module):
        named = list(module.named_parameters())
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._flags = [p.requires_grad for p in self._params]

    def check(self) -> None:
        """Raise if a parameter's ``requires_grad`` differs from the plan."""
        flags = [p.requires_grad for p in self._params]
        if flags == self._flags:
            return
        pairs = list(zip(self._names, self._flags, flags, strict=True))
        frozen = [n for n, was, now in pairs if was and not now]
        unfrozen = [n for n, was, now in pairs if now and not was]
        changed = []
        if frozen:
            changed.append(f"frozen since: {some_names(frozen, 5)}")
        if unfrozen:
            changed.append(f"unfrozen since: {some_names(unfrozen, 5)}")
        raise RuntimeError(
            f"forward: requires_grad changed after initialize ({'; '.join(changed)}). "
            "The engine fixed at initialize which parameters train (gradient buffers, "
            "fp32 masters, optimizer state): it would go on stepping a parameter frozen "
            "since, and leave one unfrozen since as it was. Restore the flags, or save a "
            "checkpoint and build a new engine over the model with its new flags (a "
            "checkpoint loads where more is frozen; for a parameter unfrozen since it "
            "holds no optimizer state, so start that engine with init=<the weights from "
            "`zeroservice checkpoint export`>)"
        )
