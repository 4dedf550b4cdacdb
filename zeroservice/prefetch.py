"""Stage 3: each pass gathers ahead along the order the previous pass of its kind used.

[Note: prefetch]
Each pass (forward, backward) records the order in which it requested units. The
next pass follows the recorded order: on each request it issues the gathers of the
units that come next, as long as the gathered elements (including in-flight
gathers) stay within ``stage3_prefetch_elements``. A request that departs from the
plan stops prefetching for the rest of that pass, and the pass's own order becomes
the next plan. Decisions depend only on counts, never on timing, so every rank
issues the same collectives in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .state import Pass


@dataclass
class _Order:
    plan: list[int] = field(default_factory=list)
    current: list[int] = field(default_factory=list)
    pos: int = 0
    following: bool = False


class PrefetchPlan:
    """The recorded order of each pass and where the running pass stands in it."""

    def __init__(self) -> None:
        self._orders = {Pass.FORWARD: _Order(), Pass.BACKWARD: _Order()}

    def begin(self, phase: Pass) -> None:
        order = self._orders[phase]
        order.current, order.pos, order.following = [], 0, bool(order.plan)

    def end(self, phase: Pass) -> None:
        order = self._orders[phase]
        order.plan, order.current = order.current, []

    def record(self, index: int, phase: Pass) -> bool:
        """Note a request; True while the pass still follows the plan."""
        order = self._orders[phase]
        order.current.append(index)
        if order.following and order.pos < len(order.plan) and order.plan[order.pos] == index:
            order.pos += 1
        else:
            order.following = False
        return order.following

    def recorded(self, phase: Pass) -> list[int]:
        """The order the last finished pass of this kind requested its units in."""
        return list(self._orders[phase].plan)

    def remaining(self, phase: Pass) -> list[int] | None:
        """The units the running pass has still to request, or None once it left the
        plan (or had none to follow)."""
        order = self._orders[phase]
        return order.plan[order.pos :] if order.following else None

    def upcoming(self, phase: Pass) -> list[int]:
        """The units the plan says come next, in order."""
        order = self._orders[phase]
        return order.plan[order.pos :]
