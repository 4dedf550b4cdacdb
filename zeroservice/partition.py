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

A *leaf* module (``stage3_leaf_modules``) is always a group of its own and never holds
another: its whole parameter set is gathered on entry, whatever its forward uses on
this rank (see [Note: leaf modules] in leaf_modules.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from .config import KNOWN_MOE_LEAVES, ConfigError

NamedParams = list[tuple[list[str], nn.Parameter]]


@dataclass
class Group:
    name: str
    """Qualified name of the module ("" for the root)."""
    module: nn.Module
    params: NamedParams
    """Owned parameters (trainable and frozen) in registration order, each with all its
    names."""
    leaf: bool = False
    """A leaf module (``stage3_leaf_modules``): its backward is gathered and reduced as
    one (see [Note: leaf modules] in leaf_modules.py)."""


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
    listed: set[int] = set()

    def shared_outside(qual: str, module: nn.Module) -> bool:
        return any(
            not n.startswith(qual + ".") for p in module.parameters() for n in registered[id(p)]
        )

    def items(qual: str, container: nn.Module) -> None:
        """A list's items are blocks; an item that is itself a container (a list of
        lists) is never called, so its items are. A module held at several places (one
        layer shared by every position) is one block, named by its first place."""
        for i, item in container.named_children():
            if isinstance(item, (nn.ModuleList, nn.ModuleDict)):
                items(f"{qual}.{i}", item)
            elif _param_count(item) > 0 and id(item) not in listed:
                listed.add(id(item))
                names.append(f"{qual}.{i}")

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            qual = f"{prefix}{child_name}"
            if isinstance(child, nn.ModuleList):
                items(qual, child)
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


def leaf_modules(root: nn.Module, leaves: Sequence[str]) -> list[str]:
    """Qualified names of the outermost modules that ``leaves`` names ("" for the root),
    each entry a class name (``"MixtralSparseMoeBlock"``) or a qualified module name
    (``"model.layers.0.mlp"``). An entry that names no module with parameters, or a
    container without a forward (a ModuleList), is refused by name: a misspelt one
    would leave the model to fail at its first divergent step. The known MoE layers
    (``config.KNOWN_MOE_LEAVES``) may be absent."""
    if not leaves:
        return []
    wanted = set(leaves)
    matched: set[str] = set()
    found: list[str] = []
    for qual, module in root.named_modules():
        hits = wanted & ({qual, type(module).__name__} - {""})
        if not hits or _param_count(module) == 0:
            continue
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            raise ConfigError(
                f"stage3_leaf_modules: {sorted(hits)[0]!r} names {qual or 'the model'}, a "
                f"{type(module).__name__}, which has no forward of its own to gather on: "
                "name the modules it holds (by their class)"
            )
        matched |= hits
        if not _under(qual, found):
            found.append(qual)
    missing = [name for name in leaves if name not in matched and name not in KNOWN_MOE_LEAVES]
    if missing:
        classes = sorted({type(m).__name__ for m in root.modules() if _param_count(m) > 0})
        raise ConfigError(
            f"stage3_leaf_modules: {', '.join(map(repr, missing))} names no module with "
            "parameters in the model (give a class name or a qualified module name; "
            f"classes with parameters: {', '.join(classes[:12])}"
            f"{' ...' if len(classes) > 12 else ''})"
        )
    return found


def build_groups(
    root: nn.Module, grouping: str, limit: int, leaves: Sequence[str] = ()
) -> list[Group]:
    """Groups in registration order, root first; each parameter owned by exactly one.

    The root is kept even when it owns nothing: its window spans the whole forward.
    A leaf module replaces every group inside it (the root named as a leaf: every
    group).
    """
    modules = dict(root.named_modules(remove_duplicate=False))
    leaf_names = leaf_modules(root, leaves)
    chosen = {n for n in group_modules(root, grouping, limit) if not _under(n, leaf_names)}
    chosen |= set(leaf_names) - {""}
    position = {qual: i for i, qual in enumerate(modules)}
    names = [""] + sorted(chosen, key=position.__getitem__)
    groups = {n: Group(n, modules[n], [], leaf=n in leaf_names) for n in names}
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


def _under(name: str, leaves: list[str]) -> bool:
    """``name`` is strictly inside one of ``leaves`` ("" is the root)."""
    return any(name.startswith(leaf + ".") or (leaf == "" and name) for leaf in leaves)
