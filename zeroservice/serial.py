"""Calls run one after another on one background thread.

A daemon thread, unlike ``ThreadPoolExecutor``'s workers (joined at interpreter exit):
a call left blocked after an interrupt (a transfer from a peer that died in the middle
of a message, see [Note: interrupting a collective] in interrupt.py) must delay neither
``Engine.close()`` nor the process's exit. Calls that end normally are joined by
``stop(wait=True)``.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class SerialThread:
    """Runs submitted calls in submission order on one daemon thread."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._stopped = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"{self._thread.name}: submitted after stop()")
            self._jobs.put((lambda: fn(*args), future))
        return future

    def stop(self, wait: bool = True) -> None:
        """End the thread once the calls queued are done, joining it (``wait``); or
        cancel the calls not started and leave the one in progress (never joined)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            if not wait:
                while True:
                    try:
                        job = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    if job is not None:
                        job[1].cancel()
            self._jobs.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, future = job
            del job  # waiting for the next call, this frame holds nothing of the last
            _run(fn, future)
            del fn, future


def _run(fn: Callable[[], Any], future: Future[Any]) -> None:
    """``fn()`` into ``future``.

    [Note: a failed call holds nothing]
    A failed call's exception keeps its traceback, and the traceback keeps every frame
    it passed with its locals: this one, the call's, and the collective's with its
    tensors. Were the future still a local here, future → exception → traceback →
    this frame → future would be a cycle that only a full collection frees, and a
    collective abandoned after an interrupt would keep its buffers (on a 267 M GPT,
    several GiB of a survivor's memory) until the next one. So the call goes before
    the future gets the exception and the future right after: once its waiter has
    dropped it, all of it is freed by reference counting."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as exc:  # handed to whoever waits on the future
        del fn
        future.set_exception(exc)
        del future


class OrderedCollectives:
    """Base of the collectives that run as jobs on their own serial thread (rings,
    shared memory): jobs run in submission order, which is the same on every rank, so
    the transfers of two jobs never cross."""

    def __init__(self, name: str) -> None:
        self._thread = SerialThread(name)
        # A script that never calls engine.close() still stops and joins the thread at
        # interpreter exit, before torch.distributed's own teardown.
        self._stop = weakref.finalize(self, self._thread.stop, wait=True)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the thread; ``wait=False`` drops the queued jobs and leaves a transfer
        in progress to its group's timeout (after an interrupt: see interrupt.py) on a
        daemon thread that does not hold up the process's exit."""
        if wait:
            self._stop()
        else:
            self._stop.detach()
            self._thread.stop(wait=False)
