"""Point-to-point transport between pipeline ranks, with bounded waits and named failures.

Sends and receives are ``torch.distributed`` ``isend``/``irecv`` on the runner's own process group
(gloo on CPU, NCCL on CUDA). Every message carries a tag derived from (value, microbatch, direction) so
gloo matches messages exactly; receive buffers are allocated from the traced shapes, so steady state
needs no metadata messages.

Failure behaviour: every wait is bounded by ``timeout_s``. A rank that fails writes one line into the
distributed store and tears down the pipeline's process group, so peers blocked on it fail at once
(gloo closes the connections) instead of waiting out the timeout; they then read the line back and
raise :class:`PeerError` naming the failed rank and its error.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from partitioner.errors import EngineError

__all__ = ["Transport", "PeerError", "FAILURE_KEY"]

FAILURE_KEY = "smp/pipeline/failure"


class PeerError(EngineError, RuntimeError):
    """Another rank failed, hung or went away; the message names it."""


def _default_store() -> Any:
    try:  # the default group's store is where every rank can leave a note; private, hence guarded
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


@dataclass
class Transport:
    group: Any
    rank: int
    timeout_s: float = 60.0
    store: Any = field(default_factory=_default_store)
    pending: list[tuple[Any, int, str]] = field(default_factory=list)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, what: str) -> None:
        work = dist.isend(tensor, dst=dst, group=self.group, tag=tag)
        self.pending.append((work, dst, what))
        if len(self.pending) > 64:  # keep the list short; completed sends need no wait
            self.pending = [p for p in self.pending if not p[0].is_completed()]

    def irecv(self, buffer: torch.Tensor, src: int, tag: int) -> Any:
        """Post one receive; :meth:`wait` on the returned work (with the peer and a description)."""
        return dist.irecv(buffer, src=src, group=self.group, tag=tag)

    def recv(self, buffers: list[tuple[torch.Tensor, int, int, str]]) -> None:
        """Receive every (buffer, src, tag, what) and wait for all of them."""
        works = [(dist.irecv(buf, src=src, group=self.group, tag=tag), src, what) for buf, src, tag, what in buffers]
        for work, src, what in works:
            self.wait(work, src, what)

    def flush(self) -> None:
        for work, dst, what in self.pending:
            self.wait(work, dst, what)
        self.pending.clear()

    def wait(self, work: Any, peer: int, what: str) -> None:
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:
            note = self.failure_note()
            reason = note or (f"no answer within {self.timeout_s:g} s or the connection closed "
                              f"({str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}); "
                              f"rank {peer} has likely died or hung")
            raise PeerError(f"rank {self.rank}: {what} with rank {peer} failed: {reason}") from None

    def failure_note(self) -> str | None:
        if self.store is None:
            return None
        try:
            if self.store.check([FAILURE_KEY]):
                return self.store.get(FAILURE_KEY).decode()
        except Exception:
            return None
        return None

    def report_failure(self, exc: BaseException) -> None:
        """Leave a note for the other ranks and close our connections so they stop waiting on us."""
        if self.store is not None and not isinstance(exc, PeerError):
            try:
                if not self.store.check([FAILURE_KEY]):
                    self.store.set(FAILURE_KEY, f"rank {self.rank} failed: {type(exc).__name__}: {exc}")
            except Exception:
                pass
        if self.group is None:  # already closed: never fall through to destroying the default group
            return
        try:
            dist.destroy_process_group(self.group)
        except Exception:
            pass
        self.group = None
