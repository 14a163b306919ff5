"""In-place mutations as dependencies: which ops must share a stage so that every reader sees the right value.

torch.export's training IR keeps in-place ops (``add_``, ``copy_``, ``mul_`` on buffers) and views
(``slice``, ``view``, ``transpose``, ...). Python's ``y[:, :4] += z`` becomes ``add_`` on a ``slice`` of
``y`` plus a ``copy_`` write-back with no users, while later readers of ``y`` still name the node that
produced ``y``: the data edges alone say nothing about the mutation. A stage boundary copies a value (its
receiver gets a fresh tensor), so a mutation placed on another stage than the value it changes — or than a
reader that must see the value before or after it — is silently lost or seen too early.

The rule, per *alias class* (a root value and every view of it, found from the ATen schemas' alias
annotations the way functionalization reads them; Bradbury & Fu, "Functionalization in PyTorch", 2022):
the root's producer, every view and every mutation of the class, and every reader of the class that runs
before its last mutation share one stage — and so does everything on a path between two of them (the
group's convex closure in the op DAG), so that contracting the group into one node keeps the graph
acyclic. A root that is a buffer, a parameter or a model input also keeps all its direct readers: its
storage outlives the step, so a reader on another rank would see a stale replica. Readers after the last
mutation stay free: the value they receive is sent after the stage has run, mutations included.
"""
from __future__ import annotations

import operator
from typing import Iterable

import torch
import torch.fx

__all__ = ["written_inputs", "aliased_input", "colocated_groups"]


def _arg(node: torch.fx.Node, i: int, name: str) -> object:
    return node.args[i] if i < len(node.args) else node.kwargs.get(name)


def _nodes(value: object) -> list[torch.fx.Node]:
    items = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in items if isinstance(v, torch.fx.Node)]


def written_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The input nodes that ``node`` updates in place, by its ATen schema's alias annotations (``Tensor(a!)``)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out: list[torch.fx.Node] = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out.extend(_nodes(_arg(node, i, arg.name)))
    return out


def aliased_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The input whose storage ``node``'s output shares (a view, or an in-place op returning its input), or None."""
    if node.target is operator.getitem:
        src = node.args[0]
        return src if isinstance(src, torch.fx.Node) and aliased_input(src) is not None else None
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return None
    sets = set(schema.returns[0].alias_info.before_set)
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and sets & set(arg.alias_info.before_set):
            found = _nodes(_arg(node, i, arg.name))
            return found[0] if found else None
    return None


def colocated_groups(nodes: Iterable[torch.fx.Node], op_of: dict[str, int], succ: list[set[int]]) -> list[list[int]]:
    """Groups of op indices (each sorted, two or more ops) that must run on one stage; see the module docstring.

    ``op_of`` maps fx node names to op indices, whose order is topological; nodes absent from it (get_attr,
    placeholders) are roots only. ``succ[i]`` is the set of ops that read a value of op ``i``.
    """
    order = list(nodes)
    position = {n.name: i for i, n in enumerate(order)}
    root: dict[str, torch.fx.Node] = {}
    for n in order:
        src = aliased_input(n) if n.op == "call_function" else None
        root[n.name] = root.get(src.name, src) if src is not None else n
    last_write: dict[str, int] = {}
    for n in order:
        for w in written_inputs(n) if n.op == "call_function" else []:
            last_write[root[w.name].name] = position[n.name]
    if not last_write:
        return []
    by_root: dict[str, set[int]] = {r: set() for r in last_write}
    for n in order:
        if n.name in op_of and root[n.name].name in by_root:  # the root's producer and every view or mutation
            by_root[root[n.name].name].add(op_of[n.name])
        for inp in n.all_input_nodes:
            r = root.get(inp.name)
            if r is None or r.name not in by_root or n.name not in op_of:
                continue
            direct_state = inp is r and r.op in ("get_attr", "placeholder")
            if position[n.name] <= last_write[r.name] or direct_state:
                by_root[r.name].add(op_of[n.name])
    groups = [g for g in by_root.values() if len(g) > 1]
    return _closed(groups, succ)


def _closed(groups: list[set[int]], succ: list[set[int]]) -> list[list[int]]:
    """Merge overlapping groups and close each under paths between its members, until nothing changes."""
    pred: list[set[int]] = [set() for _ in succ]
    for a, bs in enumerate(succ):
        for b in bs:
            pred[b].add(a)
    while True:
        merged = _merge(groups)
        closed = [_closure(g, succ, pred) for g in merged]
        if closed == merged:
            return sorted(sorted(g) for g in closed)
        groups = closed


def _merge(groups: list[set[int]]) -> list[set[int]]:
    out: list[set[int]] = []
    for g in groups:
        g = set(g)
        for other in [o for o in out if o & g]:
            g |= other
            out.remove(other)
        out.append(g)
    return out


def _closure(group: set[int], succ: list[set[int]], pred: list[set[int]]) -> set[int]:
    """Ops on some path between two members: reachable from the group and reaching it (index order is
    topological, so the searches stop at the group's first and last index)."""
    lo, hi = min(group), max(group)

    def reach(edges: list[set[int]]) -> set[int]:
        seen, todo = set(group), list(group)
        while todo:
            for b in edges[todo.pop()]:
                if b not in seen and lo <= b <= hi:
                    seen.add(b)
                    todo.append(b)
        return seen

    return reach(succ) & reach(pred)
