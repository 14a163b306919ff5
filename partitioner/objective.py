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

from .cost import OPTIMIZER_STATE_FACTOR, DeviceRates, NodeCosts, in_flight
from .graph import OpGraph, unique_ints
from .plan import PartitionPlan, StageSummary

__all__ = ["Problem", "Evaluation", "evaluate", "make_plan", "MemoryBudgetError"]


class MemoryBudgetError(ValueError):
    """No plan fits the per-device memory budget; the message carries the numbers."""


@dataclass
class Problem:
    graph: OpGraph
    costs: NodeCosts
    num_stages: int
    rates: DeviceRates
    memory_weight: float = 0.2
    device_memory: float | None = None
    microbatches: int = 1
    pipeline: str = "1f1b"
    optimizer: str = "adam"
    seed: int = 0
    # Derived per-node quantities (filled in __post_init__).
    time: np.ndarray = field(init=False, repr=False)
    param_mem: np.ndarray = field(init=False, repr=False)
    inflight: np.ndarray = field(init=False, repr=False)
    placeable: np.ndarray = field(init=False, repr=False)  # False for output nodes: they do no work
    norm_time: float = field(init=False)
    norm_mem: float = field(init=False)

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_STATE_FACTOR:
            raise ValueError(f"optimizer={self.optimizer!r} is not known; use one of {sorted(OPTIMIZER_STATE_FACTOR)}")
        g = self.graph
        self.time = self.costs.total_s
        factor = np.where(g.param_trainable, 2.0 + OPTIMIZER_STATE_FACTOR[self.optimizer], 1.0)
        self.param_mem = g.param_bytes * factor  # weights (+ gradient + optimizer state when trainable)
        self.inflight = np.array([in_flight(s, self.num_stages, self.microbatches, self.pipeline)
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
        return max(float(self.time.sum()) / self.num_stages, float(self.time.max(initial=0.0)))


@dataclass
class Evaluation:
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
        return self.compute_s + self.comm_s

    @property
    def bottleneck(self) -> float:
        return float(self.cost_s.max())

    def key(self, budget: float | None) -> tuple[int, float, int]:
        """Sort key: plans that fit and have no empty stage first, then lowest worst score, then cut bytes."""
        fits = budget is None or bool(np.all(self.memory <= budget))
        return (0 if fits and not self.empty else 1, round(float(self.score.max()), 12), self.cut_bytes)


def _crossings(g: OpGraph, stage: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def evaluate(p: Problem, stage: np.ndarray) -> Evaluation:
    g, k, r = p.graph, p.num_stages, p.rates
    stage = np.asarray(stage, np.int64)
    counts = np.bincount(stage[p.placeable], minlength=k)  # a stage with only the output idles a device
    compute = np.bincount(stage, weights=p.time, minlength=k)
    prod, cons, nbytes = _crossings(g, stage, k)
    b_in = np.bincount(cons, weights=nbytes, minlength=k)
    b_out = np.bincount(prod, weights=nbytes, minlength=k)
    msgs = np.bincount(cons, minlength=k) + np.bincount(prod, minlength=k)
    # Activations forward and gradients back: the same bytes twice.
    comm = 2.0 * ((b_in + b_out) / r.link_bytes_per_s + msgs * r.link_latency_s)
    pairs = unique_ints(stage[g.use_node] * max(len(g.param_names), 1) + g.use_param) if len(g.use_node) else np.zeros(0, np.int64)
    p_stage, p_idx = pairs // max(len(g.param_names), 1), pairs % max(len(g.param_names), 1)
    param_bytes = np.bincount(p_stage, weights=g.param_bytes[p_idx], minlength=k)
    param_mem = np.bincount(p_stage, weights=p.param_mem[p_idx], minlength=k)
    act = np.bincount(stage, weights=g.act_bytes, minlength=k)
    memory = param_mem + act * p.inflight
    w = p.memory_weight
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
    worst = int(np.argmax(ev.memory))
    total = float(p.param_mem.sum() + p.graph.act_bytes.sum())
    need = int(np.ceil(total / p.device_memory))
    op_mem = p.node_param_mem() + p.graph.act_bytes  # one op alone, one microbatch in flight
    big = int(np.argmax(op_mem))
    ops = int(p.placeable.sum())  # the most stages any plan can have (partition's own limit)
    if need > ops or op_mem[big] > p.device_memory:
        # More stages cannot help when a single op does not fit, or when it would take more stages than ops.
        more = (f"No number of stages can fit it: op {p.graph.names[big]} ({p.graph.modules[big] or 'the model root'}) "
                f"alone needs {_gib(op_mem[big])}, and the model has {ops} ops to place. Fix: a larger device")
    else:
        more = f"Fix: use at least {max(need, p.num_stages + 1)} stages, a larger device"
    return MemoryBudgetError(
        f"no {p.num_stages}-stage plan fits device_memory={_gib(p.device_memory)}: the most memory-balanced plan's stage "
        f"{worst} needs {_gib(ev.memory[worst])} (parameters, gradients and {p.optimizer} state, plus "
        f"activations for {int(p.inflight[worst])} microbatch(es) in flight); the whole model needs "
        f"{_gib(total)} with one microbatch in flight. {more}, a cheaper optimizer (optimizer='sgd', "
        f"smp inspect --optimizer sgd), or fewer microbatches in flight.")


def _stage_modules(g: OpGraph, stage: np.ndarray, k: int) -> list[list[str]]:
    """Per stage, the module paths of its ops in order of first appearance (vectorised for big graphs)."""
    ids: dict[str, int] = {}
    mid = np.fromiter((ids.setdefault(m, len(ids)) for m in g.modules), np.int64, count=g.num_nodes)
    names = list(ids)
    key = stage * max(len(names), 1) + mid
    order = np.argsort(key, kind="stable")
    sk = key[order]
    first = order[np.concatenate([[True], sk[1:] != sk[:-1]])] if len(sk) else order
    first.sort()
    out: list[list[str]] = [[] for _ in range(k)]
    for i in first.tolist():
        out[int(stage[i])].append(names[int(mid[i])])
    return out


def _gib(x: float) -> str:
    """Bytes in the largest binary unit that keeps them >= 1 (small models must not print "0.000 GiB")."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= scale:
            return f"{x / scale:.3f} {unit}"
    return f"{x:.0f} B"


def make_plan(p: Problem, ev: Evaluation, method: str) -> PartitionPlan:
    g, k = p.graph, p.num_stages
    check_acyclic(g, ev.stage)
    prod, cons, _ = _crossings(g, ev.stage, k)
    stage_list = ev.stage.tolist()
    modules = _stage_modules(g, ev.stage, k)
    fwd = np.bincount(ev.stage, weights=p.costs.forward_s, minlength=k)
    bwd = np.bincount(ev.stage, weights=p.costs.backward_s, minlength=k)
    flops = np.bincount(ev.stage, weights=g.flops, minlength=k)
    counts = np.bincount(ev.stage, minlength=k)
    stages = [StageSummary(
        index=s, nodes=int(counts[s]), flops=float(flops[s]), param_bytes=int(ev.param_bytes[s]),
        memory_bytes=int(ev.memory[s]), forward_s=float(fwd[s]), backward_s=float(bwd[s]),
        comm_s=float(ev.comm_s[s]), cost_s=float(ev.cost_s[s]), bytes_in=int(ev.bytes_in[s]),
        bytes_out=int(ev.bytes_out[s]), modules=[m for m in modules[s] if m] or [""],
        inputs_from=sorted(set(prod[cons == s].tolist())), outputs_to=sorted(set(cons[prod == s].tolist())),
    ) for s in range(k)]
    shared: dict[str, list[int]] = {}
    if len(g.use_node):
        # (parameter, stage) pairs, sorted by parameter then stage; keep parameters held by several stages.
        pairs = unique_ints(g.use_param * k + ev.stage[g.use_node])
        q, s_of = pairs // k, pairs % k
        many = np.flatnonzero(np.bincount(q, minlength=len(g.param_names)) > 1)
        in_many = np.isin(q, many)
        starts = np.searchsorted(q[in_many], many)
        held = np.split(s_of[in_many], starts[1:]) if len(many) else []
        shared = {g.param_names[int(qq)]: h.tolist() for qq, h in zip(many, held)}
    lb = p.lower_bound
    return PartitionPlan(
        num_stages=k, method=method, assignment=dict(zip(g.names, stage_list)), stages=stages,
        cut_bytes=ev.cut_bytes, lower_bound=lb, bottleneck=ev.bottleneck,
        balance=ev.bottleneck / lb if lb > 0 else 1.0, shared_params=shared,
        options={"memory_weight": p.memory_weight, "device_memory": p.device_memory,
                 "microbatches": p.microbatches, "pipeline": p.pipeline, "optimizer": p.optimizer,
                 "seed": p.seed, "measured": p.costs.measured},
        rates=p.rates.to_dict(), graph=g,
    )
