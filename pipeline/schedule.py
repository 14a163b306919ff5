"""Pipeline schedules as data: per-rank ordered lists of actions.

A schedule says, for every rank, in which order it runs the forward (F), backward (B) and — for
zero-bubble schedules — weight-gradient (W) passes of every (stage, microbatch), and, once lowered
(:mod:`pipeline.lowering`), the sends and receives of activations (``SEND_F``/``RECV_F``) and of
gradients (``SEND_B``/``RECV_B``) between ranks, as torch.distributed.pipelining's IR does. The
runtime (:mod:`pipeline.executor`) only follows the lists; the same lists are checked and timed
(:mod:`pipeline.simulate`), measured (:func:`peak_in_flight`) and drawn (:mod:`pipeline.timeline`)
without a GPU.

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
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from numbers import Integral

from partitioner.cost.pipelines import PIPELINE_NAMES
from partitioner.errors import EngineError

__all__ = [
    "Action",
    "Schedule",
    "ScheduleError",
    "StageDeps",
    "SCHEDULE_NAMES",
    "VIRTUAL_SCHEDULE",
    "COMPUTE_KINDS",
    "COMM_KINDS",
    "gpipe",
    "one_f_one_b",
    "interleaved",
    "zero_bubble_h1",
    "make_schedule",
    "peak_in_flight",
    "stage_edges",
    "check_positive",
    "gc_paused",
]

StageDeps = Sequence[tuple[int, int]] | None

COMPUTE_KINDS = ("F", "B", "W")
# A send goes from ``stage`` to ``peer``; a receive arrives at ``stage`` from ``peer``.
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_ACTION_RE = re.compile(r"(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)@s(\d+)(?:(->|<-)s(\d+))?")


class ScheduleError(EngineError, ValueError):
    """A schedule is malformed or cannot run to completion."""


@dataclass(frozen=True, order=True, slots=True)
class Action:
    """One pass of one microbatch through one stage, or one transfer between two stages.

    ``kind`` is "F" (forward), "B" (backward; input-grad only when the schedule splits W out), "W"
    (weight-grad), or a communication kind of :data:`COMM_KINDS`: ``SEND_F``/``RECV_F`` carry the
    activations stage ``stage`` sends to / receives from stage ``peer``, ``SEND_B``/``RECV_B`` the
    gradients going back. ``peer`` is -1 for compute actions.
    """

    kind: str
    stage: int
    microbatch: int
    peer: int = -1

    def __str__(self) -> str:
        if self.kind.startswith("SEND"):
            return f"{self.kind}{self.microbatch}@s{self.stage}->s{self.peer}"
        if self.kind.startswith("RECV"):
            return f"{self.kind}{self.microbatch}@s{self.stage}<-s{self.peer}"
        return f"{self.kind}{self.microbatch}@s{self.stage}"

    @property
    def is_comm(self) -> bool:
        """A send or a receive (rather than a pass through a stage)."""
        return self.peer >= 0

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``Action.parse("F3@s1") == Action("F", 1, 3)``,
        ``Action.parse("SEND_F3@s1->s2") == Action("SEND_F", 1, 3, 2)``."""
        match = _ACTION_RE.fullmatch(text)
        arrow_ok = match is not None and (match.group(4) is None) == (match.group(1) in COMPUTE_KINDS) and (
            match.group(4) is None or (match.group(4) == "->") == match.group(1).startswith("SEND"))
        if match is None or not arrow_ok:
            raise ValueError(f"cannot parse action {text!r}; expected e.g. 'F3@s1' (kind F/B/W, microbatch 3, "
                             "stage 1), 'SEND_F3@s1->s2' or 'RECV_B3@s1<-s2'")
        kind, microbatch, stage, _, peer = match.groups()
        return cls(kind, int(stage), int(microbatch), int(peer) if peer is not None else -1)


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
    lowered: bool = False  # the lists hold the sends and receives too (pipeline.lowering.lower)

    def stages_of(self, rank: int) -> list[int]:
        """Stages hosted by ``rank``, ascending."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]


# --------------------------------------------------------------------------------------------
# Generators
# --------------------------------------------------------------------------------------------


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while building or replaying millions of acyclic objects (Actions, time
    lists): every collection would rescan all of them, doubling the time at p=1024, m=2048."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def check_positive(**values: int) -> None:
    """Raise ``ValueError`` naming the first value that is not a positive integer."""
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


@gc_paused()
def _one_f_one_b_family(
    name: str, num_ranks: int, microbatches: int, virtual_stages: int, warmup: Callable[[int], int]
) -> Schedule:
    """``virtual_stages`` chunks per rank (stage s on rank s % p), each rank in 1F1B order with
    ``warmup(rank)`` forwards first.

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
    return Schedule(name, p, p * v, m, stage_to_rank, actions, split_backward=False)


def gpipe(num_ranks: int, microbatches: int) -> Schedule:
    """GPipe: every rank runs all forwards, then all backwards, both in microbatch order.

    Backwards in forward order (rather than reversed) send each rank pair's gradients in the order
    they are consumed (FIFO), and the last stage can start backward 0 right after forward m - 1
    either way, so the bubble is the same (p - 1)(f + b).
    """
    check_positive(num_ranks=num_ranks, microbatches=microbatches)
    return _one_f_one_b_family("gpipe", num_ranks, microbatches, 1, lambda rank: microbatches)


def one_f_one_b(num_ranks: int, microbatches: int, max_in_flight: int | None = None) -> Schedule:
    """1F1B (PipeDream-Flush): stage s warms up with min(p - s, m) forwards, then 1B/1F, then drains.

    ``max_in_flight`` caps the warm-up (and so the activations held) on every stage, trading
    bubble for memory.
    """
    check_positive(num_ranks=num_ranks, microbatches=microbatches)
    cap = microbatches
    if max_in_flight is not None:
        check_positive(max_in_flight=max_in_flight)
        cap = min(cap, max_in_flight)
    return _one_f_one_b_family("1f1b", num_ranks, microbatches, 1, lambda rank: min(num_ranks - rank, cap))


def interleaved(num_ranks: int, microbatches: int, virtual_stages: int) -> Schedule:
    """Megatron interleaved 1F1B: ``virtual_stages`` model chunks per rank, stage s on rank s % p.

    Microbatches go through the chunks in rounds of p, which needs m % p == 0 when there is more
    than one chunk.  With ``virtual_stages == 1`` this is exactly ``one_f_one_b``.
    """
    check_positive(num_ranks=num_ranks, microbatches=microbatches, virtual_stages=virtual_stages)
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


@gc_paused()
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
    return Schedule("zb-h1", num_ranks, num_ranks, microbatches, stage_to_rank, actions, split_backward=True)


# The schedule of several (virtual) stages per rank, stage s on rank s % p.
VIRTUAL_SCHEDULE = "interleaved-virtual"
# The two pipelines under every name (ours and SMP's, partitioner.cost.pipelines), and the schedules beyond.
_GENERATORS: dict[str, str] = {
    **PIPELINE_NAMES,
    VIRTUAL_SCHEDULE: "interleaved",
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


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per stage, the most microbatches forwarded but not yet backwarded (activations held)."""
    held = [0] * schedule.num_stages
    peak = [0] * schedule.num_stages
    for order in schedule.actions:
        for a in order:  # sends and receives of a lowered schedule change nothing held
            if a.kind == "F":
                held[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], held[a.stage])
            elif a.kind == "B":
                held[a.stage] -= 1
    return peak
