"""Point-to-point transport between pipeline ranks, with bounded waits and named failures.

Sends and receives are ``torch.distributed`` ``isend``/``irecv`` on the runner's own process group
(gloo on CPU, NCCL on CUDA). Every message carries a tag derived from (value, microbatch, direction) so
gloo matches messages exactly; receive buffers are allocated from the traced shapes, so steady state
needs no metadata messages.

Failure behaviour: every wait is bounded by ``timeout_s`` (point-to-point waits here; collectives by the
timeout their process group was created with). The first rank to see a failure — its own error, or a
peer that closed its connections or did not answer in time — writes one line naming the failed rank into
the distributed store (set only if absent, so the first observation wins) and tears down its process
groups, so peers blocked on it fail at once (gloo closes the connections) instead of waiting out the
timeout. Every rank that fails later reads the line back and raises :class:`PeerError` with it, so each
rank names the rank that failed first rather than the neighbour whose connection happened to close.
"""
from __future__ import annotations

import datetime
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from partitioner.errors import EngineError
from pipeline.sends import SendsInFlight

__all__ = ["Transport", "PeerError", "FAILURE_KEY", "default_store", "failure_note", "named_failures", "close_groups",
           "report_failure"]

FAILURE_KEY = "smp/pipeline/failure"


class PeerError(EngineError, RuntimeError):
    """Another rank failed, hung or went away; the message names it. ``culprit`` is that rank when this
    rank saw it first (no note in the store yet), so :func:`report_failure` can write the note."""

    def __init__(self, message: str, culprit: int | None = None):
        super().__init__(message)
        self.culprit = culprit


def default_store() -> Any:
    """The default process group's store, where every rank can leave a note (None if there is none)."""
    try:  # private, hence guarded
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def failure_note(store: Any) -> str | None:
    """The line the first failing rank left, if any."""
    if store is None:
        return None
    try:
        if store.check([FAILURE_KEY]):
            return store.get(FAILURE_KEY).decode()
    except Exception:
        return None
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def peer_error(rank: int, what: str, peers: list[int], exc: BaseException, timeout_s: float | None,
               store: Any) -> PeerError:
    """The error for a wait or collective of ``rank`` with ``peers`` that raised ``exc``: the failure note
    when there is one, else the peers that did not answer (the culprit when there is just one)."""
    note = failure_note(store)
    if note is not None:
        return PeerError(f"rank {rank}: {what} failed: {note}")
    who = f"rank {peers[0]}" if len(peers) == 1 else f"one of ranks {peers}" if peers else "another rank"
    text = str(exc).lower()
    if "closed" in text or "reset by peer" in text:
        reason = f"{who} closed the connection: it has likely died"
    elif "timed out" in text or "timeout" in text:
        within = f"within {timeout_s:g} s" if timeout_s is not None else "in time"
        reason = f"no answer {within}: {who} has likely hung (if it is only busy for longer, raise timeout_s)"
    else:
        reason = f"{_first_line(exc)}; {who} has likely died or hung"
    return PeerError(f"rank {rank}: {what} failed: {reason}", culprit=peers[0] if len(peers) == 1 else None)


@contextmanager
def named_failures(what: str, peers: list[int], rank: int, timeout_s: float | None = None,
                   store: Any = None) -> Iterator[None]:
    """Turn a failed ``torch.distributed`` call inside the block (a timeout, a closed connection: gloo and
    NCCL raise RuntimeError) into a :class:`PeerError` naming the rank that failed."""
    try:
        yield
    except PeerError:
        raise
    except RuntimeError as exc:
        raise peer_error(rank, what, peers, exc, timeout_s, store if store is not None else default_store()) \
            from None


def report_failure(exc: BaseException, rank: int, groups: Iterable[Any], store: Any) -> None:
    """Leave the note naming the failed rank (unless a rank was first) and destroy ``groups`` (never the
    default group), so peers blocked on this rank stop waiting. Callers must drop their references to the
    groups: gloo closes the connections only when the group object goes away."""
    text = None
    if not isinstance(exc, PeerError):
        text = f"rank {rank} failed: {type(exc).__name__}: {exc}"
    elif exc.culprit is not None:
        text = f"rank {exc.culprit} stopped answering ({exc})"
    if store is not None and text is not None:
        try:
            store.compare_set(FAILURE_KEY, "", text)  # set only if absent: the first observation wins
        except Exception:
            pass
    close_groups(groups)


def close_groups(groups: Iterable[Any]) -> None:
    """Destroy ``groups`` (skipping None, the default group and groups this rank is not in), each as far as it
    can be: one a failure already closed is passed over. Callers drop their references (see report_failure)."""
    for group in groups:
        if group is None or group is dist.GroupMember.WORLD or group is dist.GroupMember.NON_GROUP_MEMBER:
            continue
        try:
            dist.destroy_process_group(group)
        except Exception:
            pass


@dataclass
class Transport:
    """Tagged sends and receives on the pipeline's own process group, every wait bounded by ``timeout_s``."""

    group: Any
    rank: int
    timeout_s: float = 60.0
    store: Any = field(default_factory=default_store)
    pending: SendsInFlight = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._timeout = datetime.timedelta(seconds=self.timeout_s)
        gloo = self.group is not None and dist.get_backend(self.group) == dist.Backend.GLOO
        self.pending = SendsInFlight(self.wait, waiter=gloo)

    def _failed(self, what: str, peer: int, exc: BaseException | None = None) -> PeerError:
        """The error for ``what`` with ``peer``: the transport already closed, or ``exc`` from torch."""
        if exc is None:
            return PeerError(f"rank {self.rank}: {what} with rank {peer}: the pipeline stopped after an earlier "
                             f"failure ({failure_note(self.store) or 'see the first error'}); restart the job")
        return peer_error(self.rank, f"{what} with rank {peer}", [peer], exc, self.timeout_s, self.store)

    # The hot path: a plain try/except (free unless it raises) rather than named_failures' context manager,
    # and the group checked against None so that a closed transport never falls through to the default group.
    def isend(self, tensor: torch.Tensor, dst: int, tag: int, what: str) -> None:
        """Post a send; :meth:`flush` waits for it (``what`` describes it in errors)."""
        if self.group is None:
            raise self._failed(what, dst)
        try:  # posting fails at once when the peer has closed the connection
            work = dist.isend(tensor, dst=dst, group=self.group, tag=tag)
        except RuntimeError as exc:
            raise self._failed(what, dst, exc) from None
        self.pending.add(work, dst, what, tensor.numel() * tensor.element_size())

    def irecv(self, buffer: torch.Tensor, src: int, tag: int) -> Any:
        """Post one receive; :meth:`wait` on the returned work (with the peer and a description)."""
        if self.group is None:
            raise self._failed("posting a receive", src)
        try:
            return dist.irecv(buffer, src=src, group=self.group, tag=tag)
        except RuntimeError as exc:
            raise self._failed("posting a receive", src, exc) from None

    def flush(self) -> None:
        """Wait for every posted send, each at most ``timeout_s``."""
        self.pending.flush()

    def wait(self, work: Any, peer: int, what: str) -> None:
        """Wait at most ``timeout_s`` for ``work`` with ``peer``; a failure is a :class:`PeerError` naming the
        rank that failed."""
        try:
            work.wait(timeout=self._timeout)
        except RuntimeError as exc:
            raise self._failed(what, peer, exc) from None

    def report_failure(self, exc: BaseException, also: Iterable[Any] = ()) -> None:
        """Leave a note for the other ranks and close our connections (and those of ``also``, the caller's
        other groups) so they stop waiting on us."""
        groups = [self.group, *also]
        self.group = None  # already closed: never fall through to destroying the default group
        self.pending.clear()
        report_failure(exc, self.rank, groups, self.store)
