"""Scoring an assignment of ops to stages: the one place every plan's numbers come from.

Every method (METIS, the DP, the baselines) is scored here, so their bottlenecks and cut bytes compare
like with like. A stage's cost per microbatch is its compute (forward + backward) plus its communication:
each value it receives or sends, once per (value, consumer stage) pair — tensors that skip stages go
straight from producer to consumer — both ways (activations forward, gradients back).
The objective blends time and memory balance with SMP's ``memory_weight`` ``w``:
``score(s) = (1 - w) * cost(s) / mean_cost + w * memory(s) / mean_memory``; the plan minimises the largest
score, then the cut bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .cost import OPTIMIZER_STATE_FACTOR, NodeCosts, in_flight
from .devices import DeviceRates
from .errors import EngineError
from .graph import OpGraph, unique_ints
from .options import PartitionOptions
from .units import format_bytes

__all__ = ["Problem", "Evaluation", "evaluate", "crossings", "stage_crossings", "check_acyclic", "budget_error",
           "MemoryBudgetError"]


class MemoryBudgetError(EngineError, ValueError):
    """No plan fits the per-device memory budget; the message carries the numbers."""


@dataclass
class Problem:
    """A graph priced under some rates, to be cut into ``num_stages`` stages under ``options``; the per-node
    quantities every method and :func:`evaluate` read are derived once here."""

    graph: OpGraph
    costs: NodeCosts
    num_stages: int
    rates: DeviceRates
    options: PartitionOptions
    # Derived per-node quantities (filled in __post_init__).
    time: np.ndarray = field(init=False, repr=False)
    param_mem: np.ndarray = field(init=False, repr=False)
    inflight: np.ndarray = field(init=False, repr=False)
    placeable: np.ndarray = field(init=False, repr=False)  # False for output nodes: they do no work
    norm_time: float = field(init=False)
    norm_mem: float = field(init=False)
    budget: float | None = field(init=False)  # options.device_memory in bytes

    def __post_init__(self) -> None:
        g, o = self.graph, self.options
        self.budget = None if o.device_memory is None else float(o.device_memory)
        self.time = self.costs.total_s
        factor = np.where(g.param_trainable, 2.0 + OPTIMIZER_STATE_FACTOR[o.optimizer], 1.0)
        self.param_mem = g.param_bytes * factor  # weights (+ gradient + optimizer state when trainable)
        self.inflight = np.array([in_flight(s, self.num_stages, o.microbatches, o.pipeline)
                                  for s in range(self.num_stages)], np.float64)
        self.placeable = np.fromiter((kind != "output" for kind in g.kinds), bool, count=g.num_nodes)
        k = self.num_stages
        self.norm_time = max(float(self.time.sum()) / k, 1e-30)
        self.norm_mem = max((float(self.param_mem.sum()) + float(g.act_bytes.sum())) / k, 1.0)

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
    cut_bytes: int
    empty: bool

    @property
    def cost_s(self) -> np.ndarray:
        """Compute plus communication per stage."""
        return self.compute_s + self.comm_s

    @property
    def bottleneck(self) -> float:
        """The slowest stage's cost."""
        return float(self.cost_s.max())

    def key(self, budget: float | None) -> tuple[int, float, int]:
        """Sort key: plans that fit and have no empty stage first, then lowest worst score, then cut bytes."""
        fits = budget is None or bool(np.all(self.memory <= budget))
        return (0 if fits and not self.empty else 1, round(float(self.score.max()), 12), self.cut_bytes)


def crossings(g: OpGraph, stage: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unique (value, consumer stage) pairs that cross stages: producer stage, consumer stage, bytes."""
    if not g.num_edges:
        z = np.zeros(0, np.int64)
        return z, z, z
    s_src, s_dst = stage[g.src], stage[g.dst]
    cross = s_src != s_dst
    key = unique_ints(g.value[cross] * k + s_dst[cross])
    val, consumer = key // k, key % k
    producer_of_value = np.zeros(len(g.value_bytes), np.int64)
    producer_of_value[g.value] = stage[g.src]
    return producer_of_value[val], consumer, g.value_bytes[val]


def stage_crossings(g: OpGraph, stage: np.ndarray, k: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(producer stage, consumer stage) -> (bytes, tensors) crossing per microbatch, as :func:`evaluate`
    counts them (a value read by several ops of one stage is sent to it once)."""
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for s, t, b in zip(*(x.tolist() for x in crossings(g, np.asarray(stage, np.int64), k))):
        nbytes, count = out.get((s, t), (0, 0))
        out[(s, t)] = (nbytes + b, count + 1)
    return dict(sorted(out.items()))


def evaluate(p: Problem, stage: np.ndarray) -> Evaluation:
    """Score an assignment: per-stage compute, communication, memory and blended score, and the cut bytes."""
    g, k, r = p.graph, p.num_stages, p.rates
    stage = np.asarray(stage, np.int64)
    counts = np.bincount(stage[p.placeable], minlength=k)  # a stage with only the output idles a device
    compute = np.bincount(stage, weights=p.time, minlength=k)
    prod, cons, nbytes = crossings(g, stage, k)
    b_in = np.bincount(cons, weights=nbytes, minlength=k)
    b_out = np.bincount(prod, weights=nbytes, minlength=k)
    msgs = np.bincount(cons, minlength=k) + np.bincount(prod, minlength=k)
    # Activations forward and gradients back: the same bytes twice.
    comm = 2.0 * ((b_in + b_out) / r.link_bytes_per_s + msgs * r.link_latency_s)
    n_params = max(len(g.param_names), 1)
    pairs = unique_ints(stage[g.use_node] * n_params + g.use_param) if len(g.use_node) else np.zeros(0, np.int64)
    p_stage, p_idx = pairs // n_params, pairs % n_params
    param_bytes = np.bincount(p_stage, weights=g.param_bytes[p_idx], minlength=k)
    param_mem = np.bincount(p_stage, weights=p.param_mem[p_idx], minlength=k)
    act = np.bincount(stage, weights=g.act_bytes, minlength=k)
    memory = param_mem + act * p.inflight
    w = p.options.memory_weight
    score = (1 - w) * (compute + comm) / p.norm_time + w * memory / p.norm_mem
    return Evaluation(stage=stage, compute_s=compute, comm_s=comm, bytes_in=b_in, bytes_out=b_out,
                      param_bytes=param_bytes, memory=memory, score=score, cut_bytes=int(nbytes.sum()),
                      empty=bool(np.any(counts == 0)))


def check_acyclic(g: OpGraph, stage: np.ndarray) -> None:
    """Invariant 1: no tensor flows from a later stage to an earlier one."""
    if g.num_edges:
        back = stage[g.src] > stage[g.dst]
        if back.any():
            e = int(np.argmax(back))
            raise AssertionError(f"plan is cyclic: {g.names[g.src[e]]} (stage {stage[g.src[e]]}) feeds "
                                 f"{g.names[g.dst[e]]} (stage {stage[g.dst[e]]})")


def budget_error(p: Problem, ev: Evaluation) -> MemoryBudgetError:
    """The error for a budget no plan fits, with the numbers of ``ev`` (the most memory-balanced plan)."""
    worst = int(np.argmax(ev.memory))
    total = float(p.param_mem.sum() + p.graph.act_bytes.sum())
    need = int(np.ceil(total / p.budget))
    op_mem = p.node_param_mem() + p.graph.act_bytes  # one op alone, one microbatch in flight
    big = int(np.argmax(op_mem))
    ops = int(p.placeable.sum())  # the most stages any plan can have (partition's own limit)
    if need > ops or op_mem[big] > p.budget:
        # More stages cannot help when a single op does not fit, or when it would take more stages than ops.
        more = (f"No number of stages can fit it: op {p.graph.names[big]} ({p.graph.modules[big] or 'the model root'}) "
                f"alone needs {_size(op_mem[big])}, and the model has {ops} ops to place. Fix: a larger device")
    else:
        more = f"Fix: use at least {max(need, p.num_stages + 1)} stages, a larger device"
    return MemoryBudgetError(
        f"no {p.num_stages}-stage plan fits device_memory={_size(p.budget)}: the most memory-balanced plan's stage "
        f"{worst} needs {_size(ev.memory[worst])} (parameters, gradients and {p.options.optimizer} state, plus "
        f"activations for {int(p.inflight[worst])} microbatch(es) in flight); the whole model needs "
        f"{_size(total)} with one microbatch in flight. {more}, a cheaper optimizer (optimizer='sgd', "
        f"smp inspect --optimizer sgd), or fewer microbatches in flight.")


def _size(x: float) -> str:
    return format_bytes(x, digits=3)
