"""The partition plan: which op runs on which stage, and what that costs.

A plan is plain data (a dataclass that round-trips through JSON byte for byte); the op graph it was made
from is attached but not serialized, and :meth:`PartitionPlan.stage_modules` needs it to build the
executable stages.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any, Iterable

import numpy as np

from ..capture.chunk import split_columns
from ..capture.graph import OpGraph, unique_ints
from ..capture.plan_inputs import input_record, inputs_mismatch, inputs_named_apart
from ..capture.split_points import RANKS_KEY, stages_note
from ..capture.stage_modules import split
from ..errors import EngineError
from ..tp.pricing import degree_mismatch, tensor_parallel_record
from ..units import format_bytes
from .objective import Evaluation, Problem, check_acyclic, crossings

__all__ = ["StageSummary", "PartitionPlan", "PlanError", "PlanMismatchError", "make_plan"]


class PlanError(EngineError, ValueError):
    """A partition plan's JSON is malformed; the message names the key and the value."""


class PlanMismatchError(PlanError):
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
    embeddings): each such stage holds a replica and their gradients are summed. ``split_ops`` names the
    linear layers computed in column chunks (:mod:`partitioner.capture.chunk`) and their chunk counts: binding the
    plan to a fresh trace of the model splits them the same way. ``tensor_parallel``: for a graph sharded for
    tensor parallelism, its ``degree``, the tp collectives' seconds per stage and microbatch (``comm_s``, in the
    stage costs) and the ``sharding`` (:func:`partitioner.tp.pricing.tensor_parallel_record`); empty (and absent from
    the JSON) for degree 1. Such a plan binds only to a graph sharded for the same degree. ``inputs``: the traced
    example inputs (one microbatch), name -> shape and dtype (:mod:`partitioner.capture.plan_inputs`); empty when
    unknown."""

    num_stages: int
    method: str
    assignment: dict[str, int]
    stages: list[StageSummary]
    cut_bytes: int
    lower_bound: float
    bottleneck: float
    balance: float
    shared_params: dict[str, list[int]] = field(default_factory=dict)
    split_ops: dict[str, int] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    rates: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    tensor_parallel: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)
    graph: Any = field(default=None, repr=False, compare=False)

    # JSON names carry units; attributes keep the short names the API documents.
    _RENAMED = {"lower_bound": "lower_bound_s", "bottleneck": "bottleneck_s"}

    @property
    def max_memory_bytes(self) -> int:
        """The largest stage's memory."""
        return max(s.memory_bytes for s in self.stages)

    @property
    def axes(self) -> tuple[float, int, int]:
        """What plans are compared by (:func:`partitioner.cut.objective.dominates`): bottleneck seconds, cut
        bytes and the largest stage's memory."""
        return self.bottleneck, self.cut_bytes, self.max_memory_bytes

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (the op graph is not included; ``extra`` keys sit at the top level)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "graph" or (f.name in ("tensor_parallel", "inputs") and not value):
                continue
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
        """The plan of :meth:`to_dict`'s data; unknown keys go to ``extra``. Malformed data (a missing key, a
        value of the wrong type, a stage out of range) is a :class:`PlanError` naming the key and value."""
        if not isinstance(data, dict):
            raise PlanError(f"not a partition plan: expected a JSON object, got {type(data).__name__}")
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
        missing = sorted({"num_stages", "method", "assignment", "stages"} - set(kwargs))
        if missing:
            raise PlanError(f"not a partition plan: missing {missing}")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [cls._RENAMED.get(n, n) for n in required if n not in kwargs]
        if missing:
            raise PlanError(f"the partition plan is missing {missing}")
        _check_plan(kwargs)
        kwargs["stages"] = [StageSummary(**s) for s in kwargs["stages"]]
        kwargs["assignment"] = dict(kwargs["assignment"])
        kwargs["shared_params"] = {k: list(v) for k, v in kwargs.get("shared_params", {}).items()}
        kwargs["split_ops"] = dict(kwargs.get("split_ops", {}))
        return cls(**kwargs, extra=extra)

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike[str]) -> "PartitionPlan":
        """The plan of :meth:`to_json`'s text, or of the JSON file at that path."""
        from_file = isinstance(text_or_path, os.PathLike) or not text_or_path.lstrip().startswith(("{", "["))
        if from_file:
            with open(text_or_path) as fh:
                text = fh.read()
        else:
            text = str(text_or_path)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            where = f" in {os.fspath(text_or_path)}" if from_file else ""
            raise PlanError(f"not a partition plan: invalid JSON{where} at line {exc.lineno} column {exc.colno}: "
                            f"{exc.msg}") from None
        return cls.from_dict(data)

    def bind(self, graph: OpGraph, source: str = "the plan", num_stages: int | None = None,
             microbatches: int | None = None) -> "PartitionPlan":
        """This plan attached to ``graph``, a trace of the model it is to cut, checked to fit: the same ops (and
        ``num_stages`` stages), else a :class:`PlanMismatchError` naming ``source``. With ``microbatches``, ``graph``
        traced example inputs (one microbatch of m) of the shapes and dtypes of ``inputs`` (:mod:`.plan_inputs`)."""
        if num_stages is not None and self.num_stages != num_stages:
            raise PlanMismatchError(f"{source} has {self.num_stages} stages but this run has {num_stages} "
                                    f"pipeline stages: make the plan for {num_stages} stages, or run with "
                                    f"{self.num_stages}")
        if (why := degree_mismatch(self.tensor_parallel, graph) or inputs_mismatch(self.inputs, graph, microbatches)):
            raise PlanMismatchError(f"{source} {why}")
        if self.split_ops and graph.fx is not None and not graph.fx.split_ops:
            graph = split_columns(graph, self.split_ops)
        ops, planned = set(graph.names), set(self.assignment)
        if ops != planned:
            order = {n: i for i, n in enumerate(graph.names)}
            missing, extra = sorted(ops - planned, key=order.__getitem__), sorted(planned - ops)
            parts = [f"{len(missing)} of its {len(ops)} traced ops are not in the plan (first: {missing[:3]})"
                     if missing else "", f"{len(extra)} of the plan's {len(planned)} ops are not in the model "
                     f"(first: {extra[:3]})" if extra else ""]
            raise PlanMismatchError(
                f"{source} does not fit this model: {' and '.join(p for p in parts if p)}"
                f"{inputs_named_apart(self.inputs, graph)}")
        return replace(self, graph=graph)

    def stage_modules(self, graph: Any = None) -> list:
        """One executable ``nn.Module`` per stage (see :mod:`partitioner.capture.stage_modules`)."""
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

    def traced_graph(self) -> Any:
        """The traced :class:`~partitioner.capture.graph.OpGraph` this plan was made or bound with; an error that says
        how to bind one when the plan came from JSON or a synthetic graph."""
        return self._bound(None)

    def stage_of_ops(self, graph: Any) -> np.ndarray:
        """The stage of every op of ``graph`` (the plan's graph), as an int64 array in graph order."""
        return np.array([self.assignment[n] for n in graph.names], np.int64)

    def stage_tensors(self, stages: Iterable[int], graph: Any = None) -> set[str]:
        """Names of the parameters and buffers the given stages use (a tied weight by its first name).
        Tensors no op uses belong to stage 0, so that some rank holds (and saves) them."""
        g = self._bound(graph)
        want = set(stages)
        stage = self.stage_of_ops(g)
        used = {int(q) for q, s in zip(g.use_param.tolist(), stage[g.use_node].tolist()) if s in want}
        if 0 in want:
            used |= set(range(len(g.param_names))) - set(g.use_param.tolist())
        return {g.param_names[q] for q in used}

    def stage_of_module(self) -> dict[str, list[int]]:
        """Module path -> the stages that run some of its ops (for explaining a plan in model terms)."""
        out: dict[str, set[int]] = {}
        if self.graph is None:
            return {}
        for name, module in zip(self.graph.names, self.graph.modules):
            out.setdefault(module, set()).add(self.assignment[name])
        return {k: sorted(v) for k, v in out.items()}

    def summary(self) -> str:
        """A readable table: one row per stage, then the totals (and the stages' origin and ranks: stages_note)."""
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
        rows += stages_note(self.method, self.num_stages, self.extra.get(RANKS_KEY))  # the markers', on the ranks
        if self.shared_params:
            rows.append("shared parameters (replicated, gradients summed): " +
                        ", ".join(f"{k} on stages {v}" for k, v in sorted(self.shared_params.items())))
        return "\n".join(rows)


def _check_int(key: str, value: Any, lo: int = 0, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"plan key {key}: expected an integer, got {value!r}")
    if value < lo or (hi is not None and value >= hi):
        bound = f"in [{lo}, {hi})" if hi is not None else f">= {lo}"
        raise PlanError(f"plan key {key}: {value} is out of range, expected an integer {bound}")


def _check_number(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise PlanError(f"plan key {key}: expected a finite number >= 0, got {value!r}")


def _check_type(key: str, value: Any, kind: type) -> None:
    if not isinstance(value, kind):
        raise PlanError(f"plan key {key}: expected a JSON {'object' if kind is dict else kind.__name__}, "
                        f"got {value!r}")


def _check_stage(i: int, stage: Any, k: int) -> None:
    """One ``stages[i]`` object: exactly StageSummary's keys, each of its type, stage numbers in [0, k)."""
    _check_type(f"stages[{i}]", stage, dict)
    spec = {f.name: f for f in fields(StageSummary)}
    unknown = sorted(set(stage) - set(spec))
    missing = [n for n, f in spec.items() if n not in stage and f.default is MISSING]
    if unknown or missing:
        raise PlanError(f"plan key stages[{i}]: " + (f"unknown key(s) {unknown}" if unknown else
                        f"missing {missing}") + f"; a stage has {sorted(spec)}")
    _check_int(f"stages[{i}].index", stage["index"], i, i + 1)
    for name in ("nodes", "param_bytes", "memory_bytes", "bytes_in", "bytes_out"):
        _check_int(f"stages[{i}].{name}", stage[name])
    for name in ("flops", "forward_s", "backward_s", "comm_s", "cost_s"):
        _check_number(f"stages[{i}].{name}", stage[name])
    if stage.get("measured_s") is not None:
        _check_number(f"stages[{i}].measured_s", stage["measured_s"])
    _check_type(f"stages[{i}].modules", stage["modules"], list)
    for j, m in enumerate(stage["modules"]):
        _check_type(f"stages[{i}].modules[{j}]", m, str)
    for name in ("inputs_from", "outputs_to"):
        _check_type(f"stages[{i}].{name}", stage[name], list)
        for j, s in enumerate(stage[name]):
            _check_int(f"stages[{i}].{name}[{j}]", s, 0, k)


def _check_plan(kw: dict[str, Any]) -> None:
    """Every key :meth:`PartitionPlan.from_dict` reads, before any of it is used."""
    _check_int("num_stages", kw["num_stages"], 1)
    k = kw["num_stages"]
    _check_type("method", kw["method"], str)
    _check_type("assignment", kw["assignment"], dict)
    for op, s in kw["assignment"].items():
        _check_int(f"assignment[{op!r}]", s, 0, k)
    _check_type("stages", kw["stages"], list)
    if len(kw["stages"]) != k:
        raise PlanError(f"plan key stages: {len(kw['stages'])} stage(s) listed but num_stages is {k}")
    for i, stage in enumerate(kw["stages"]):
        _check_stage(i, stage, k)
    _check_int("cut_bytes", kw["cut_bytes"])
    for name in ("lower_bound", "bottleneck", "balance"):
        _check_number(PartitionPlan._RENAMED.get(name, name), kw[name])
    _check_type("shared_params", kw.get("shared_params", {}), dict)
    for param, held in kw.get("shared_params", {}).items():
        _check_type(f"shared_params[{param!r}]", held, list)
        for j, s in enumerate(held):
            _check_int(f"shared_params[{param!r}][{j}]", s, 0, k)
    _check_type("split_ops", kw.get("split_ops", {}), dict)
    for op, chunks in kw.get("split_ops", {}).items():
        _check_int(f"split_ops[{op!r}]", chunks, 2)
    for key in ("options", "tensor_parallel", "inputs"):
        _check_type(key, kw.get(key, {}), dict)
    if kw.get("tensor_parallel"):
        _check_int("tensor_parallel.degree", kw["tensor_parallel"].get("degree"), 1)
    _check_type("rates", kw.get("rates", {}), dict)
    for name, value in kw.get("rates", {}).items():
        if value is not None and not isinstance(value, str):  # a rate, or a profile name / None (DeviceRates)
            _check_number(f"rates[{name!r}]", value)


def _module_range(modules: list[str]) -> str:
    return "" if not modules else modules[0] if len(modules) == 1 else f"{modules[0]} .. {modules[-1]}"


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
        split_ops=dict(g.fx.split_ops) if g.fx is not None else {},
        options={**p.options.to_dict(p.rates), "measured": p.costs.measured}, rates=p.rates.to_dict(), graph=g,
        tensor_parallel=tensor_parallel_record(g, ev.stage, k, p.costs.tp_comm_s), inputs=input_record(g),
    )
