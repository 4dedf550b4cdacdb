"""Stage 3: which modules gather their parameters together, and who owns each parameter.

[Note: gather groups]
At stage 3 a parameter exists whole only inside the forward (and the backward) of
the module that uses it. Gathering happens per *group*: a module whose forward
gathers every unit it owns on entry and releases them on exit. The root module is
always a group, so a parameter owned by it (embeddings, the final norm, a head
tied to the embedding) stays gathered for the whole forward. Groups nest: a block
is gathered inside the root's window.

A parameter belongs to the innermost group that registers it (the first
registration if it is shared). Its group's units hold it; a use from another group
is served by gathering its units on demand (see gather.py), never by a stale copy.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

NamedParams = list[tuple[list[str], nn.Parameter]]


@dataclass
class Group:
    name: str
    """Qualified name of the module ("" for the root)."""
    module: nn.Module
    params: NamedParams
    """Owned parameters (trainable and frozen) in registration order, each with all its
    names."""


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _contains_list(module: nn.Module) -> bool:
    return any(isinstance(m, nn.ModuleList) for m in module.modules())


def _block_modules(root: nn.Module) -> list[str]:
    """Items of every nn.ModuleList that hold trainable parameters (outermost lists only),
    and the modules beside them (embeddings, final norm, head) unless they share a
    parameter with a module elsewhere: those stay with the root, which serves both uses
    from one gather."""
    registered: dict[int, list[str]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        registered.setdefault(id(p), []).append(name)
    names: list[str] = []

    def shared_outside(qual: str, module: nn.Module) -> bool:
        return any(
            not n.startswith(qual + ".") for p in module.parameters() for n in registered[id(p)]
        )

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            qual = f"{prefix}{child_name}"
            if isinstance(child, nn.ModuleList):
                names.extend(
                    f"{qual}.{i}" for i, item in enumerate(child) if _param_count(item) > 0
                )
            elif _contains_list(child):
                visit(f"{qual}.", child)
            elif _param_count(child) > 0 and not shared_outside(qual, child):
                names.append(qual)

    if not _contains_list(root):
        return []  # no blocks: group by size instead
    visit("", root)
    return names


def _size_modules(root: nn.Module, limit: int) -> list[str]:
    """The largest modules of at most ``limit`` parameters, descending from the root."""
    names: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            qual = f"{prefix}{child_name}"
            size = _param_count(child)
            if size == 0:
                continue
            if size <= limit or not any(True for _ in child.children()):
                names.append(qual)
            else:
                visit(f"{qual}.", child)

    visit("", root)
    return names


def group_modules(root: nn.Module, grouping: str, limit: int) -> list[str]:
    """Qualified names of the group modules besides the root. See [Note: gather groups]."""
    if grouping == "blocks":
        blocks = _block_modules(root)
        if blocks:
            return blocks
    return _size_modules(root, limit)


def build_groups(root: nn.Module, grouping: str, limit: int) -> list[Group]:
    """Groups in registration order, root first; each parameter owned by exactly one.

    The root is kept even when it owns nothing: its window spans the whole forward.
    """
    modules = dict(root.named_modules(remove_duplicate=False))
    names = [""] + group_modules(root, grouping, limit)
    groups = {n: Group(n, modules[n], []) for n in names}
    owners = sorted(names, key=len, reverse=True)  # innermost first

    seen: dict[int, list[str]] = {}
    order: list[tuple[str, nn.Parameter]] = []
    for qual, p in root.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen[id(p)] = []
            order.append((qual, p))
        seen[id(p)].append(qual)
    for qual, p in order:
        owner = next(g for g in owners if g == "" or qual.startswith(g + "."))
        groups[owner].params.append((seen[id(p)], p))
    return [groups[n] for n in names if n == "" or groups[n].params]
