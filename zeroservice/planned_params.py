"""The parameters as ``initialize`` planned them: the same objects, trainable or frozen,
in the same dtype and place. A change made later is refused by name at the next
training forward, before it runs.

[Note: the trainable set]
At ``initialize`` the engine plans which parameters train: each gets a place in a
trainable unit with a gradient buffer, an fp32 master and optimizer state; a frozen
one gets a unit of its own with none of them (see "Frozen parameters" in
docs/configuration.md). A flag flipped afterwards would be ignored without a word: a
parameter frozen since keeps its master and optimizer state, and the step goes on
moving it (momentum, weight decay, a zero gradient), while one unfrozen since has
nothing to train it with and stays as it was. A checkpoint loads into an engine built
over the model with more of it frozen; a parameter unfrozen since has no optimizer
state in a checkpoint, and the loader says so (checkpoint/load.py).

[Note: parameters the engine holds]
The engine holds the weights in its flat buffers: at stages 0-2 every parameter is a
view of one, at stage 3 a placeholder the gatherer fills. Five things cut a parameter
off from them without an error anywhere: a new ``nn.Parameter`` assigned to the module
(``model.head.weight = nn.Parameter(...)``), a conversion of the module
(``.bfloat16()``, ``.double()``, ``.to(device)``: torch gives each parameter a converted
copy), ``param.data = tensor``, a module replaced (``model.head = nn.Linear(...)``: the
old one keeps the old parameters, which the optimizer goes on stepping), and a module
or parameter added. The model would then compute with weights the optimizer never
updates: the losses stop improving while every step reports success.
So each training forward checks that every module still holds the children and the
parameter objects it held at ``initialize``, in the same dtype and on the same device,
and at stages 0-2 still viewing the engine's buffer at the same place. A forward under
``torch.no_grad()`` (an evaluation) is not checked. The flags are checked again at each
backward: flipped between a forward and its backward, they changed what autograd
computed (stage 2 failed on an assertion, stage 3 stepped the weight DDP leaves alone).

At stage 3 the modules compute with gathered copies, so a gradient hook on a
parameter would never run. ``initialize`` refuses one (construct.py); one registered
afterwards (``engine.module.head.weight.register_hook(...)``) is refused by the same
check, where it used to be skipped without a word: gradients clamped or scaled at
stages 0-2 went through whole at stage 3.
"""

from __future__ import annotations

import operator

from torch import nn

from .construct import gradient_hooked
from .naming import some_names

_HINT = (
    "Change the model before initialize (its dtype through precision='bf16'/'fp16', its "
    "device by moving it first), or load weights with engine.load_checkpoint or "
    "initialize(..., init=<file>)"
)


class PlannedParameters:
    """Every parameter as ``initialize`` left it: its owners, flag, dtype, device and
    (at stages 0-2, ``fixed_storage``) the address of its data; at stage 3 (storage
    not fixed: placeholders) no gradient hook on it."""

    def __init__(self, module: nn.Module, fixed_storage: bool):
        self._slots = [
            (owner, attr, param, f"{prefix}.{attr}" if prefix else attr)
            for prefix, owner in module.named_modules(remove_duplicate=False)
            for attr, param in owner._parameters.items()
            if param is not None
        ]
        named = list(module.named_parameters())
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._flags = [p.requires_grad for p in self._params]
        self._kinds = [(p.dtype, p.device) for p in self._params]
        self._fixed_storage = fixed_storage
        self._addresses = [p.data_ptr() for p in self._params] if fixed_storage else []
        self._accumulate_hooks = [_accumulate_hooks(p) for p in self._params]
        """At stages 0-2: each parameter's post-accumulate hooks, the engine's last."""
        seen: set[int] = set()
        self._tree = []
        """Per module (once each): its children and the names of its parameter slots."""
        for prefix, owner in module.named_modules(remove_duplicate=False):
            if id(owner) not in seen:
                seen.add(id(owner))
                children = dict(owner._modules)
                values = tuple(children.values())
                self._tree.append((prefix, owner, children, values, tuple(owner._parameters)))

    def check(self) -> None:
        """Raise if a parameter was replaced, converted, re-pointed or (un)frozen, or a
        module replaced or added."""
        self._check_tree()
        replaced = [
            name for owner, attr, p, name in self._slots if owner._parameters.get(attr) is not p
        ]
        if replaced:
            raise RuntimeError(
                f"forward: {some_names(sorted(set(replaced)), 5)} replaced after initialize "
                "by another parameter (a new nn.Parameter assigned to the module): the "
                "engine trains the parameters it was given, and the new one would never "
                f"be updated. {_HINT}"
            )
        self._check_kinds()
        self.check_flags()
        if not self._fixed_storage:
            self._check_no_hooks()
        else:
            self._check_accumulate_hooks()

    def _check_tree(self) -> None:
        """A module replaced (``model.head = nn.Linear(...)``) keeps its old parameters
        in the old module, where the slot check still finds them: the new module's
        weights would never be updated, the old ones stepped on zero gradients. A
        module or parameter added would never be updated either."""
        changed = []
        for prefix, owner, was, values, slots in self._tree:
            now = owner._modules
            if len(now) != len(values) or any(map(operator.is_not, now.values(), values)):
                changed += [
                    f"{prefix}.{k}" if prefix else k
                    for k in sorted(set(was) | set(now))
                    if now.get(k) is not was.get(k)
                ]
            if len(owner._parameters) != len(slots):
                changed += [
                    f"{prefix}.{k}" if prefix else k
                    for k in set(slots).symmetric_difference(owner._parameters)
                ]
        if changed:
            raise RuntimeError(
                f"forward: {some_names(sorted(set(changed)), 5)} replaced or added after "
                "initialize (a module assigned, a module or parameter registered): the "
                "engine trains the parameters it was given, so the new weights would never "
                f"be updated and the old ones would go on being stepped. {_HINT}; to change "
                "the model, save a checkpoint and build a new engine over the changed model"
            )

    def _check_kinds(self) -> None:
        kinds = [(p.dtype, p.device) for p in self._params]
        moved = [
            i for i, (was, now) in enumerate(zip(self._kinds, kinds, strict=True)) if was != now
        ]
        if moved:
            i = moved[0]
            (dtype, device), (was_dtype, was_device) = kinds[i], self._kinds[i]
            raise RuntimeError(
                f"forward: {some_names([self._names[j] for j in moved], 5)} converted after "
                f"initialize ({self._names[i]} is {dtype} on {device}, was {was_dtype} on "
                f"{was_device}: module.to(), .half(), .bfloat16(), .cuda()): the engine's "
                "buffers hold the weights, and a converted copy would never be updated. "
                f"{_HINT}"
            )
        if self._fixed_storage:
            cut = [
                name
                for name, p, address in zip(self._names, self._params, self._addresses, strict=True)
                if p.data_ptr() != address
            ]
            if cut:
                raise RuntimeError(
                    f"forward: {some_names(cut, 5)} no longer view the engine's buffers "
                    "(param.data assigned, or the module's storage moved, after "
                    "initialize): the model would compute with weights the optimizer never "
                    f"updates. {_HINT}"
                )

    def check_flags(self, when: str = "forward") -> None:
        """Raise if a parameter was (un)frozen: at each training forward, and at each
        backward too, since a flag flipped between a forward and its backward changes
        what autograd computes (a gradient skipped) after the forward's check."""
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
            f"{when}: requires_grad changed after initialize ({'; '.join(changed)}). "
            "The engine fixed at initialize which parameters train (gradient buffers, "
            "fp32 masters, optimizer state): it would go on stepping a parameter frozen "
            "since, and leave one unfrozen since as it was. Restore the flags, or save a "
            "checkpoint and build a new engine over the model with its new flags (a "
            "checkpoint loads where more is frozen; for a parameter unfrozen since it "
            "holds no optimizer state, so start that engine with init=<the weights from "
            "`zeroservice checkpoint export`>)"
        )

    def _check_accumulate_hooks(self) -> None:
        """A post-accumulate hook added after ``initialize`` would run after the engine's,
        which has already reduced (stages 0-1) or staged and freed (stage 2) the
        gradient: a hook that clamps or scales it would change nothing, or meet None."""
        added = [
            n
            for n, p, had in zip(self._names, self._params, self._accumulate_hooks, strict=True)
            if _accumulate_hooks(p) > had
        ]
        if added:
            raise RuntimeError(
                f"forward: {some_names(added, 5)} carry post-accumulate gradient hooks "
                "registered after initialize (register_post_accumulate_grad_hook): they "
                "would run after the engine's own, which has already reduced the "
                "gradient. Register them before initialize (they then run first, as under "
                "DDP), or use register_hook"
            )

    def _check_no_hooks(self) -> None:
        hooked = gradient_hooked(zip(self._names, self._params, strict=True))
        if hooked:
            raise RuntimeError(
                f"forward: {some_names(hooked, 5)} carry gradient hooks registered after "
                "initialize (register_hook, register_post_accumulate_grad_hook). Stage 3 "
                "partitions parameters and the modules compute with gathered copies, so "
                "the hooks would never run: change the gradient in the module's forward "
                "instead, or use stage 0, 1 or 2"
            )


def _accumulate_hooks(param: nn.Parameter) -> int:
    return len(getattr(param, "_post_accumulate_grad_hooks", None) or {})
