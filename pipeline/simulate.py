"""Discrete-event simulation of a pipeline schedule: step time, per-rank idle time, bubble fraction.

Every action starts as soon as its rank has finished the previous action and its dependencies are
done (plus a communication delay when a dependency crosses ranks), which is how a schedule runs on
real hardware with compute-bound stages.  With equal stage times this reproduces the analytic
bubble (p - 1) / (m + p - 1) of GPipe (Huang et al. 2019, arXiv:1811.06965) and 1F1B (Narayanan
et al. 2021, arXiv:2006.09503), the ~1/v smaller bubble of interleaved 1F1B (Narayanan et al. 2021,
arXiv:2104.04473) and the (p - 1)(f + b - w) bubble of ZB-H1 (Qi et al. 2023, arXiv:2401.10241).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from numbers import Real
from operator import sub

from .schedule import Schedule, StageDeps, replay, stage_edges
from .timeline import Event

__all__ = ["SimResult", "simulate", "bubble_bound"]

Seconds = float | Sequence[float]


@dataclass
class SimResult:
    """Timing of one simulated step; ``events`` is built on first access (formatting millions of
    events costs more than the simulation itself)."""

    step_s: float
    busy_s: list[float]  # per rank
    idle_s: list[float]  # per rank: step_s - busy_s
    bubble: float  # 1 - sum(busy_s) / (num_ranks * step_s)
    schedule: Schedule = field(repr=False)
    starts: list[list[float]] = field(repr=False)  # per rank, aligned with schedule.actions
    ends: list[list[float]] = field(repr=False)

    @cached_property
    def events(self) -> list[Event]:
        return [
            Event(rank, str(action), start, end)
            for rank, order in enumerate(self.schedule.actions)
            for action, start, end in zip(order, self.starts[rank], self.ends[rank])
        ]


def bubble_bound(p: int, m: int) -> float:
    """Bubble fraction (p - 1) / (m + p - 1) of GPipe and 1F1B with equal stage times."""
    return (p - 1) / (m + p - 1)


def _per_stage(name: str, value: Seconds, num_stages: int) -> list[float]:
    values = [float(value)] * num_stages if isinstance(value, Real) else [float(x) for x in value]
    if len(values) != num_stages:
        raise ValueError(
            f"{name} has {len(values)} entries but the schedule has {num_stages} stages; give one per stage or a scalar"
        )
    negative = [(s, x) for s, x in enumerate(values) if x < 0]
    if negative:
        raise ValueError(f"{name} has negative (stage, seconds) {negative[:8]}; times must be >= 0")
    return values


def simulate(
    schedule: Schedule,
    forward_s: Seconds,
    backward_s: Seconds,
    *,
    weight_s: Seconds | None = None,
    comm_s: float | Mapping[tuple[int, int], float] = 0.0,
    stage_deps: StageDeps = None,
) -> SimResult:
    """Simulate one step of ``schedule``; times are seconds per microbatch, per stage or a scalar.

    Without ``weight_s``, ``backward_s`` is the whole backward; schedules that split it
    (``split_backward``) spend half of it in B (input grad) and half in W (weight grad).  With
    ``weight_s``, ``backward_s`` is the input-grad part only and ``weight_s`` the weight-grad part;
    schedules that do not split run them as one B of ``backward_s + weight_s`` — so the same
    arguments compare split and unsplit schedules fairly.

    ``comm_s`` is added to every dependency that crosses ranks: a scalar for all stage edges, or
    {(producer, consumer): seconds} (missing edges cost 0).  Raises ``ScheduleError`` if the
    schedule is malformed or deadlocks.
    """
    n = schedule.num_stages
    forward = _per_stage("forward_s", forward_s, n)
    backward = _per_stage("backward_s", backward_s, n)
    if weight_s is None:
        weight = [b / 2 for b in backward]
        if schedule.split_backward:
            backward = weight  # the input-grad half
    else:
        weight = _per_stage("weight_s", weight_s, n)
        if not schedule.split_backward:
            backward = [b + w for b, w in zip(backward, weight)]
    if isinstance(comm_s, Mapping):
        latency = {edge: float(x) for edge, x in comm_s.items()}
    else:
        latency = {edge: float(comm_s) for edge in stage_edges(n, stage_deps)}
    negative = {edge: x for edge, x in latency.items() if x < 0}
    if negative:
        raise ValueError(f"comm_s has negative seconds {dict(list(negative.items())[:8])}; times must be >= 0")
    starts, ends = replay(schedule, stage_deps, seconds={"F": forward, "B": backward, "W": weight}, comm_s=latency)
    step = max((e[-1] for e in ends if e), default=0.0)
    busy = [sum(map(sub, e, s)) for s, e in zip(starts, ends)]
    bubble = 1.0 - sum(busy) / (schedule.num_ranks * step) if step > 0 else 0.0
    return SimResult(step, busy, [step - b for b in busy], bubble, schedule, starts, ends)
