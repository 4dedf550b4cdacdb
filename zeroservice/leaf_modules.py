"""Stage 3: a leaf module's backward gathers and reduces all of its units together, so
that ranks whose forwards used different parts of it still issue the same collectives.

[Note: leaf modules]
Stage 3 needs every rank to issue the same gathers and reductions in the same order
(see [Note: rank-divergent control flow] in gather_check.py). A Mixture-of-Experts
layer breaks this in backward, not in forward: its forward gathers every unit on
entry (it is one group), but backward gathers a unit again when autograd first reads
a weight it saved and reduces the unit when autograd is done with it, and a rank
whose tokens skipped expert 3 neither reads nor finishes expert 3. So for a module
named in ``stage3_leaf_modules`` (a group of its own, holding no other: partition.py):

* Gathering. The first read of any of its units in a backward requests all of them,
  in index order (``first_touch``); a unit this rank's forward did not use is
  gathered all the same.
* Reduction. Its units' gradients are staged as autograd finishes them but not
  launched. When autograd has computed the gradients of the module's tensor inputs
  (a multi-grad hook on the inputs of each call that built a graph; after the last
  such call's), all its units are released and their reductions launched in index
  order, with zeros where this rank had no gradient.

Both points come at the same place of every rank's backward: the module is entered
by the same graph on every rank, and its inputs are computed outside it. The inputs'
gradients come after the units' own: autograd runs first the ready node created
last, and the nodes that produced the inputs were created before the module's
gather nodes (an input without one, such as a recomputation's detached input, gets
a view of itself made before them). A weight whose use does not lead to the inputs
(a term computed from weights alone) could be finished after the launch; that
gradient is refused by name (``late_gradient`` in reduce.py), not lost. A call none
of whose inputs needs a gradient (the model's first module) gives no such point: its
units are launched when backward ends, in the launch order.

What it costs: a leaf's units are all gathered in its backward, as in its forward,
and its staged gradients are held until its backward ends: one leaf's worth of each
at a time, where other groups hold at most two units' gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map


class LeafBackward:
    """Which units belong to a leaf module, and where each leaf's backward stands."""

    def __init__(self, leaves: Sequence[list[int]]):
        self.units_of = [sorted(indices) for indices in leaves]
        """Per leaf, its units in index order."""
        self._leaf_of = {i: k for k, indices in enumerate(self.units_of) for i in indices}
        self._open: set[int] = set()
        """Leaves whose units this backward has requested."""
        self._calls = [0] * len(self.units_of)
        """Per leaf, calls whose inputs' gradients are still to come."""

    def holds(self, index: int) -> bool:
        """The unit's reduction waits for its leaf's backward to end."""
        return index in self._leaf_of

    def first_touch(self, index: int) -> list[int] | None:
        """The units to request for a read of ``index`` in backward: all of its leaf's
        on the leaf's first read in this backward, none after; None outside leaves."""
        leaf = self._leaf_of.get(index)
        if leaf is None:
            return None
        if leaf in self._open:
            return []
        self._open.add(leaf)
        return self.units_of[leaf]

    def called(self, leaf: int, args, kwargs, done: Callable[[int], None]):
        """A call of leaf ``leaf`` that builds a graph: ``done(leaf)`` runs once the
        gradients of its tensor inputs are computed, after its last call's. Returns the
        call's (args, kwargs), with each input that is a leaf of the graph (a
        recomputation's detached input) replaced by a view of itself, so that every
        input has a node created before the leaf's gather nodes."""
        args, kwargs = tree_map(_with_node, (args, kwargs))
        inputs = [
            t
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if inputs:
            self._calls[leaf] += 1
            torch.autograd.graph.register_multi_grad_hook(
                inputs, lambda _grads: self._input_grads(leaf, done)
            )
        # else no point in backward: the units are launched when backward ends
        return args, kwargs

    def _input_grads(self, leaf: int, done: Callable[[int], None]) -> None:
        self._calls[leaf] = max(0, self._calls[leaf] - 1)
        if self._calls[leaf] == 0:
            self._open.discard(leaf)
            done(leaf)

    def reset(self) -> None:
        """Backward ended: every leaf closed, no call outstanding."""
        self._open.clear()
        self._calls = [0] * len(self.units_of)


def _with_node(value):
    """A tensor that needs a gradient but has no node (a leaf of the graph), as a view
    of itself: a node created now, ahead of the gather nodes. See [Note: leaf modules]."""
    if isinstance(value, torch.Tensor) and value.requires_grad and value.grad_fn is None:
        return value.view_as(value)
    return value


def suggested_leaves(root: nn.Module, names: Sequence[str]) -> list[str]:
    """The class names to put in ``stage3_leaf_modules`` for parameters that ranks used
    differently: for each, the module that holds the innermost ModuleList or ModuleDict
    it sits in (an MoE layer holding its experts), or that list's item where the model
    itself holds it (a block of the model's layers: the model as a leaf would be
    gathered whole); a parameter in no such container suggests the module that
    registers it."""
    found: list[str] = []
    for name in names:
        parts = name.split(".")[:-1]
        owner = ".".join(parts)
        for end in range(len(parts) - 1, 0, -1):
            if isinstance(root.get_submodule(".".join(parts[:end])), nn.ModuleList | nn.ModuleDict):
                owner = ".".join(parts[: end - 1] if end > 1 else parts[: end + 1])
                break
        cls = type(root.get_submodule(owner)).__name__
        if cls not in found:
            found.append(cls)
    return found
