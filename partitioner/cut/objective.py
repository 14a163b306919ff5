"""Scoring an assignment of ops to stages: the one place every plan's numbers come from.

Every method (METIS, the DP, the baselines) is scored here, so their bottlenecks and cut bytes compare
like with like. A stage's cost per microbatch is its compute (forward + backward) plus its communication:
each value it receives or sends, once per (value, consumer stage) pair — tensors that skip stages go
straight from producer to consumer — both ways (activations forward, gradients back). Bytes are counted at
the training precision (:mod:`partitioner.cost.precision`).

The objective blends the two balances with SMP's ``memory_weight`` ``w``:
``objective = (1 - w) * bottleneck / mean_cost + w * largest_memory / mean_memory``. It is monotone in the
bottleneck and in the largest stage's memory, so a plan that is no worse in either never scores worse.
(The largest *per-stage blend*, which this replaced, is not: on a Llama-3-70B-shaped model it preferred a
plan that was slower and needed more memory than the ``params`` baseline, because its slow stage and its
big stage were different stages.) Among plans whose objective is within :data:`NEAR` (1%) of the best,
the one with the fewest bytes crossing stages wins, then the fewest activation bytes in flight
(:func:`choose`); a plan that another is as good as in bottleneck, cut bytes and largest-stage memory and
better in one is never chosen (:func:`dominates`).

Under a device memory budget the estimate is not the whole story (allocator fragmentation, an optimizer's
temporaries, communication buffers), so a plan should leave :data:`HEADROOM` (10%) of the budget free. While
some candidate does (:meth:`Evaluation.roomy`), the rule above picks among those only; when none does --
memory is tight -- the plan whose largest stage needs the least memory wins, the lowest objective among
those within :data:`NEAR` of it (:func:`choose`). Without a budget nothing changes; ``memory_weight=1``
asks for the same preference at any budget.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..capture.graph import OpGraph, unique_ints
from ..cost.devices import DeviceRates
from ..cost.precision import activation_bytes, param_memory, value_bytes, weight_bytes
from ..cost.roofline import NodeCosts, in_flight
from ..errors import EngineError
from ..units import format_bytes
from .options import PartitionOptions

__all__ = ["Problem", "Evaluation", "evaluate", "crossings", "stage_crossings", "stage_params", "check_acyclic",
           "budget_error", "MemoryBudgetError", "dominates", "choose", "NEAR", "HEADROOM", "roomy_budget"]

NEAR = 0.01  # objectives within 1% of the best count as the same: fewer bytes cut and in flight decide
HEADROOM = 0.1  # the share of a device's memory budget a plan leaves free when it can: the estimate is not exact
_REL = 1e-9  # float noise when comparing seconds and bytes summed in different orders


class MemoryBudgetError(EngineError, ValueError):
    """No plan fits the per-device memory budget; the message carries the numbers. ``message`` may be a function
    that writes it, called when the message is first read: its numbers can take another partition, which a caller
    that catches the error and moves on (the layout search) would pay for and never read."""

    def __init__(self, message: str | Callable[[], str]) -> None:
        super().__init__()
        self._message = message

    def __str__(self) -> str:
        if not isinstance(self._message, str):
            self._message = self._message()
        return self._message

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return type(self), (str(self),)  # pickled (to another process) with its message written


@dataclass
class Problem:
    """A graph priced under some rates, to be cut into ``num_stages`` stages under ``options``; the per-node
    quantities every method and :func:`evaluate` read are derived once here, bytes at the training
    precision (``act_bytes`` per op, ``value_bytes`` per value, ``weights`` and ``param_mem`` per
    parameter)."""

    graph: OpGraph
    costs: NodeCosts
    num_stages: int
    rates: DeviceRates
    options: PartitionOptions
    # Derived per-node quantities (filled in __post_init__).
    time: np.ndarray = field(init=False, repr=False)
    param_mem: np.ndarray = field(init=False, repr=False)
    weights: np.ndarray = field(init=False, repr=False)
    act_bytes: np.ndarray = field(init=False, repr=False)
    value_bytes: np.ndarray = field(init=False, repr=False)
    inflight: np.ndarray = field(init=False, repr=False)
    placeable: np.ndarray = field(init=False, repr=False)  # False for output nodes: they do no work
    norm_time: float = field(init=False)
    norm_mem: float = field(init=False)
    budget: float | None = field(init=False)  # bytes every stage must fit (options.budget)

    def __post_init__(self) -> None:
        g, o = self.graph, self.options
        self.budget = o.budget(self.rates)
        self.time = self.costs.total_s
        self.weights = weight_bytes(g, o.dtype)
        self.param_mem = param_memory(g, o.dtype, o.optimizer)  # + gradients, optimizer state, master copy
        self.act_bytes = activation_bytes(g, o.dtype)
        self.value_bytes = value_bytes(g, o.dtype)
        self.inflight = np.array([in_flight(s, self.num_stages, o.microbatches, o.pipeline)
                                  for s in range(self.num_stages)], np.float64)
        self.placeable = np.fromiter((kind != "output" for kind in g.kinds), bool, count=g.num_nodes)
        k = self.num_stages
        self.norm_time = max(float(self.time.sum()) / k, 1e-30)
        self.norm_mem = max((float(self.param_mem.sum()) + float(self.act_bytes.sum())) / k, 1.0)

    def node_param_mem(self) -> np.ndarray:
        """Parameter memory per node, each parameter attributed to its first user (for prefix sums)."""
        return self.graph.by_first_user(self.param_mem)

    @property
    def lower_bound(self) -> float:
        """max(total cost / stages, largest op): no plan's bottleneck is lower."""
        return max(float(self.time.sum()) / self.num_stages, float(self.time.max(initial=0.0)))


@dataclass
class Evaluation:
    """The numbers of one assignment of ops to stages (per stage unless said otherwise)."""

    stage: np.ndarray
    compute_s: np.ndarray
    comm_s: np.ndarray
    bytes_in: np.ndarray
    bytes_out: np.ndarray
    param_bytes: np.ndarray
    memory: np.ndarray
    score: np.ndarray
    objective: float
    cut_bytes: int
    act_in_flight: float
    empty: bool

    @property
    def cost_s(self) -> np.ndarray:
        """Compute plus communication per stage."""
        return self.compute_s + self.comm_s

    @property
    def bottleneck(self) -> float:
        """The slowest stage's cost."""
        return float(self.cost_s.max())

    @property
    def axes(self) -> tuple[float, int, float]:
        """What a user compares plans by: bottleneck seconds, cut bytes and the largest stage's memory."""
        return self.bottleneck, self.cut_bytes, float(self.memory.max())

    def usable(self, budget: float | None) -> bool:
        """Every stage fits ``budget`` and has an op to run."""
        return not self.empty and (budget is None or bool(np.all(self.memory <= budget)))

    def roomy(self, budget: float | None) -> bool:
        """Every stage fits ``budget`` with :data:`HEADROOM` to spare (always, without a budget)."""
        line = roomy_budget(budget)
        return line is None or float(self.memory.max()) <= line

    def key(self, budget: float | None) -> tuple[int, float, int, float]:
        """Sort key: usable plans first, then the lowest objective, then cut bytes, then activations in flight."""
        return (0 if self.usable(budget) else 1, round(self.objective, 12), self.cut_bytes, self.act_in_flight)


def dominates(a: tuple[float, float, float], b: tuple[float, float, float]) -> bool:
    """Whether plan axes ``a`` (bottleneck, cut bytes, largest stage memory: :attr:`Evaluation.axes`) are
    at least as good as ``b`` in all three and better in one (beyond float noise)."""
    no_worse = all(x <= y * (1 + _REL) for x, y in zip(a, b))
    return no_worse and any(x < y * (1 - _REL) for x, y in zip(a, b))


def roomy_budget(budget: float | None) -> float | None:
    """The memory a stage may take and still leave :data:`HEADROOM` of ``budget`` free (None: no budget)."""
    return None if budget is None else (1 - HEADROOM) * budget


def choose(candidates: list[tuple[str, Evaluation]], budget: float | None) -> tuple[str, Evaluation]:
    """The plan to keep among named candidates: usable ones first, and of those the ones with headroom
    (:meth:`Evaluation.roomy`) if any. Among those, the objective decides: of the plans within :data:`NEAR`
    of the lowest, the fewest cut bytes, then the fewest activation bytes in flight. When no usable plan has
    headroom (memory is tight), the largest stage's memory decides instead: of the plans within :data:`NEAR`
    of the least, the lowest objective. Then, while other candidates of the same pool dominate the pick
    (:func:`dominates`), the one of those with the lowest objective."""
    usable = [c for c in candidates if c[1].usable(budget)] or candidates
    roomy = [c for c in usable if c[1].roomy(budget)]
    if roomy:
        usable = roomy
        best = min(ev.objective for _, ev in usable)
        near = [c for c in usable if c[1].objective <= best * (1 + NEAR) + 1e-15]
        name, pick = min(near, key=lambda c: (c[1].cut_bytes, c[1].act_in_flight, c[1].objective))
    else:  # tight: the smallest largest stage, as fast as it can be
        least = min(float(ev.memory.max()) for _, ev in usable)
        near = [c for c in usable if float(c[1].memory.max()) <= least * (1 + NEAR)]
        name, pick = min(near, key=lambda c: c[1].key(budget))
    for _ in usable:  # each step strictly improves an axis, so this ends; the bound guards float ties
        better = [c for c in usable if dominates(c[1].axes, pick.axes)]
        if not better:
            break
        name, pick = min(better, key=lambda c: c[1].key(budget))
    return name, pick


def crossings(g: OpGraph, stage: np.ndarray, k: int,
              value_bytes: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unique (value, consumer stage) pairs that cross stages: producer stage, consumer stage, bytes (of
    ``value_bytes``, by default as traced)."""
    if not g.num_edges:
        z = np.zeros(0, np.int64)
        return z, z, z
    s_src, s_dst = stage[g.src], stage[g.dst]
    cross = s_src != s_dst
    key = unique_ints(g.value[cross] * k + s_dst[cross])
    val, consumer = key // k, key % k
    producer_of_value = np.zeros(len(g.value_bytes), np.int64)
    producer_of_value[g.value] = stage[g.src]
    return producer_of_value[val], consumer, (g.value_bytes if value_bytes is None else value_bytes)[val]


def stage_crossings(g: OpGraph, stage: np.ndarray, k: int,
                    dtype: str = "fp32") -> dict[tuple[int, int], tuple[int, int]]:
    """(producer stage, consumer stage) -> (bytes at the training ``dtype``, tensors) crossing per
    microbatch, as :func:`evaluate` counts them (a value read by several ops of one stage is sent to it once)."""
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for s, t, b in zip(*(x.tolist() for x in crossings(g, np.asarray(stage, np.int64), k, value_bytes(g, dtype)))):
        nbytes, count = out.get((s, t), (0, 0))
        out[(s, t)] = (nbytes + int(round(b)), count + 1)
    return dict(sorted(out.items()))


def stage_params(g: OpGraph, stage: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The (stage, parameter) pairs of an assignment, each once: a parameter used on several stages (a tied
    weight) is held by each of them."""
    n_params = max(len(g.param_names), 1)
    pairs = unique_ints(stage[g.use_node] * n_params + g.use_param) if len(g.use_node) else np.zeros(0, np.int64)
    return pairs // n_params, pairs % n_params


def evaluate(p: Problem, stage: np.ndarray) -> Evaluation:
    """Score an assignment: per-stage compute, communication, memory and blended score, and the cut bytes."""
    g, k, r = p.graph, p.num_stages, p.rates
    stage = np.asarray(stage, np.int64)
    counts = np.bincount(stage[p.placeable], minlength=k)  # a stage with only the output idles a device
    compute = np.bincount(stage, weights=p.time, minlength=k)
    prod, cons, nbytes = crossings(g, stage, k, p.value_bytes)
    b_in = np.bincount(cons, weights=nbytes, minlength=k)
    b_out = np.bincount(prod, weights=nbytes, minlength=k)
    msgs = np.bincount(cons, minlength=k) + np.bincount(prod, minlength=k)
    # Activations forward and gradients back: the same bytes twice.
    comm = 2.0 * ((b_in + b_out) / r.link_bytes_per_s + msgs * r.link_latency_s)
    p_stage, p_idx = stage_params(g, stage, k)
    param_bytes = np.bincount(p_stage, weights=p.weights[p_idx], minlength=k)
    param_mem = np.bincount(p_stage, weights=p.param_mem[p_idx], minlength=k)
    act = np.bincount(stage, weights=p.act_bytes, minlength=k) * p.inflight
    memory = param_mem + act
    w = p.options.memory_weight
    cost = (compute + comm) / p.norm_time
    score = (1 - w) * cost + w * memory / p.norm_mem
    objective = (1 - w) * float(cost.max()) + w * float(memory.max()) / p.norm_mem
    return Evaluation(stage=stage, compute_s=compute, comm_s=comm, bytes_in=b_in, bytes_out=b_out,
                      param_bytes=param_bytes, memory=memory, score=score, objective=objective,
                      cut_bytes=int(round(float(nbytes.sum()))), act_in_flight=float(act.sum()),
                      empty=bool(np.any(counts == 0)))


def check_acyclic(g: OpGraph, stage: np.ndarray) -> None:
    """Invariant 1: no tensor flows from a later stage to an earlier one."""
    if g.num_edges:
        back = stage[g.src] > stage[g.dst]
        if back.any():
            e = int(np.argmax(back))
            raise AssertionError(f"plan is cyclic: {g.names[g.src[e]]} (stage {stage[g.src[e]]}) feeds "
                                 f"{g.names[g.dst[e]]} (stage {stage[g.dst[e]]})")


def budget_error(p: Problem, least: Callable[[], Evaluation]) -> MemoryBudgetError:
    """The error for a budget no plan fits, with the numbers of ``least()`` (the most memory-balanced plan), found
    when the message is first read (:class:`MemoryBudgetError`)."""
    assert p.budget is not None, "budget_error is for a problem with a memory budget"
    return MemoryBudgetError(lambda: _budget_message(p, least()))


def _budget_message(p: Problem, ev: Evaluation) -> str:
    """:func:`budget_error`'s message, with the numbers of ``ev``."""
    budget = p.budget
    assert budget is not None
    worst = int(np.argmax(ev.memory))
    total = float(p.param_mem.sum() + p.act_bytes.sum())
    need = int(np.ceil(total / budget))
    op_mem = p.node_param_mem() + p.act_bytes  # one op alone, one microbatch in flight
    big = int(np.argmax(op_mem))
    ops = int(p.placeable.sum())  # the most stages any plan can have (partition's own limit)
    if need > ops or op_mem[big] > budget:
        # More stages cannot help when a single op does not fit, or when it would take more stages than ops.
        more = (f"No number of stages can fit it: op {p.graph.names[big]} ({p.graph.modules[big] or 'the model root'}) "
                f"alone needs {_size(op_mem[big])}, and the model has {ops} ops to place. Fix: a larger device")
    else:
        more = f"Fix: use at least {max(need, p.num_stages + 1)} stages, a larger device"
    return (
        f"no {p.num_stages}-stage plan fits device_memory={_size(budget)}: the most memory-balanced plan's stage "
        f"{worst} needs {_size(ev.memory[worst])} (parameters, gradients and {p.options.optimizer} state, plus "
        f"activations for {int(p.inflight[worst])} microbatch(es) in flight); the whole model needs "
        f"{_size(total)} with one microbatch in flight. {more}, a cheaper optimizer (optimizer='sgd', "
        f"smp inspect --optimizer sgd), or fewer microbatches in flight.")


def _size(x: float) -> str:
    return format_bytes(x, digits=3)
