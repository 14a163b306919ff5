"""Sends in flight: each posted send is waited on as soon as it can be, so that its tensor is freed once it has gone.

A posted send's work holds its tensor until somebody waits on it. NCCL's work says when it is done
(``is_completed``), so the finished ones are dropped as new ones are posted, and no thread ever blocks. Gloo's
does not: its ``is_completed`` stays False until ``wait`` is called, and a ``wait`` with a short timeout breaks the
send. Left to the step's final flush, every message a rank sent in a step would stay alive until the step ends
(on the last stage of GPT-2 with its LM head split over two stages, 13 MB of gradients per microbatch), and the
memory the next microbatches allocate would come fresh from the kernel. So for gloo a daemon thread waits on the
sends of :data:`WAITED_BYTES` or more in the order they were posted (smaller ones wait for the flush: each hand-over
costs the step's thread a wake-up and the GIL, 2 % of T5's step when every message went through it); the step's
thread never blocks on one before :meth:`SendsInFlight.flush`, and an error that thread met is raised by the step's
next call here.
"""
from __future__ import annotations

import queue
import threading
import weakref
from typing import Any, Callable

__all__ = ["SendsInFlight", "WAITED_BYTES"]

WAITED_BYTES = 1 << 20  # sends this large are waited on by the thread as they go

Wait = Callable[[Any, int, str], None]  # (work, peer, what): waits, or raises the transport's named error


class SendsInFlight:
    """The sends posted and not yet known to be done. ``waiter``: a thread waits on them as they come (gloo)
    rather than the completed ones being dropped as new ones are posted (backends whose work reports it). ``wait``
    is a bound method (the transport's), which the thread holds weakly."""

    def __init__(self, wait: Wait, waiter: bool):
        self._wait = wait
        self._posted: list[tuple[Any, int, str]] = []
        self._queue: queue.Queue | None = None
        self._error: list[BaseException] = []  # what the waiting thread met, for the step's thread to raise
        if waiter:
            self._queue = queue.Queue()
            # A weak reference: the thread must not keep its transport (and so this object) alive.
            threading.Thread(target=_wait_in_order, args=(self._queue, weakref.WeakMethod(wait), self._error),
                             daemon=True, name="smp-pipeline-sends").start()
            weakref.finalize(self, self._queue.put, None)  # ends the thread with this object

    def __len__(self) -> int:
        return len(self._posted) + (self._queue.unfinished_tasks if self._queue is not None else 0)

    def add(self, work: Any, peer: int, what: str, nbytes: int) -> None:
        """Track a send of ``nbytes`` just posted (``what`` describes it in errors)."""
        self._raise()
        if self._queue is not None:
            if nbytes >= WAITED_BYTES:
                self._queue.put((work, peer, what))
            else:
                self._posted.append((work, peer, what))
            return
        self._posted = [p for p in self._posted if not p[0].is_completed()]
        self._posted.append((work, peer, what))

    def flush(self) -> None:
        """Wait until every send posted is done; raise the first error any of them met."""
        posted, self._posted = self._posted, []
        if self._queue is not None:
            self._queue.join()
            self._raise()
        for work, peer, what in posted:
            self._wait(work, peer, what)

    def clear(self) -> None:
        """Forget every send (the transport failed and closed its groups: waiting on them would only fail)."""
        self._posted = []
        while self._queue is not None:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
            self._queue.task_done()
        self._error.clear()

    def _raise(self) -> None:
        if self._error:
            raise self._error.pop(0)


def _wait_in_order(q: queue.Queue, target: Callable[[], Wait | None], errors: list[BaseException]) -> None:
    """The waiting thread: wait on each send in turn, keeping the first error (later ones follow from it)."""
    while True:
        item = q.get()
        wait = target() if item is not None else None
        try:
            if wait is None:
                return
            if not errors:
                wait(*item)
        except BaseException as exc:  # handed to the step's thread, which raises it
            errors.append(exc)
        finally:
            item = wait = None  # neither the work (with its tensor) nor the transport is held while idle
            q.task_done()
