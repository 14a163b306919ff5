"""The op graph: what the partitioner cuts.

Nodes are ops in a topological order (index order *is* a topological order: every edge goes from a lower
to a higher index), so acyclicity checks and contiguous cuts are array operations, not graph searches.
Edges carry *values*: one value (a tensor produced by an op) may feed several consumers, and crossing a
stage boundary costs its bytes once per consumer stage, not once per consumer op.

Everything is stored in flat numpy arrays so that graphs of 10^6 ops stay cheap; per-node strings (names,
kinds, module paths) are plain lists. Parameters are keyed by a canonical name; a parameter reached under
two names (GPT-2's tied input/output embedding) has one key, so it is counted once per stage that uses it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from ..errors import EngineError

__all__ = ["OpGraph", "GraphError", "unique_ints", "WORK_FIELDS"]

# The per-op fields that say how much work an op does (what a loss priced on the output op adds to).
WORK_FIELDS = ("flops", "move_bytes", "move_float_bytes", "act_bytes", "act_float_bytes")


def unique_ints(a: np.ndarray) -> np.ndarray:
    """``np.unique(a)`` for an integer array, by sorting: the same sorted values, but numpy >= 2.3's
    hash-based ``np.unique`` takes seconds on the 10^6-element keys the partitioner builds, a sort takes
    milliseconds."""
    s = np.sort(np.asarray(a), kind="stable")
    if len(s) == 0:
        return s
    keep = np.empty(len(s), bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


class GraphError(EngineError, ValueError):
    """An op graph that breaks its own invariants (edges that go backwards, mismatched array lengths)."""


@dataclass
class OpGraph:
    """Ops (nodes) and the tensors between them (edges), in topological index order.

    Per node ``i``: ``names[i]``, ``kinds[i]`` (e.g. ``"aten.addmm"``), ``modules[i]`` (the innermost
    ``nn.Module`` path that ran it, ``""`` for the root), ``flops[i]`` (forward), ``out_bytes[i]`` (all
    outputs), ``act_bytes[i]`` (bytes it keeps alive for backward), ``move_bytes[i]`` (memory traffic of
    its forward).
    Per edge ``e``: ``src[e] < dst[e]``, ``value[e]`` (index of the value carried; values are numbered
    ``0 .. num_values-1``) and ``value_bytes[value[e]]``.
    Parameters: ``param_names[p]``, ``param_bytes[p]``, ``param_trainable[p]``; usage pairs
    ``use_node[u]`` uses ``use_param[u]``.
    ``act_float_bytes``, ``move_float_bytes``, ``value_float_bytes`` and ``param_float_bytes``: the part
    of ``act_bytes``, ``move_bytes``, ``value_bytes`` and ``param_bytes`` held in floating-point tensors,
    which a 16-bit training precision halves (:mod:`partitioner.cost.precision`); None (synthetic graphs): all.
    ``members[i]`` lists the fx node names folded into op ``i`` (its getitems, asserts, buffer updates);
    ``fx`` holds what :mod:`partitioner.capture.stage_modules` needs to rebuild executable stages (absent for synthetic
    graphs). ``timed``: the ops' :class:`partitioner.NodeCosts` timed on this machine
    (:func:`partitioner.cost.op_times.timed_costs`, by the first ``measure=True`` partition of the graph), which every
    later one reuses (neither ``fx`` nor ``timed`` is saved).
    """

    names: list[str]
    kinds: list[str]
    modules: list[str]
    flops: np.ndarray
    out_bytes: np.ndarray
    act_bytes: np.ndarray
    move_bytes: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    value: np.ndarray
    value_bytes: np.ndarray
    param_names: list[str] = field(default_factory=list)
    param_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    param_trainable: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    use_node: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    use_param: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    act_float_bytes: np.ndarray | None = None
    move_float_bytes: np.ndarray | None = None
    value_float_bytes: np.ndarray | None = None
    param_float_bytes: np.ndarray | None = None
    members: list[tuple[str, ...]] | None = None
    fx: Any = None
    timed: Any = None

    def __post_init__(self) -> None:
        n = len(self.names)
        for key in ("kinds", "modules", "flops", "out_bytes", "act_bytes", "move_bytes"):
            if len(getattr(self, key)) != n:
                raise GraphError(f"OpGraph.{key} has {len(getattr(self, key))} entries for {n} nodes")
        for key, like in (("act_float_bytes", "act_bytes"), ("move_float_bytes", "move_bytes"),
                          ("value_float_bytes", "value_bytes"), ("param_float_bytes", "param_bytes")):
            part = getattr(self, key)
            if part is not None and len(part) != len(getattr(self, like)):
                raise GraphError(f"OpGraph.{key} has {len(part)} entries for {len(getattr(self, like))} {like}")
        if not (len(self.src) == len(self.dst) == len(self.value)):
            raise GraphError(f"edge arrays differ in length: src {len(self.src)}, dst {len(self.dst)}, "
                             f"value {len(self.value)}")
        if len(self.src) and not np.all(self.src < self.dst):
            bad = int(np.argmax(self.src >= self.dst))
            raise GraphError(f"edge {bad} goes from node {int(self.src[bad])} to node {int(self.dst[bad])}: "
                             "nodes must be numbered in topological order (every edge src < dst)")

    @property
    def num_nodes(self) -> int:
        """Number of ops (the output node included)."""
        return len(self.names)

    @property
    def num_edges(self) -> int:
        """Number of (producer, consumer, value) edges."""
        return len(self.src)

    @property
    def edge_bytes(self) -> np.ndarray:
        """Bytes of the value each edge carries."""
        return self.value_bytes[self.value]

    def add_output_work(self, work: dict[str, float]) -> None:
        """Add ``work`` (per-op field name -> amount: ``flops``, ``move_bytes``, ``act_bytes`` and their
        float parts) to the output op: the loss the last stage computes (``partitioner.trace(loss_fn=...)``)."""
        out = self.kinds.index("output")
        for name, amount in work.items():
            field_ = getattr(self, name)
            if field_ is not None:
                field_[out] += amount

    def output_work(self) -> dict[str, float]:
        """The work priced on the output op (:meth:`add_output_work`), by field."""
        out = self.kinds.index("output")
        return {name: getattr(self, name)[out] for name in WORK_FIELDS if getattr(self, name) is not None}

    def by_first_user(self, per_param: np.ndarray) -> np.ndarray:
        """A per-parameter quantity attributed to each parameter's first user (for prefix sums along the
        topological order); unused parameters count nowhere."""
        out = np.zeros(self.num_nodes, np.asarray(per_param).dtype)
        if len(self.use_node):
            first = np.full(len(self.param_names), self.num_nodes, np.int64)
            np.minimum.at(first, self.use_param, self.use_node)
            used = first < self.num_nodes
            np.add.at(out, first[used], per_param[used])
        return out

    def node_param_bytes(self) -> np.ndarray:
        """Parameter bytes per node, each parameter attributed to its first user."""
        return self.by_first_user(self.param_bytes)

    def predecessors_max(self, stage: np.ndarray) -> np.ndarray:
        """Per node, the largest stage among its producers (-1 where it has none)."""
        out = np.full(self.num_nodes, -1, np.int64)
        np.maximum.at(out, self.dst, stage[self.src])
        return out

    def successors_min(self, stage: np.ndarray, num_stages: int) -> np.ndarray:
        """Per node, the smallest stage among its consumers (num_stages where it has none)."""
        out = np.full(self.num_nodes, num_stages, np.int64)
        np.minimum.at(out, self.src, stage[self.dst])
        return out

    def describe(self) -> str:
        """One line: ops, edges, parameters and forward GFLOPs."""
        return (f"OpGraph({self.num_nodes} ops, {self.num_edges} edges, {len(self.param_names)} parameters, "
                f"{float(self.flops.sum()) / 1e9:.3g} GFLOP forward)")

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the graph's arrays and names to ``path`` (``.npz``; not ``fx``: a loaded graph is synthetic,
        enough to partition and price, not to run)."""
        arrays, lists = {}, {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("fx", "timed") or value is None:
                continue
            if isinstance(value, np.ndarray):
                arrays[f.name] = value
            else:
                lists[f.name] = [list(v) if isinstance(v, tuple) else v for v in value]
        with open(path, "wb") as fh:
            # Numeric arrays only, as load() reads them (allow_pickle=False); naming it also keeps mypy from
            # matching **arrays against the flag.
            np.savez_compressed(fh, allow_pickle=False, **arrays, _lists=np.array(json.dumps(lists)))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "OpGraph":
        """The graph :meth:`save` wrote (without ``fx``)."""
        with np.load(path, allow_pickle=False) as data:
            values: dict[str, Any] = {k: data[k] for k in data.files if k != "_lists"}
            lists = json.loads(str(data["_lists"]))
        if lists.get("members") is not None:
            lists["members"] = [tuple(m) for m in lists["members"]]
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in {**values, **lists}.items() if k in known})
