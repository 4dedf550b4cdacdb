"""Where the engine is inside an optimizer step: one enum, one cell that every component
reads (the engine moves it; the reducer and the gatherer only look)."""

from __future__ import annotations

import enum


class TrainingState(enum.Enum):
    """Each state says what the rank holds in it."""

    IDLE = "idle"
    """Between steps. No gradient held (buffers zeroed); parameters whole at stages 0-2,
    only shards and persistent units at stage 3. A forward may run."""
    BACKWARD = "backward"
    """Inside ``engine.backward`` on a micro-batch whose gradients stay on this rank
    (stages 0/1 before the step's last micro-batch): autograd accumulates in place."""
    REDUCING = "reducing"
    """Inside ``engine.backward`` with reductions armed: each finished unit leaves the
    rank through the staging buffers (stage 3: gathered again for its backward)."""
    ACCUMULATED = "accumulated"
    """After a backward, before the step: gradients held (full, or this rank's shards).
    A forward for the next micro-batch may run."""
    STEPPING = "stepping"
    """Inside ``engine.step``: the optimizer updates this rank's masters; parameters
    are gathered whole again (stages 1/2) before it returns to IDLE."""

    @property
    def in_backward(self) -> bool:
        return self in (TrainingState.BACKWARD, TrainingState.REDUCING)


class Pass(enum.Enum):
    """Which pass a stage-3 gather serves: each records its own order (see [Note:
    prefetch] in gather.py)."""

    FORWARD = "forward"
    BACKWARD = "backward"


_ALLOWED = {
    TrainingState.IDLE: {TrainingState.BACKWARD, TrainingState.REDUCING},
    TrainingState.BACKWARD: {TrainingState.ACCUMULATED},
    TrainingState.REDUCING: {TrainingState.ACCUMULATED},
    TrainingState.ACCUMULATED: {
        TrainingState.BACKWARD,
        TrainingState.REDUCING,
        TrainingState.STEPPING,
    },
    TrainingState.STEPPING: {TrainingState.IDLE, TrainingState.ACCUMULATED},
}
"""Every transition the engine makes; anything else is a bug or a misuse."""


class StateCell:
    """The engine's current ``TrainingState``, shared by reference with its components."""

    def __init__(self) -> None:
        self.value = TrainingState.IDLE

    def move(self, to: TrainingState) -> TrainingState:
        """Go to ``to`` from the current state; returns the state left."""
        left = self.value
        if to not in _ALLOWED[left]:
            raise RuntimeError(f"engine state: {left.value} -> {to.value} is not a step transition")
        self.value = to
        return left

    def reset_to(self, state: TrainingState) -> None:
        """Back to the state a backward or step left when it raised (a user's error in
        the loss, an autograd error): the call may be made again."""
        self.value = state
