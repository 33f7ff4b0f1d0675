"""The thread that completes the process group's torch futures.

A collective runs on the node's event loop; its torch future is completed here instead, on a
thread of ours: user callbacks chained on the future (``fut.then``) may block, and on the event
loop's thread they would stall every collective. Futures are completed in the order their
operations *finish*, not the order they were issued: a receive still waiting for its peer must
not hold back a collective that is done (the peer may need that collective to send).

The thread is stopped (joined) at the latest when Python exits, before the interpreter
finalizes: a daemon thread still inside torch there (``fut.set_result`` returns after the
waiter woke, and the trainer may be exiting by then) is ended by CPython with a forced unwind
through C++ frames that may not unwind, and the process aborts ("terminate called without an
active exception", exit 134) after a run that was otherwise complete.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

Finish = Callable[[Any], Any]  # the operation's result -> the future's value (may raise)
Context = Callable[[], contextlib.AbstractContextManager[Any]]


class Completer:
    """One thread that finishes operations as they complete: ``finish(result)`` (copies back
    into the caller's tensors), then completes the torch future, both inside ``context()``
    (a device's side stream, so the future's events are recorded on it)."""

    def __init__(self, rank: int) -> None:
        self._queue: queue.SimpleQueue[
            tuple[concurrent.futures.Future[Any], torch.futures.Future[Any], Finish,
                  Context] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"aioreduce-torch-{rank}",
                                        daemon=True)
        self._thread.start()
        # At exit at the latest: atexit runs before CPython freezes daemon threads.
        self._stop = weakref.finalize(self, _stop, self._queue, self._thread)

    def add(self, done: concurrent.futures.Future[Any], fut: torch.futures.Future[Any],
            finish: Finish, context: Context = contextlib.nullcontext) -> None:
        """Complete ``fut`` with ``finish(done's result)`` once ``done`` is done."""
        done.add_done_callback(lambda d: self._queue.put((d, fut, finish, context)))

    def stop(self) -> None:
        """Finish what is queued and end the thread (idempotent)."""
        self._stop()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._finish(*item)
            # Nothing of it stays bound here while we wait for the next: a result held would
            # keep its memory from being handed out again to the next step.
            del item

    @staticmethod
    def _finish(done: concurrent.futures.Future[Any], fut: torch.futures.Future[Any],
                finish: Finish, context: Context) -> None:
        with context():
            try:
                value = finish(done.result())
            except BaseException as exc:  # the caller sees it from Work.wait()
                fut.set_exception(exc)
            else:
                fut.set_result(value)


def _stop(q: queue.SimpleQueue[Any], thread: threading.Thread) -> None:
    q.put(None)
    if thread is not threading.current_thread():  # (stop() from a callback it runs)
        thread.join(timeout=10)
