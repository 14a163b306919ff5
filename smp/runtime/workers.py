"""The threads that run the microbatches' calls of ``@smp.step`` functions (:mod:`smp.engine.step_function`),
reused across steps: starting a thread per microbatch per step costs more than the rest of smp's per-step work. The pool
belongs to the process's :class:`smp.runtime.state.State`.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable

__all__ = ["Workers"]


class Workers:
    """Daemon threads that run tasks. A task may block for as long as the pipeline schedule needs, so a new
    thread starts whenever no idle one is left; one stuck for good (a step that failed) is simply not reused,
    and as a daemon it never holds up the interpreter's exit."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a task, or about to

    def submit(self, task: Callable[[], None]) -> None:
        """Run ``task`` on an idle thread, or on a new one."""
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        if spawn:
            threading.Thread(target=self._loop, name="smp-step", daemon=True).start()
        self._tasks.put(task)

    def _loop(self) -> None:
        while True:
            task = self._tasks.get()
            try:
                task()
            finally:
                del task  # an idle thread must not keep its last step (outputs, activations) alive
                with self._lock:
                    self._idle += 1
