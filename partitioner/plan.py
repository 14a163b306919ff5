"""The partition plan: which op runs on which stage, and what that costs.

A plan is plain data (a dataclass that round-trips through JSON byte for byte); the op graph it was made
from is attached but not serialized, and :meth:`PartitionPlan.stage_modules` needs it to build the
executable stages.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["StageSummary", "PartitionPlan"]


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

    def to_dict(self) -> dict[str, Any]:
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
        text = json.dumps(self.to_dict(), indent=1, sort_keys=True)
        if path is not None:
            with open(path, "w") as fh:
                fh.write(text + "\n")
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PartitionPlan":
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
        text = text_or_path
        if not text_or_path.lstrip().startswith("{"):
            with open(text_or_path) as fh:
                text = fh.read()
        return cls.from_dict(json.loads(text))

    def stage_modules(self, graph: Any = None) -> list:
        """One executable ``nn.Module`` per stage (see :mod:`partitioner.split`)."""
        from .split import split

        return split(self._bound(graph), self.assignment, self.num_stages).stages

    def as_module(self, graph: Any = None):
        """An ``nn.Module`` that runs every stage in order in this process, with the model's signature."""
        from .split import split

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
            rows.append(f"{s.index:>5} {s.nodes:>6} {_size(s.param_bytes):>10} {s.flops / 1e9:>9.3f} "
                        f"{s.forward_s * 1e3:>8.3f} {s.backward_s * 1e3:>8.3f} {s.comm_s * 1e3:>8.3f} "
                        f"{s.cost_s * 1e3:>8.3f} {_size(s.memory_bytes):>10} {_size(s.bytes_in):>9} "
                        f"{_size(s.bytes_out):>9}  {_module_range(s.modules)}")
        rows.append(f"method {self.method}: bottleneck {self.bottleneck * 1e3:.3f} ms, lower bound "
                    f"{self.lower_bound * 1e3:.3f} ms, balance {self.balance:.3f}, cut {_size(self.cut_bytes)} "
                    "per microbatch")
        if self.shared_params:
            rows.append("shared parameters (replicated, gradients summed): " +
                        ", ".join(f"{k} on stages {v}" for k, v in sorted(self.shared_params.items())))
        return "\n".join(rows)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _module_range(modules: list[str]) -> str:
    if not modules:
        return ""
    return modules[0] if len(modules) == 1 else f"{modules[0]} .. {modules[-1]}"
