"""Aligning the clocks of ranks on different hosts: how far each rank's clock is from rank 0's.

Each rank times its own spans on its own monotonic clock (``time.perf_counter``); ranks on one host share
it, ranks on different hosts do not (each counts from its own boot). To merge their traces on one time
axis, rank 0 plays a few ping-pongs with every other rank, as in Cristian's algorithm (F. Cristian 1989,
"Probabilistic clock synchronization", Distributed Computing 3(3)) and NTP (D. L. Mills 1991, "Internet
time synchronization: the Network Time Protocol", IEEE Trans. Communications 39(10)): rank 0 sends its
time t0, the peer answers with its time t1, the answer arrives at t2; then ``t1 - (t0 + t2) / 2`` is the
peer's offset, off by at most half the round trip ``t2 - t0``. The round with the shortest round trip is
kept, the one least disturbed by scheduling noise.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ClockOffset", "clock_offset"]


@dataclass(frozen=True)
class ClockOffset:
    """This rank's clock minus rank 0's (``offset_s``), known to within ``error_s`` (half a round trip)."""

    offset_s: float
    error_s: float

    def to_rank0(self, t: float) -> float:
        """A time read on this rank's clock, on rank 0's."""
        return t - self.offset_s


def clock_offset(clock: Callable[[], float] = perf_counter, rounds: int = 8, group: Any = None) -> ClockOffset:
    """A collective over ``group`` (default: the world; it must be able to carry CPU tensors, i.e. gloo):
    every rank gets its own clock's offset from rank 0's (rank 0 gets zero). Rank 0 exchanges ``rounds``
    ping-pongs with each other rank in turn; the others wait for their turn."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    ranks = [dist.get_global_rank(group, i) if group is not None else i for i in range(world)]
    buf = torch.zeros(2, dtype=torch.float64)
    if me != 0:
        for _ in range(rounds):
            dist.recv(buf, src=ranks[0], group=group)
            buf[0] = clock()
            dist.send(buf, dst=ranks[0], group=group)
        dist.recv(buf, src=ranks[0], group=group)  # rank 0's verdict: (offset, error)
        return ClockOffset(float(buf[0]), float(buf[1]))
    for peer in ranks[1:]:
        best = (float("inf"), 0.0)
        for _ in range(rounds):
            t0 = clock()
            buf[0] = t0
            dist.send(buf, dst=peer, group=group)
            dist.recv(buf, src=peer, group=group)
            t2 = clock()
            best = min(best, (t2 - t0, float(buf[0]) - (t0 + t2) / 2))
        buf[0], buf[1] = best[1], best[0] / 2
        dist.send(buf, dst=peer, group=group)
    return ClockOffset(0.0, 0.0)
