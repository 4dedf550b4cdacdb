"""Waits on collectives that another thread can end.

[Note: interrupting a collective]
On gloo a receive whose sender dies in the middle of the message never completes: the
broken connection fails the receives posted after it, but the one in progress waits for
the process group's timeout (the job's step timeout, minutes). Measured with two
processes on this machine: a peer killed 1-6 ms into sending 64 MiB, as one message or
as 1 MiB or 256 KiB messages, left the receiver waiting for the full timeout in 7 of 8
runs; killed before it sent anything or after its last message, the receiver failed at
once. ProcessGroupGloo's ``abort()`` does not end the wait either. So a rank that
survives a lost peer could stay inside a collective long after the supervisor knew the
peer was gone, and the group could not re-form without it.

Every wait on an engine's gloo collectives therefore runs where another thread can
abandon it: a ring's transfers run on the ring's thread already (ring.py), and a native
op's ``work.wait()`` runs on a waiter thread. The training thread blocks on whichever
comes first, the collective's completion or the engine's :class:`Interrupt`.
``Engine.interrupt(reason)`` (the supervisor calls it on every surviving rank once the
lost ones are killed) makes each wait in progress, and every one after, raise
:class:`CommInterrupted` at once. The abandoned thread stays blocked until the group's
timeout and then ends with an error nobody reads; destroying the process group meanwhile
does not wait for it, and a new group forms beside it. An interrupted engine is only
closed. On NCCL ``work.wait()`` does not block the host, and nothing is moved off it.

[Note: a forward given up]
A wait is where a rank learns that its peer is gone, and at stages 0-2 a forward has
no collective: a survivor interrupted early in a forward computed the rest of it, and
the backward up to its first reduction, for a step that will never be taken, before its
call ended and the group could re-form: on a large model, up to a forward's length
(the 267 M GPT's forward and backward take about 2 s on a 2-core CPU). So an engine
also checks its interrupt before the forward of every module that holds parameters
(``stop_forwards``): an interrupted forward (or a recomputation in backward) raises
CommInterrupted at the next such module.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from .serial import SerialThread

if TYPE_CHECKING:
    from torch import nn
    from torch.utils.hooks import RemovableHandle

T = TypeVar("T")


class CommInterrupted(RuntimeError):
    """A collective was abandoned: its group is being given up (a peer was lost)."""


class Interrupt:
    """One engine's switch that ends its collective waits (see the note above)."""

    def __init__(self) -> None:
        self._fired: Future[str] = Future()
        self._waiter: SerialThread | None = None
        self._lock = threading.Lock()

    @property
    def fired(self) -> bool:
        return self._fired.done()

    def fire(self, reason: str) -> None:
        """End every wait in progress and to come with CommInterrupted(reason)."""
        with contextlib.suppress(futures.InvalidStateError):  # the first reason stays
            self._fired.set_result(reason)

    def check(self) -> None:
        """Raise CommInterrupted if this has fired (between collectives: see [Note: a
        forward given up])."""
        if self._fired.done():
            raise CommInterrupted(f"step abandoned: {self._fired.result()}")

    def result(self, future: Future[T]) -> T:
        """``future``'s result, or CommInterrupted as soon as this fires."""
        if not future.done():
            either: list[Future[Any]] = [future, self._fired]
            futures.wait(either, return_when=futures.FIRST_COMPLETED)
            if not future.done():
                # See [Note: a failed call holds nothing] in serial.py: this frame stays
                # in CommInterrupted's traceback, and must not keep the abandoned call.
                del future, either
                raise CommInterrupted(f"collective abandoned: {self._fired.result()}")
        return future.result()

    def run(self, blocking: Callable[[], T]) -> T:
        """``blocking()`` run on the waiter thread (jobs in submission order), and its
        result waited for through :meth:`result`."""
        if self.fired:
            raise CommInterrupted(f"collective abandoned: {self._fired.result()}")
        with self._lock:
            if self._waiter is None:
                self._waiter = SerialThread("zeroservice-wait")
            waiter = self._waiter
        future = waiter.submit(blocking)
        del blocking, waiter
        try:
            return self.result(future)
        except CommInterrupted:
            del future  # see [Note: a failed call holds nothing] in serial.py
            raise

    def close(self) -> None:
        """Let the waiter thread end once its job is done (never joined: after an
        interrupt it may be blocked until the group's timeout)."""
        with self._lock:
            if self._waiter is not None:
                self._waiter.stop(wait=False)
                self._waiter = None


def stop_forwards(module: nn.Module, interrupt: Interrupt) -> list[RemovableHandle]:
    """A forward pre-hook on every submodule of ``module`` that holds parameters of its
    own, raising CommInterrupted once ``interrupt`` has fired; the handles, to remove
    them. See [Note: a forward given up]."""

    def pre_forward(_module: nn.Module, _args: Any) -> None:
        interrupt.check()

    return [
        m.register_forward_pre_hook(pre_forward)
        for m in module.modules()
        if next(m.parameters(recurse=False), None) is not None
    ]
