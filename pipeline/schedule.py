"""Pipeline schedules as data: per-rank ordered lists of forward/backward actions.

A schedule says, for every rank, in which order it runs the forward (F), backward (B) and — for
zero-bubble schedules — weight-gradient (W) passes of every (stage, microbatch).  The runtime only
follows the lists; everything here can be checked (``validate``), measured (``peak_in_flight``,
``fifo_violations``) and timed (``pipeline.simulate``) without a GPU.

Generators:

* ``gpipe`` — GPipe, Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using
  Pipeline Parallelism", arXiv:1811.06965 (SMP's "simple" pipeline): all forwards, then all
  backwards.
* ``one_f_one_b`` — 1F1B / PipeDream-Flush, Narayanan et al. 2021, "Memory-Efficient
  Pipeline-Parallel DNN Training", arXiv:2006.09503 (SMP's "interleaved" pipeline): a short
  forward warm-up, then one backward per forward, so stage s holds at most p - s activations.
* ``interleaved`` — interleaved 1F1B over virtual stages, Narayanan et al. 2021, "Efficient
  Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC21, arXiv:2104.04473.
* ``zero_bubble_h1`` — ZB-H1, Qi et al. 2023, "Zero Bubble Pipeline Parallelism",
  arXiv:2401.10241: 1F1B with the backward split into input-grad (B) and weight-grad (W), the W's
  deferred into what would otherwise be bubbles.

Dependencies between stages are edges (producer, consumer) with producer < consumer; the default
is the chain (s, s + 1).  F(t, k) needs F(s, k) for every edge (s, t); B(s, k) needs F(s, k) and
B(t, k) for every edge (s, t); W(s, k) needs B(s, k).
"""

from __future__ import annotations

import gc
import re
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from numbers import Integral

__all__ = [
    "Action",
    "Schedule",
    "ScheduleError",
    "StageDeps",
    "SCHEDULE_NAMES",
    "gpipe",
    "one_f_one_b",
    "interleaved",
    "zero_bubble_h1",
    "make_schedule",
    "validate",
    "fifo_violations",
    "peak_in_flight",
    "stage_edges",
    "replay",
]

StageDeps = Sequence[tuple[int, int]] | None

_KINDS = ("F", "B", "W")
_ACTION_RE = re.compile(r"([FBW])(\d+)@s(\d+)")


class ScheduleError(ValueError):
    """A schedule is malformed or cannot run to completion."""


@dataclass(frozen=True, order=True, slots=True)
class Action:
    """One pass of one microbatch through one stage.

    ``kind`` is "F" (forward), "B" (backward; input-grad only when the schedule splits W out) or
    "W" (weight-grad).
    """

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}@s{self.stage}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``Action.parse("F3@s1") == Action("F", 1, 3)``."""
        match = _ACTION_RE.fullmatch(text)
        if match is None:
            raise ValueError(f"cannot parse action {text!r}; expected e.g. 'F3@s1' (kind F/B/W, microbatch 3, stage 1)")
        kind, microbatch, stage = match.groups()
        return cls(kind, int(stage), int(microbatch))


@dataclass
class Schedule:
    """Per-rank ordered action lists for one training step."""

    name: str
    num_ranks: int
    num_stages: int
    microbatches: int
    stage_to_rank: list[int]
    actions: list[list[Action]]
    split_backward: bool

    def stages_of(self, rank: int) -> list[int]:
        """Stages hosted by ``rank``, ascending."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]


# --------------------------------------------------------------------------------------------
# Generators
# --------------------------------------------------------------------------------------------


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while building or replaying millions of acyclic objects (Actions, time
    lists): every collection would rescan all of them, doubling the time at p=1024, m=2048."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, Integral) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _one_f_one_b_order(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """``warmup`` forwards, then alternate one backward / one forward, then the remaining backwards.

    Holding ``warmup`` activations is the steady state, so ``warmup`` is the rank's peak in-flight
    count; ``warmup == len(forwards)`` degenerates to GPipe's all-forwards-then-all-backwards.
    """
    rest = forwards[warmup:]
    steady = [a for pair in zip(backwards, rest) for a in pair]
    return forwards[:warmup] + steady + backwards[len(rest) :]


@_gc_paused()
def _one_f_one_b_family(
    name: str, num_ranks: int, microbatches: int, virtual_stages: int, warmup: Callable[[int], int]
) -> Schedule:
    """``virtual_stages`` chunks per rank (stage s on rank s % p), each rank in 1F1B order with
    ``warmup(rank)`` forwards first, then validated.

    The k-th forward on a rank runs chunk (k // p) % v of microbatch k // (p v) * p + k % p: rounds
    of p microbatches go depth first through the chunks; backwards visit the chunks in reverse.
    """
    p, m, v = num_ranks, microbatches, virtual_stages
    ks = range(m * v)
    chunk = [(k // p) % v for k in ks]
    microbatch = [k // (p * v) * p + k % p for k in ks]
    actions = []
    for rank in range(p):
        forwards = [Action("F", c * p + rank, mb) for c, mb in zip(chunk, microbatch)]
        backwards = [Action("B", (v - 1 - c) * p + rank, mb) for c, mb in zip(chunk, microbatch)]
        actions.append(_one_f_one_b_order(forwards, backwards, min(warmup(rank), m * v)))
    stage_to_rank = [s % p for s in range(p * v)]
    schedule = Schedule(name, p, p * v, m, stage_to_rank, actions, split_backward=False)
    validate(schedule)
    return schedule


def gpipe(num_ranks: int, microbatches: int) -> Schedule:
    """GPipe: every rank runs all forwards, then all backwards, both in microbatch order.

    Backwards in forward order (rather than reversed) send each rank pair's gradients in the order
    they are consumed (FIFO), and the last stage can start backward 0 right after forward m - 1
    either way, so the bubble is the same (p - 1)(f + b).
    """
    _check_positive(num_ranks=num_ranks, microbatches=microbatches)
    return _one_f_one_b_family("gpipe", num_ranks, microbatches, 1, lambda rank: microbatches)


def one_f_one_b(num_ranks: int, microbatches: int, max_in_flight: int | None = None) -> Schedule:
    """1F1B (PipeDream-Flush): stage s warms up with min(p - s, m) forwards, then 1B/1F, then drains.

    ``max_in_flight`` caps the warm-up (and so the activations held) on every stage, trading
    bubble for memory.
    """
    _check_positive(num_ranks=num_ranks, microbatches=microbatches)
    cap = microbatches
    if max_in_flight is not None:
        _check_positive(max_in_flight=max_in_flight)
        cap = min(cap, max_in_flight)
    return _one_f_one_b_family("1f1b", num_ranks, microbatches, 1, lambda rank: min(num_ranks - rank, cap))


def interleaved(num_ranks: int, microbatches: int, virtual_stages: int) -> Schedule:
    """Megatron interleaved 1F1B: ``virtual_stages`` model chunks per rank, stage s on rank s % p.

    Microbatches go through the chunks in rounds of p, which needs m % p == 0 when there is more
    than one chunk.  With ``virtual_stages == 1`` this is exactly ``one_f_one_b``.
    """
    _check_positive(num_ranks=num_ranks, microbatches=microbatches, virtual_stages=virtual_stages)
    p, m, v = num_ranks, microbatches, virtual_stages
    if v > 1 and m % p:
        lower, upper = m - m % p, m - m % p + p
        hint = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(
            f"interleaved schedule with virtual_stages={v} needs microbatches % num_ranks == 0, "
            f"got microbatches={m}, num_ranks={p}: use {hint} microbatches (or virtual_stages=1)"
        )

    def warmup(rank: int) -> int:
        if v == 1:
            return p - rank  # plain 1F1B: the fewest activations for its (unavoidable) bubble
        # Keep the rank busy while microbatch 0 crosses the other (v - 1) p chunks and its
        # gradient comes back over 2 (p - 1 - rank) hops (Megatron's warm-up, + 1 for our B-first steady state).
        return (v - 1) * p + 2 * (p - 1 - rank) + 1

    return _one_f_one_b_family("interleaved", p, m, v, warmup)


@_gc_paused()
def zero_bubble_h1(num_ranks: int, microbatches: int) -> Schedule:
    """ZB-H1: 1F1B's F/B order with the backward split into B (input grad) and W (weight grad).

    Only B is on the cross-rank critical path, so gradients travel upstream sooner.  W's are placed
    in B order, one after each 1B1F step (after its F, so the next forward is not delayed) and one
    after each drain B; rank r holds back its first r W's, which lands them in the drain's idle
    slots.  That is the paper's ZB-H1 layout (and torch's ZB1P): with f = b = w and m >= p the bubble
    is (p - 1)(f + b - w) instead of 1F1B's (p - 1)(f + b + w), with the same F/B order and so the
    same peak activations.
    """
    base = one_f_one_b(num_ranks, microbatches)
    actions = []
    for rank, order in enumerate(base.actions):
        out: list[Action] = []
        held: deque[Action] = deque()  # W's of finished B's, oldest first
        for i, action in enumerate(order):
            out.append(action)
            if action.kind == "B":
                held.append(Action("W", action.stage, action.microbatch))
                step_done = i + 1 == len(order) or order[i + 1].kind == "B"  # a drain B
            else:
                step_done = i > 0 and order[i - 1].kind == "B"  # the F closing a 1B1F step
            if step_done and len(held) > rank:
                out.append(held.popleft())
        out.extend(held)
        actions.append(out)
    stage_to_rank = list(range(num_ranks))
    schedule = Schedule("zb-h1", num_ranks, num_ranks, microbatches, stage_to_rank, actions, split_backward=True)
    validate(schedule)
    return schedule


_GENERATORS: dict[str, str] = {
    "gpipe": "gpipe",
    "simple": "gpipe",
    "1f1b": "1f1b",
    "interleaved": "1f1b",  # SMP's name for 1F1B
    "interleaved-virtual": "interleaved",
    "zb-h1": "zb-h1",
    "zero-bubble": "zb-h1",
}
SCHEDULE_NAMES = tuple(_GENERATORS)


def make_schedule(
    name: str, num_ranks: int, microbatches: int, *, virtual_stages: int = 1, max_in_flight: int | None = None
) -> Schedule:
    """Build a schedule by name (see ``SCHEDULE_NAMES``).

    Note SMP calls 1F1B "interleaved"; Megatron's virtual-stage schedule is "interleaved-virtual".
    """
    kind = _GENERATORS.get(name)
    if kind is None:
        raise ValueError(f"unknown schedule {name!r}; valid names: {', '.join(SCHEDULE_NAMES)}")
    if virtual_stages != 1 and kind != "interleaved":
        raise ValueError(f"virtual_stages={virtual_stages} only applies to 'interleaved-virtual', not {name!r}")
    if max_in_flight is not None and kind != "1f1b":
        raise ValueError(f"max_in_flight={max_in_flight} only applies to '1f1b'/'interleaved', not {name!r}")
    if kind == "gpipe":
        return gpipe(num_ranks, microbatches)
    if kind == "1f1b":
        return one_f_one_b(num_ranks, microbatches, max_in_flight)
    if kind == "interleaved":
        return interleaved(num_ranks, microbatches, virtual_stages)
    return zero_bubble_h1(num_ranks, microbatches)


# --------------------------------------------------------------------------------------------
# Checking
# --------------------------------------------------------------------------------------------


def stage_edges(num_stages: int, stage_deps: StageDeps = None) -> list[tuple[int, int]]:
    """``stage_deps`` as a checked list of (producer, consumer) edges; ``None`` means the chain."""
    if stage_deps is None:
        return [(s, s + 1) for s in range(num_stages - 1)]
    edges = [(int(s), int(t)) for s, t in stage_deps]
    seen: set[tuple[int, int]] = set()
    for s, t in edges:
        if not 0 <= s < t < num_stages:
            raise ScheduleError(
                f"stage_deps edge ({s}, {t}) is invalid: need 0 <= producer < consumer < num_stages={num_stages}; "
                f"pass edges in model order (producer first)"
            )
        if (s, t) in seen:
            raise ScheduleError(f"stage_deps lists edge ({s}, {t}) twice; list each edge once")
        seen.add((s, t))
    return edges


def _check_header(schedule: Schedule) -> None:
    p, n = schedule.num_ranks, schedule.num_stages
    _check_positive(num_ranks=p, num_stages=n, microbatches=schedule.microbatches)
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
    kinds = _KINDS if schedule.split_backward else _KINDS[:2]
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


@_gc_paused()
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
    list per rank aligned with ``schedule.actions``.  Raises ``ScheduleError`` on any misplaced,
    duplicated, missing or deadlocked action.  Cost is O(actions + dependencies): a rank blocked
    on an action is parked until exactly that action completes, then resumes where it stopped.
    """
    _check_header(schedule)
    p, n, m = schedule.num_ranks, schedule.num_stages, schedule.microbatches
    rank_of = schedule.stage_to_rank
    edges = stage_edges(n, stage_deps)
    latency = dict(comm_s or {})
    unknown = set(latency) - set(edges)
    if unknown:
        raise ScheduleError(
            f"comm_s has keys {sorted(unknown)[:8]} that are not stage_deps edges (first edges: {edges[:8]})"
        )
    kinds = _KINDS if schedule.split_backward else _KINDS[:2]
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
                t = end[slot + k]
                if t is None:
                    parked.setdefault(slot + k, []).append(rank)
                    break
                if t + cost > ready:
                    ready = t + cost
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
    W when ``split_backward``) on rank ``stage_to_rank[stage]``, and the per-rank lists run to
    completion under the stage dependencies (no deadlock)."""
    replay(schedule, stage_deps)


_Messages = dict[tuple[int, int], list[str]]  # (sending rank, receiving rank) -> message names


def _messages(schedule: Schedule, stage_deps: StageDeps) -> tuple[_Messages, _Messages]:
    """Cross-rank messages per ordered rank pair, in send order and in receive order."""
    edges = stage_edges(schedule.num_stages, stage_deps)
    rank_of = schedule.stage_to_rank
    consumers: dict[int, list[int]] = defaultdict(list)
    producers: dict[int, list[int]] = defaultdict(list)
    for s, t in edges:
        consumers[s].append(t)
        producers[t].append(s)
    sent: _Messages = defaultdict(list)
    received: _Messages = defaultdict(list)
    for rank, order in enumerate(schedule.actions):
        for a in order:
            k = a.microbatch
            if a.kind == "F":  # sends activations downstream, receives from upstream
                for t in consumers[a.stage]:
                    if rank_of[t] != rank:
                        sent[rank, rank_of[t]].append(f"activation mb{k} s{a.stage}->s{t}")
                for s in producers[a.stage]:
                    if rank_of[s] != rank:
                        received[rank_of[s], rank].append(f"activation mb{k} s{s}->s{a.stage}")
            elif a.kind == "B":  # sends input gradients upstream, receives from downstream
                for s in producers[a.stage]:
                    if rank_of[s] != rank:
                        sent[rank, rank_of[s]].append(f"gradient mb{k} s{a.stage}->s{s}")
                for t in consumers[a.stage]:
                    if rank_of[t] != rank:
                        received[rank_of[t], rank].append(f"gradient mb{k} s{t}->s{a.stage}")
    return sent, received


def fifo_violations(schedule: Schedule, stage_deps: StageDeps = None) -> list[str]:
    """Rank pairs whose messages are received in a different order than sent, one line each.

    Transports that match point-to-point messages by order (NCCL) need this list empty; tagged
    transports (gloo with tags) do not.
    """
    sent, received = _messages(schedule, stage_deps)
    problems = []
    for src, dst in sorted(set(sent) | set(received)):
        out, into = sent[src, dst], received[src, dst]
        if out == into:
            continue
        i = next((i for i, (a, b) in enumerate(zip(out, into)) if a != b), min(len(out), len(into)))
        got = out[i] if i < len(out) else "nothing"
        want = into[i] if i < len(into) else "nothing"
        problems.append(f"rank {src} -> rank {dst}: message #{i} sent is {got} but the receiver expects {want}")
    return problems


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per stage, the most microbatches forwarded but not yet backwarded (activations held)."""
    held = [0] * schedule.num_stages
    peak = [0] * schedule.num_stages
    for order in schedule.actions:
        for a in order:
            if a.kind == "F":
                held[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], held[a.stage])
            elif a.kind == "B":
                held[a.stage] -= 1
    return peak
