"""Collective calls say so: every rank announces the smp collective call it enters, so that a rank whose
peers are somewhere else gets a clear error instead of a hang (or, worse, a collective that pairs with the
wrong one and returns garbage).

``model.state_dict()`` gathers every stage, so it must run on every rank of the pipeline; the torch habit
``if rank == 0: torch.save(model.state_dict(), ...)`` would otherwise wait out the timeout and then blame a
rank that is alive and well. The protocol, per group of ranks (the world, the pipeline, the data-parallel
replicas of a stage): each rank numbers the collective calls it makes on that group and keeps one key in the
default store, overwritten at every call — ``smp/calls/<kind>/<ranks>/<rank>`` = ``"<n> <call>"`` — so the
store never grows. Announcing is one store write, which TCPStore sends without waiting for an answer (a few
microseconds), so ``@smp.step`` only announces. Calls that must not meet the wrong partner (state_dict,
barrier, allgather) also check before they communicate: they read their peers' keys until every peer shows
call ``n``.

* the same call: go on;
* another call with number ``n``, or any call after it: :class:`CollectiveError` at once, naming the ranks
  and what they called (a peer cannot get past call ``n`` without this rank unless the sequences differ);
* a call before ``n`` still after ``timeout_s``: :class:`CollectiveError` naming the ranks that did not
  call it and the last smp call each made.

When a step fails because a peer does not answer, :meth:`CallLog.explain` says from the same keys which
call that peer is in instead.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from partitioner.errors import EngineError
from pipeline.p2p import PeerError, failure_note

__all__ = ["CallLog", "CollectiveError"]

_FIRST_POLL_S, _MAX_POLL_S = 1e-4, 0.02  # polling backs off from 0.1 ms to 20 ms while peers are late


class CollectiveError(EngineError, RuntimeError):
    """A collective smp call that some rank of its group did not make, or made out of order."""


@dataclass
class CallLog:
    """This rank's numbered collective calls on one group of ranks, and its view of its peers'."""

    kind: str              # "world", "pipeline" or "data-parallel": names the group in errors
    ranks: list[int]       # global ranks of the group
    rank: int              # this rank
    store: Any             # the default store (None: nothing is announced or checked)
    timeout_s: float
    seq: int = 0
    call: str = "smp.init()"
    peers: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.peers = [r for r in self.ranks if r != self.rank]
        if not self.peers:
            self.store = None  # a group of one: nobody to disagree with
        prefix = f"smp/calls/{self.kind}/{'.'.join(map(str, self.ranks))}/"
        self._mine = prefix + str(self.rank)
        self._theirs = [prefix + str(r) for r in self.peers]
        self._write()  # call 0: every key exists before any rank can read it (smp.init creates groups after)

    def _write(self) -> None:
        if self.store is not None:
            self.store.set(self._mine, f"{self.seq} {self.call}")

    def announce(self, call: str) -> None:
        """Enter collective call ``call`` (its name as the user wrote it, e.g. ``model.state_dict()``)."""
        self.seq += 1
        self.call = call
        self._write()

    def peer_calls(self) -> dict[int, tuple[int, str]]:
        """Each peer's latest announced call: rank -> (number, name)."""
        out = {}
        for r, raw in zip(self.peers, self.store.multi_get(self._theirs)):
            n, _, name = raw.decode().partition(" ")
            out[r] = (int(n), name)
        return out

    def check(self, call: str) -> None:
        """Announce ``call``, then wait until every peer has announced it too (see the module docstring)."""
        self.announce(call)
        if self.store is None:
            return
        deadline = time.monotonic() + self.timeout_s
        pause = _FIRST_POLL_S
        while True:
            seen = self.peer_calls()
            wrong = {r: nc for r, nc in seen.items() if nc[0] > self.seq or (nc[0] == self.seq and nc[1] != call)}
            if wrong:
                raise CollectiveError(self._must(call) + "; ".join(
                    f"rank {r} called {name} instead" + ("" if n == self.seq else f" (its call #{n}, this is "
                                                                                   f"#{self.seq})")
                    for r, (n, name) in sorted(wrong.items())))
            late = {r: nc for r, nc in seen.items() if nc[0] < self.seq}
            if not late:
                return
            note = failure_note(self.store)
            if note is not None:
                raise PeerError(f"rank {self.rank}: {call} on the {self.kind} {self.ranks} failed: {note}")
            if time.monotonic() >= deadline:
                raise CollectiveError(self._must(call) + f"rank(s) {sorted(late)} did not call it within "
                                      f"{self.timeout_s:g} s (" + "; ".join(
                                          f"rank {r}'s last smp call: {name}" for r, (_, name) in sorted(late.items()))
                                      + "); if they are only busy for longer, raise timeout_s")
            time.sleep(pause)
            pause = min(2 * pause, _MAX_POLL_S)

    def _must(self, call: str) -> str:
        return (f"rank {self.rank}: {call} is collective: it must be called on every rank of the {self.kind} "
                f"(ranks {self.ranks}), in the same order as the other collective smp calls, but ")

    def explain(self, peer: int) -> str:
        """What ``peer`` is doing if it is not in this rank's current call ('' when it is, or unknown)."""
        if self.store is None or peer not in self.peers:
            return ""
        try:
            n, name = self.peer_calls()[peer]
        except Exception:
            return ""
        if n == self.seq:
            return ""
        return (f"rank {peer} is not in {self.call} (call #{self.seq} on the {self.kind}): its last smp call is "
                f"#{n} {name}")
