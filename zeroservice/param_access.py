"""Stage 3: what a module sees as ``self.weight`` while its parameters are partitioned.

Each module that registers a partitioned parameter gets its class swapped for a
subclass whose properties read the parameter through the gatherer (see [Note: gather
and release] in gather.py); ``restore`` gives every module its own class back. The
registered ``nn.Parameter`` stays in place as an empty placeholder, so
``parameters()``, dtype and device queries keep working.
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
            module.__dict__[_GATHERER] = source
            module.__class__ = _managed_class(type(module), frozenset(local_names))

    def restore(self) -> None:
        """Every managed module gets its own class back."""
        for module in self._managed:
            module.__class__ = type(module)._zeroservice_original_class  # type: ignore[attr-defined]
            module.__dict__.pop(_GATHERER, None)
        self._managed.clear()
