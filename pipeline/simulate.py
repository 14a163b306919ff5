"""Replaying a schedule: deadlock checks (:func:`validate`) and discrete-event timing (:func:`simulate`).

The replay engine runs the per-rank lists in order: each action starts as soon as its rank has finished
the previous action and its dependencies are done (plus a communication delay when a dependency crosses
ranks), which is how a schedule runs on real hardware with compute-bound stages. Its cost is
O(actions + dependencies): a rank blocked on an action is parked until exactly that action completes.

A lowered schedule (:mod:`pipeline.lowering`) is checked for its sends and receives — each cross-rank edge
of each microbatch sent once after its producer and received once before its consumer, on the right
ranks — and timed on its compute actions: a send leaves when its producer ends (it directly follows it)
and a receive only posts a buffer, so the consumer waits for the producer's end plus the link's time.

With equal stage times the timing reproduces the analytic bubble (p - 1) / (m + p - 1) of GPipe (Huang et
al. 2019, arXiv:1811.06965) and 1F1B (Narayanan et al. 2021, arXiv:2006.09503), the ~1/v smaller bubble
of interleaved 1F1B (Narayanan et al. 2021, arXiv:2104.04473) and the (p - 1)(f + b - w) bubble of ZB-H1
(Qi et al. 2023, arXiv:2401.10241).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from numbers import Real
from operator import sub
from typing import cast

from pipeline.lowering import lower
from pipeline.schedule import (
    COMPUTE_KINDS,
    Action,
    Schedule,
    ScheduleError,
    StageDeps,
    check_positive,
    gc_paused,
    stage_edges,
)
from pipeline.timeline import Event

__all__ = ["SimResult", "simulate", "bubble_bound", "validate", "replay", "compute_only"]

def _check_header(schedule: Schedule) -> None:
    """Ranks, stages and microbatches positive; one rank per stage and one list per rank."""
    p, n = schedule.num_ranks, schedule.num_stages
    check_positive(num_ranks=p, num_stages=n, microbatches=schedule.microbatches)
    if len(schedule.stage_to_rank) != n:
        raise ScheduleError(
            f"stage_to_rank has {len(schedule.stage_to_rank)} entries but num_stages={n}; give one rank per stage"
        )
    bad = [(s, r) for s, r in enumerate(schedule.stage_to_rank) if not 0 <= r < p]
    if bad:
        raise ScheduleError(f"stage_to_rank maps (stage, rank) {bad[:8]} outside ranks 0..{p - 1} (num_ranks={p})")
    if len(schedule.actions) != p:
        raise ScheduleError(
            f"actions has {len(schedule.actions)} per-rank lists but num_ranks={p}; give one list per rank"
        )


def _explain_failure(schedule: Schedule, pointer: list[int], parked: dict[int, list[int]]) -> ScheduleError:
    """Name the root cause of a failed replay: misplaced, duplicated, missing or deadlocked actions."""
    n, m = schedule.num_stages, schedule.microbatches
    kinds = COMPUTE_KINDS if schedule.split_backward else COMPUTE_KINDS[:2]
    for rank, order in enumerate(schedule.actions):
        for index, a in enumerate(order):
            if a.kind not in kinds:
                hint = "set split_backward=True to use W" if a.kind == "W" else "kinds are F, B, W"
                return ScheduleError(f"rank {rank} index {index}: action {a!r} has kind {a.kind!r}; {hint}")
            if not (0 <= a.stage < n and 0 <= a.microbatch < m):
                return ScheduleError(
                    f"rank {rank} index {index}: {a} is out of range (num_stages={n}, microbatches={m})"
                )
            home = schedule.stage_to_rank[a.stage]
            if home != rank:
                return ScheduleError(
                    f"rank {rank} index {index}: {a} belongs to stage {a.stage}, which lives on rank {home}; "
                    f"move it to rank {home}'s list"
                )
    where: dict[Action, list[tuple[int, int]]] = defaultdict(list)
    for rank, order in enumerate(schedule.actions):
        for index, a in enumerate(order):
            where[a].append((rank, index))
    duplicated = [f"{a} at (rank, index) {spots}" for a, spots in where.items() if len(spots) > 1]
    if duplicated:
        return ScheduleError(f"actions scheduled more than once: {'; '.join(duplicated[:8])}; keep exactly one of each")
    expected = (Action(kind, s, k) for kind in kinds for s in range(n) for k in range(m))
    missing = [str(a) for a in expected if a not in where]
    if missing:
        return ScheduleError(
            f"{len(missing)} action(s) never scheduled: {', '.join(missing[:16])}"
            f"{' ...' if len(missing) > 16 else ''}; "
            f"every (stage, microbatch) needs one F and one B{' and one W' if schedule.split_backward else ''} "
            f"on rank stage_to_rank[stage]"
        )
    waits_for: dict[int, Action] = {}
    for key, waiting in parked.items():
        kind_stage, k = divmod(key, m)
        for rank in waiting:
            waits_for[rank] = Action(kinds[kind_stage // n], kind_stage % n, k)
    # Every stuck rank waits on exactly one other (stuck) rank, so following the waits from any of
    # them ends in a cycle: that cycle is the root cause, the other stuck ranks just queue behind it.
    seen: dict[int, None] = {}
    rank = min(waits_for)
    while rank not in seen:
        seen[rank] = None
        rank = where[waits_for[rank]][0][0]
    cycle = list(seen)[list(seen).index(rank):]
    lines = []
    for rank in cycle:
        dep = waits_for[rank]
        ((dep_rank, dep_index),) = where[dep]
        place = "later on the same rank" if dep_rank == rank else f"on rank {dep_rank}"
        head = schedule.actions[rank][pointer[rank]]
        lines.append(f"rank {rank} index {pointer[rank]} {head} waits for {dep} ({place}, index {dep_index})")
    return ScheduleError(
        f"deadlock cycle: {'; '.join(lines)}; {len(waits_for)} rank(s) stuck in all; "
        "reorder the per-rank lists so each action's dependencies run before it"
    )


@gc_paused()
def replay(
    schedule: Schedule,
    stage_deps: StageDeps = None,
    *,
    seconds: Mapping[str, Sequence[float]] | None = None,
    comm_s: Mapping[tuple[int, int], float] | None = None,
) -> tuple[list[list[float]], list[list[float]]]:
    """Run the per-rank lists in order; each action starts as soon as its rank is free and its
    dependencies are done (plus ``comm_s[(s, t)]`` when a dependency along edge (s, t) crosses ranks).

    ``seconds[kind][stage]`` is the duration of a pass, for each kind the schedule uses (default
    all zero, which makes this the deadlock check of ``validate``).  Returns (starts, ends), one
    list per rank aligned with ``schedule.actions`` (with its compute actions, for a lowered schedule,
    whose sends and receives are checked first).  Raises ``ScheduleError`` on any misplaced,
    duplicated, missing or deadlocked action.  Cost is O(actions + dependencies): a rank blocked
    on an action is parked until exactly that action completes, then resumes where it stopped.
    """
    _check_header(schedule)
    if schedule.lowered:
        _check_comm(schedule, stage_deps)
        schedule = compute_only(schedule)
    p, n, m = schedule.num_ranks, schedule.num_stages, schedule.microbatches
    rank_of = schedule.stage_to_rank
    edges = stage_edges(n, stage_deps)
    latency = dict(comm_s or {})
    unknown = set(latency) - set(edges)
    if unknown:
        raise ScheduleError(
            f"comm_s has keys {sorted(unknown)[:8]} that are not stage_deps edges (first edges: {edges[:8]})"
        )
    kinds = COMPUTE_KINDS if schedule.split_backward else COMPUTE_KINDS[:2]
    # Pass (kind, s, k) has slot (kind index * n + s) * m + k in the flat `end` table.
    base = {kind: [(i * n + s) * m for s in range(n)] for i, kind in enumerate(kinds)}
    deps: dict[tuple[str, int], list[tuple[int, float]]] = {}  # (kind, stage) -> [(slot of mb 0, latency)]
    for s in range(n):
        deps["F", s] = []
        deps["B", s] = [(base["F"][s], 0.0)]
        if schedule.split_backward:
            deps["W", s] = [(base["B"][s], 0.0)]
    for s, t in edges:
        cost = float(latency.get((s, t), 0.0)) if rank_of[s] != rank_of[t] else 0.0
        deps["F", t].append((base["F"][s], cost))
        deps["B", s].append((base["B"][t], cost))
    # Per rank, (kind, stage) -> (slot of mb 0, deps, seconds); a miss means a misplaced action.
    passes: list[dict[tuple[str, int], tuple[int, list[tuple[int, float]], float]]] = [{} for _ in range(p)]
    for kind in kinds:
        for s in range(n):
            passes[rank_of[s]][kind, s] = (base[kind][s], deps[kind, s], float(seconds[kind][s]) if seconds else 0.0)
    end: list[float | None] = [None] * (len(kinds) * n * m)  # completion time per slot, None until run
    parked: dict[int, list[int]] = {}  # slot not yet run -> ranks whose next action needs it
    starts: list[list[float]] = [[] for _ in range(p)]
    ends: list[list[float]] = [[] for _ in range(p)]
    pointer = [0] * p
    clock = [0.0] * p
    runnable = list(range(p - 1, -1, -1))
    while runnable:
        rank = runnable.pop()
        order, index, free, own = schedule.actions[rank], pointer[rank], clock[rank], passes[rank]
        rank_starts, rank_ends = starts[rank], ends[rank]
        while index < len(order):
            action = order[index]
            info = own.get((action.kind, action.stage))
            k = action.microbatch
            if info is None or not 0 <= k < m or end[info[0] + k] is not None:
                raise _explain_failure(schedule, pointer, parked)
            first, needs, duration = info
            ready = free
            for slot, cost in needs:
                done = end[slot + k]
                if done is None:
                    parked.setdefault(slot + k, []).append(rank)
                    break
                if done + cost > ready:
                    ready = done + cost
            else:  # every dependency done: run it
                free = ready + duration
                end[first + k] = free
                rank_starts.append(ready)
                rank_ends.append(free)
                index += 1
                woken = parked.pop(first + k, None) if parked else None
                if woken:
                    runnable.extend(woken)
                continue
            break
        pointer[rank], clock[rank] = index, free
    if parked or None in end:
        raise _explain_failure(schedule, pointer, parked)
    return starts, ends


def validate(schedule: Schedule, stage_deps: StageDeps = None) -> None:
    """Raise ``ScheduleError`` unless every (stage, microbatch) has exactly one F and one B (and one
    W when ``split_backward``) on rank ``stage_to_rank[stage]``, the per-rank lists run to
    completion under the stage dependencies (no deadlock), and — for a lowered schedule — every
    transfer is sent after its producer and received before its consumer, once."""
    replay(schedule, stage_deps)


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
        """One event per pass (sends and receives, instants, are left out)."""
        return [
            Event(rank, str(action), start, end)
            for rank, order in enumerate(self.schedule.actions)
            for action, start, end in zip(order, self.starts[rank], self.ends[rank])
            if not action.is_comm
        ]


def bubble_bound(p: int, m: int) -> float:
    """Bubble fraction (p - 1) / (m + p - 1) of GPipe and 1F1B with equal stage times."""
    return (p - 1) / (m + p - 1)


def _per_stage(name: str, value: Seconds, num_stages: int) -> list[float]:
    # numbers.Real also takes numpy scalars, but mypy cannot narrow by it, hence the cast.
    if isinstance(value, Real):
        values = [float(value)] * num_stages
    else:
        values = [float(x) for x in cast(Sequence[float], value)]
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
    if schedule.lowered:  # sends and receives take no time of their own: show them as instants
        starts, ends = _with_comm(schedule, starts, ends)
    step = max((e[-1] for e in ends if e), default=0.0)
    busy = [sum(map(sub, e, s)) for s, e in zip(starts, ends)]
    bubble = 1.0 - sum(busy) / (schedule.num_ranks * step) if step > 0 else 0.0
    return SimResult(step, busy, [step - b for b in busy], bubble, schedule, starts, ends)


def compute_only(schedule: Schedule) -> Schedule:
    """The schedule without its sends and receives (the lists a compute schedule generator made)."""
    if not schedule.lowered:
        return schedule
    return Schedule(schedule.name, schedule.num_ranks, schedule.num_stages, schedule.microbatches,
                    list(schedule.stage_to_rank), [[a for a in o if not a.is_comm] for o in schedule.actions],
                    schedule.split_backward)


def _check_comm(schedule: Schedule, stage_deps: StageDeps) -> None:
    """Every cross-rank edge of every microbatch: one send after its producer on the producer's rank and one
    receive before its consumer on the consumer's rank; nothing else."""
    want = {a for order in lower(compute_only(schedule), stage_deps).actions for a in order if a.is_comm}
    seen: dict[Action, tuple[int, int]] = {}
    for rank, order in enumerate(schedule.actions):
        done: set[tuple[str, int, int]] = set()
        for index, a in enumerate(order):
            if not a.is_comm:
                done.add((a.kind, a.stage, a.microbatch))
                continue
            where = f"rank {rank} index {index}: {a}"
            if a not in want:
                raise ScheduleError(f"{where} is not a transfer of this schedule's stage graph (stages on "
                                    "different ranks joined by a stage_deps edge)")
            if a in seen:
                raise ScheduleError(f"{where} appears twice (first at rank {seen[a][0]} index {seen[a][1]})")
            seen[a] = (rank, index)
            if schedule.stage_to_rank[a.stage] != rank:
                raise ScheduleError(f"{where} belongs on rank {schedule.stage_to_rank[a.stage]}")
            producer = ("F" if a.kind == "SEND_F" else "B", a.stage, a.microbatch)
            consumer = ("F" if a.kind == "RECV_F" else "B", a.stage, a.microbatch)
            if a.kind.startswith("SEND") and producer not in done:
                raise ScheduleError(f"{where} comes before {producer[0]}{a.microbatch}@s{a.stage}, which makes "
                                    "what it sends; put the send after it")
            if a.kind.startswith("RECV") and consumer in done:
                raise ScheduleError(f"{where} comes after {consumer[0]}{a.microbatch}@s{a.stage}, which needs "
                                    "what it receives; post the receive before it")
    missing = sorted(str(a) for a in want - set(seen))
    if missing:
        raise ScheduleError(f"{len(missing)} transfer(s) missing: {', '.join(missing[:8])}"
                            f"{' ...' if len(missing) > 8 else ''}; lower the schedule with pipeline.lowering.lower")


def _with_comm(schedule: Schedule, starts: list[list[float]],
               ends: list[list[float]]) -> tuple[list[list[float]], list[list[float]]]:
    """Compute-action times spread back over a lowered schedule's lists: each send or receive is an instant
    at the end of the compute action before it (or the start of the list)."""
    out_s: list[list[float]] = []
    out_e: list[list[float]] = []
    for order, s, e in zip(schedule.actions, starts, ends):
        rs: list[float] = []
        re_: list[float] = []
        it = iter(zip(s, e))
        now = 0.0
        for a in order:
            if a.is_comm:
                rs.append(now)
                re_.append(now)
            else:
                start, now = next(it)
                rs.append(start)
                re_.append(now)
        out_s.append(rs)
        out_e.append(re_)
    return out_s, out_e
