"""Which elements of which parameters a rank holds: the bridge between flat units and a
checkpoint stored per parameter.

A checkpoint names parameters, not units: units depend on the stage, the bucket
size and the padding to N_d, none of which should bind the reader. A rank's master
(and each optimizer state) covers its owned range of every unit; intersected with
a parameter's slot, that is a *piece*: a contiguous element range of the flattened
parameter, at a known position in the rank's master tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..flat import FlatUnit, ParamSlot


@dataclass(frozen=True)
class Piece:
    unit: FlatUnit
    slot: ParamSlot
    start: int
    """First element of the flattened parameter held here."""
    end: int
    local: int
    """Where ``start`` sits in this rank's master tensor of the unit."""


def held_pieces(units: list[FlatUnit], whole: bool) -> list[Piece]:
    """The pieces of every parameter this rank's masters hold.

    ``whole``: the masters are whole units (stage 0); else this rank's shards.
    """
    pieces = []
    for unit in units:
        lo, hi = (0, unit.padded_numel) if whole else unit.shard_range
        for slot in unit.slots:
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                pieces.append(Piece(unit, slot, a - slot.offset, b - slot.offset, a - lo))
    return pieces
