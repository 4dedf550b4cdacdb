"""Stage 3: what a module sees as ``self.weight`` while its parameters are partitioned.

Each module that registers a partitioned parameter gets its class swapped for a
subclass whose properties read the parameter through the gatherer (see [Note: gather
and release] in gather.py); ``restore`` gives every module its own class back. The
registered ``nn.Parameter`` stays in place as an empty placeholder, so
``parameters()``, dtype and device queries keep working; inside a forward,
``parameters()`` yields the gathered weights (see [Note: parameters() inside a
forward]).
"""

from __future__ import annotations

from functools import partial
from typing import Protocol

import torch
from torch import nn

from .flat import FlatUnit

_MANAGED_CLASSES: dict[tuple[type, frozenset[str]], type] = {}
_GATHERER = "_zeroservice_gatherer"


class ParamSource(Protocol):
    def param(self, module: nn.Module, name: str) -> torch.Tensor: ...

    def in_forward(self) -> bool: ...


def _managed_class(cls: type, names: frozenset[str]) -> type:
    """A subclass of ``cls`` whose ``names`` read through the gatherer."""
    key = (cls, names)
    if key not in _MANAGED_CLASSES:

        def getter(name: str, module: nn.Module) -> torch.Tensor:
            return module.__dict__[_GATHERER].param(module, name)

        namespace: dict[str, object] = {n: property(partial(getter, n)) for n in names}
        namespace["_zeroservice_original_class"] = cls
        _MANAGED_CLASSES[key] = type(cls.__name__, (cls,), namespace)
    return _MANAGED_CLASSES[key]


class _ForwardParameters(dict):
    """A managed module's ``_parameters``: inside a forward, ``items()`` (what
    ``parameters()`` and ``named_parameters()`` walk) yields what ``self.<name>`` reads,
    the gathered weight; outside, and for every other read, the placeholders.

    [Note: parameters() inside a forward]
    A forward that walks ``self.parameters()`` (a weight penalty in the loss, a norm
    over the weights) would otherwise compute on the empty placeholders and add a
    silent zero. Only ``items()`` is routed: the engine itself reads placeholders by
    key and by ``values()``."""

    def __init__(self, params: dict, module: nn.Module, names: frozenset[str], source):
        super().__init__(params)
        self._module, self._names, self._source = module, names, source

    def items(self):
        if not self._source.in_forward():
            return super().items()
        return [
            (n, self._source.param(self._module, n) if n in self._names else p)
            for n, p in super().items()
        ]


class ParamAccess:
    """Routes every partitioned parameter's attribute reads to ``source``."""

    def __init__(self, root: nn.Module, units: list[FlatUnit], source: ParamSource):
        modules = dict(root.named_modules(remove_duplicate=False))
        self.slots: dict[tuple[int, str], tuple[int, int]] = {}
        """(id(module), attribute name) -> (unit index, slot index)."""
        names: dict[int, tuple[nn.Module, set[str]]] = {}
        for unit in units:
            for s, slot in enumerate(unit.slots):
                for qual in slot.names:
                    owner, _, local = qual.rpartition(".")
                    module = modules[owner]
                    self.slots[(id(module), local)] = (unit.index, s)
                    names.setdefault(id(module), (module, set()))[1].add(local)
        self._managed = [module for module, _ in names.values()]
        for module, local_names in names.values():
            managed = frozenset(local_names)
            module.__dict__[_GATHERER] = source
            module.__dict__["_parameters"] = _ForwardParameters(
                module._parameters, module, managed, source
            )
            module.__class__ = _managed_class(type(module), managed)

    def restore(self) -> None:
        """Every managed module gets its own class back."""
        for module in self._managed:
            module.__class__ = type(module)._zeroservice_original_class  # type: ignore[attr-defined]
            module.__dict__.pop(_GATHERER, None)
            module.__dict__["_parameters"] = dict(module._parameters)
        self._managed.clear()
