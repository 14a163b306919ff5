"""The partition plan: which op runs on which stage, and what that costs.

A plan is plain data (a dataclass that round-trips through JSON byte for byte); the op graph it was made
from is attached but not serialized, and :meth:`PartitionPlan.stage_modules` needs it to build the
executable stages.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np

from .errors import EngineError
from .graph import OpGraph, unique_ints
from .objective import Evaluation, Problem, check_acyclic, crossings
from .split import split
from .units import format_bytes

__all__ = ["StageSummary", "PartitionPlan", "PlanMismatchError", "make_plan"]


class PlanMismatchError(EngineError, ValueError):
    """A plan (from a file) that does not cut the model it is given to; the message says what differs."""


@dataclass
class StageSummary:
    """One stage: its share of the model and its predicted cost per microbatch."""

    index: int
    nodes: int
    flops: float
    param_bytes: int
    memory_bytes: int
    forward_s: float
    backward_s: float
    comm_s: float
    cost_s: float
    bytes_in: int
    bytes_out: int
    modules: list[str]
    inputs_from: list[int]
    outputs_to: list[int]
    measured_s: float | None = None


@dataclass
class PartitionPlan:
    """``assignment`` maps op name -> stage; stage ``s`` only reads values from stages ``<= s``.

    ``lower_bound = max(total compute / num_stages, largest op)`` is a true lower bound on any plan's
    bottleneck under the same cost model, so ``balance = bottleneck / lower_bound >= 1`` says how far from
    perfect this plan can at most be. ``shared_params`` lists parameters used on several stages (tied
    embeddings): each such stage holds a replica and their gradients are summed.
    """

    num_stages: int
    method: str
    assignment: dict[str, int]
    stages: list[StageSummary]
    cut_bytes: int
    lower_bound: float
    bottleneck: float
    balance: float
    shared_params: dict[str, list[int]] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    rates: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    graph: Any = field(default=None, repr=False, compare=False)

    # JSON names carry units; attributes keep the short names the API documents.
    _RENAMED = {"lower_bound": "lower_bound_s", "bottleneck": "bottleneck_s"}

    @property
    def max_memory_bytes(self) -> int:
        """The largest stage's memory."""
        return max(s.memory_bytes for s in self.stages)

    @property
    def axes(self) -> tuple[float, int, int]:
        """What plans are compared by (:func:`partitioner.objective.dominates`): bottleneck seconds, cut
        bytes and the largest stage's memory."""
        return self.bottleneck, self.cut_bytes, self.max_memory_bytes

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (the op graph is not included; ``extra`` keys sit at the top level)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "graph":
                continue
            value = getattr(self, f.name)
            if f.name == "stages":
                value = [asdict(s) for s in value]
            elif f.name == "extra":
                out.update(value)
                continue
            out[self._RENAMED.get(f.name, f.name)] = value
        return out

    def to_json(self, path: str | None = None) -> str:
        """The plan as JSON text (sorted keys, so equal plans give equal bytes), also written to ``path``."""
        text = json.dumps(self.to_dict(), indent=1, sort_keys=True)
        if path is not None:
            with open(path, "w") as fh:
                fh.write(text + "\n")
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PartitionPlan":
        """The plan of :meth:`to_dict`'s data; unknown keys go to ``extra``."""
        back = {v: k for k, v in cls._RENAMED.items()}
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in data.items():
            name = back.get(key, key)
            if name in known and name not in ("extra", "graph"):
                kwargs[name] = value
            else:
                extra[key] = value
        missing = {"num_stages", "method", "assignment", "stages"} - set(kwargs)
        if missing:
            raise ValueError(f"not a partition plan: missing {sorted(missing)}")
        kwargs["stages"] = [StageSummary(**s) for s in kwargs["stages"]]
        kwargs["assignment"] = {k: int(v) for k, v in kwargs["assignment"].items()}
        kwargs["shared_params"] = {k: list(v) for k, v in kwargs.get("shared_params", {}).items()}
        return cls(**kwargs, extra=extra)

    @classmethod
    def from_json(cls, text_or_path: str) -> "PartitionPlan":
        """The plan of :meth:`to_json`'s text, or of the JSON file at that path."""
        text = text_or_path
        if not text_or_path.lstrip().startswith("{"):
            with open(text_or_path) as fh:
                text = fh.read()
        return cls.from_dict(json.loads(text))

    def bind(self, graph: OpGraph, source: str = "the plan", num_stages: int | None = None) -> "PartitionPlan":
        """This plan attached to ``graph``, a trace of the model it is to cut, checked to fit: the same ops
        (and ``num_stages`` stages when given), else a :class:`PlanMismatchError` naming ``source``."""
        if num_stages is not None and self.num_stages != num_stages:
            raise PlanMismatchError(f"{source} has {self.num_stages} stages but this run has {num_stages} "
                                    f"pipeline stages: make the plan for {num_stages} stages, or run with "
                                    f"{self.num_stages}")
        ops, planned = set(graph.names), set(self.assignment)
        if ops != planned:
            order = {n: i for i, n in enumerate(graph.names)}
            missing, extra = sorted(ops - planned, key=order.__getitem__), sorted(planned - ops)
            parts = [f"{len(missing)} of its {len(ops)} traced ops are not in the plan (first: {missing[:3]})"
                     if missing else "", f"{len(extra)} of the plan's {len(planned)} ops are not in the model "
                     f"(first: {extra[:3]})" if extra else ""]
            raise PlanMismatchError(
                f"{source} does not fit this model: {' and '.join(p for p in parts if p)}; it was made for another "
                "model or other input shapes. Make the plan from this model: smp replan on a profile of it, or "
                "partitioner.partition")
        return replace(self, graph=graph)

    def stage_modules(self, graph: Any = None) -> list:
        """One executable ``nn.Module`` per stage (see :mod:`partitioner.split`)."""
        return split(self._bound(graph), self.assignment, self.num_stages).stages

    def as_module(self, graph: Any = None):
        """An ``nn.Module`` that runs every stage in order in this process, with the model's signature."""
        return split(self._bound(graph), self.assignment, self.num_stages).as_module()

    def _bound(self, graph: Any) -> Any:
        graph = graph if graph is not None else self.graph
        if graph is None or graph.fx is None:
            raise ValueError("this plan has no traced graph attached (it was loaded from JSON or made from a "
                             "synthetic graph): pass graph=partitioner.trace(model, args, kwargs)")
        return graph

    def stage_of_module(self) -> dict[str, list[int]]:
        """Module path -> the stages that run some of its ops (for explaining a plan in model terms)."""
        out: dict[str, set[int]] = {}
        if self.graph is None:
            return {}
        for name, module in zip(self.graph.names, self.graph.modules):
            out.setdefault(module, set()).add(self.assignment[name])
        return {k: sorted(v) for k, v in out.items()}

    def summary(self) -> str:
        """A readable table: one row per stage, then the totals."""
        head = (f"{'stage':>5} {'ops':>6} {'params':>10} {'GFLOP':>9} {'fwd ms':>8} {'bwd ms':>8} "
                f"{'comm ms':>8} {'cost ms':>8} {'memory':>10} {'in':>9} {'out':>9}  modules")
        rows = [head, "-" * len(head)]
        for s in self.stages:
            rows.append(f"{s.index:>5} {s.nodes:>6} {format_bytes(s.param_bytes):>10} {s.flops / 1e9:>9.3f} "
                        f"{s.forward_s * 1e3:>8.3f} {s.backward_s * 1e3:>8.3f} {s.comm_s * 1e3:>8.3f} "
                        f"{s.cost_s * 1e3:>8.3f} {format_bytes(s.memory_bytes):>10} {format_bytes(s.bytes_in):>9} "
                        f"{format_bytes(s.bytes_out):>9}  {_module_range(s.modules)}")
        rows.append(f"method {self.method}: bottleneck {self.bottleneck * 1e3:.3f} ms, lower bound "
                    f"{self.lower_bound * 1e3:.3f} ms, balance {self.balance:.3f}, cut {format_bytes(self.cut_bytes)} "
                    "per microbatch")
        if self.shared_params:
            rows.append("shared parameters (replicated, gradients summed): " +
                        ", ".join(f"{k} on stages {v}" for k, v in sorted(self.shared_params.items())))
        return "\n".join(rows)


def _module_range(modules: list[str]) -> str:
    if not modules:
        return ""
    return modules[0] if len(modules) == 1 else f"{modules[0]} .. {modules[-1]}"


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




def make_plan(p: Problem, ev: Evaluation, method: str) -> PartitionPlan:
    """The plan of an evaluated assignment: per-stage summaries, shared parameters, options and rates."""
    g, k = p.graph, p.num_stages
    check_acyclic(g, ev.stage)
    prod, cons, _ = crossings(g, ev.stage, k)
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
        options={**p.options.to_dict(p.rates), "measured": p.costs.measured},
        rates=p.rates.to_dict(), graph=g,
    )
