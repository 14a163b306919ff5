"""The environment a rank's process starts with: what ``smp launch`` and :func:`smp.testing.run_ranks` add.

``THP_MEM_ALLOC_ENABLE=1``: PyTorch's CPU allocator then backs every tensor of 2 MiB or more with
transparent huge pages (``madvise(MADV_HUGEPAGE)``, ``c10/core/impl/alloc_cpu.cpp``). Linux's default THP
mode, ``madvise``, otherwise backs them with 4 KiB pages, each a page fault on first touch, and a training
step allocates its large tensors afresh: a GPT-2 with its 50,257-token vocabulary has 51 MB of logits per
microbatch, and its last pipeline stage took half a million page faults per step, about a fifth of the
step (``benchmarks/end_to_end.py``; on this 2-core host the step went from 4.49 s to 3.52 s with it). PyTorch
reads the variable once, at its first allocation, so it must be in the environment the process starts
with. A value the user set is kept. GPU memory is not affected.

A world of one that ``smp.init`` makes without torchrun, and :func:`smp.testing.run_ranks`, listen on a
:func:`free_port` of localhost.
"""
from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from typing import Iterator

__all__ = ["RANK_ENV", "CONSOLE_RANK_ENV", "TRACEBACK_LOG", "rank_environment", "added_environment", "free_port"]

RANK_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}
# Set by `smp launch`: the local rank whose stderr is the console (the others' goes to their log files), where
# smp.cli.worker writes a failure's traceback to TRACEBACK_LOG in the rank's log folder, not to the console, because
# the launch reports the cause itself and names that file.
CONSOLE_RANK_ENV = "SMP_LAUNCH_CONSOLE_RANK"
TRACEBACK_LOG = "traceback.log"


@contextmanager
def rank_environment() -> Iterator[None]:
    """Add :data:`RANK_ENV`'s variables the user has not set to ``os.environ`` (which processes started
    inside inherit), and take them away again after."""
    with added_environment({k: v for k, v in RANK_ENV.items() if k not in os.environ}):
        yield


@contextmanager
def added_environment(added: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``added`` (processes started inside inherit it), and those keys taken away again after."""
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
