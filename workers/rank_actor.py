"""The class Ray creates for a rank: a shell that imports nothing heavy, so that the
job's settings are in the process before torch loads (see [Note: rank settings in
process] in rank_env.py), and then hands every call to the ``RankWorker`` it builds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .rank_env import apply_in_process

FORWARDED_CALLS = (
    "address",
    "open_rendezvous",
    "setup",
    "regroup",
    "membership",
    "train",
    "save",
    "interrupt",
    "settle",
    "progress",
    "stats",
    "close",
)
"""``RankWorker``'s public methods, each a remote method of the actor."""


class RankActor:
    """A rank actor: ``env`` (``actor_env``) applied in this process, then a
    ``RankWorker(*args)``."""

    def __init__(self, env: Mapping[str, str], *args: Any) -> None:
        apply_in_process(env)
        from .rank import RankWorker  # torch loads here, under ``env``

        self.worker = RankWorker(*args)


def _forward(name: str) -> Callable[..., Any]:
    def call(self: RankActor, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"``RankWorker.{name}``."
    return call


for _name in FORWARDED_CALLS:
    setattr(RankActor, _name, _forward(_name))
