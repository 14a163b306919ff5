"""Which layers expert parallelism shards: the routing pattern of a mixture of experts, found on the traced graph.

A mixture-of-experts layer (Shazeer et al. 2017, "Outrageously Large Neural Networks", arXiv:1701.06538; Mixtral,
Jiang et al. 2024, arXiv:2401.04088) routes each token to its top-k experts: a router matmul scores the experts,
``topk`` picks them, the tokens' rows are grouped by expert, every expert's MLP runs on its rows, and the results
come back weighted by the router's scores. ``transformers``' MoE models (Mixtral, Qwen2-MoE, OLMoE, DeepSeek-V3,
gpt-oss) and torchtitan's ``GroupedExperts`` hold the experts' weights stacked (``[experts, out, in]``) and run
them as grouped matmuls over the rows sorted by expert, with the cumulative row count per expert as offsets.

:func:`find_experts` finds that on any traced model, not on module classes: grouped matmuls (``_grouped_mm``, or
``transformers``' fallback op) whose weights are parameters with one row per expert and whose offsets come from a
``topk`` over a router's scores make one *expert layer*; its *region* is every op between the rows sorted by
expert and the last grouped matmul's output (the experts' MLPs), which must read nothing but those rows, the
offsets, the stacked weights and per-expert tensors gathered by the rows' expert ids (gpt-oss's biases), and must not
depend on how many rows there are (no size baked into it), so that it runs unchanged on the rows another rank sends.
Expert parallelism (Lepikhin et al. 2020, GShard, arXiv:2006.16668) gives each rank of an ep group ``experts / ep``
of them: :mod:`partitioner.ep.expert_program` writes that program. Layers that do not match are reported with the
reason (:attr:`ExpertLayers.skipped`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from ..capture.flops import is_matmul_class, op_name

__all__ = ["ExpertLayer", "ExpertLayers", "find_experts", "GROUPED_MATMULS"]

GROUPED_MATMULS = frozenset({"_grouped_mm", "grouped_mm", "grouped_mm_fallback"})
_WEIGHT_VIEWS = frozenset({"transpose", "t", "permute", "to", "_to_copy", "_assert_tensor_metadata", "contiguous"})
_OFFSET_OPS = frozenset({"histc", "bincount", "cumsum", "to", "_to_copy", "sort", "getitem", "reshape", "view",
                         "_assert_tensor_metadata", "flatten", "int", "long"})


@dataclass(frozen=True)
class ExpertLayer:
    """One mixture-of-experts layer of a traced graph: its module ``name``, ``experts`` stacked in ``params`` (the
    get_attr targets of the stacked weights, one row per expert), the fx nodes of the ``rows`` sorted by expert,
    the ``offsets`` (cumulative rows per expert) and the ``output`` (the experts' results, in the rows' order), the
    nodes of the ``region`` between them (graph order), ``top_k`` experts per token, the ``router`` weight, and the
    node of the rows' expert ids when the region reads them (a bias per expert, gathered by each row's expert)."""

    name: str
    experts: int
    params: tuple[str, ...]
    rows: str
    offsets: str
    output: str
    region: tuple[str, ...]
    top_k: int
    router: str
    ids: str | None = None


@dataclass
class ExpertLayers:
    """What :func:`find_experts` found: the layers expert parallelism can shard and, per grouped matmul it cannot,
    why (``skipped``)."""

    layers: list[ExpertLayer] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary: per layer its name, experts, top-k and stacked weights; what was skipped."""
        return {"layers": [{"name": x.name, "experts": x.experts, "top_k": x.top_k, "params": list(x.params)}
                           for x in self.layers], "skipped": dict(sorted(self.skipped.items()))}


def _module(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def _through_views(node: torch.fx.Node) -> torch.fx.Node:
    """What ``node`` is a transpose or cast of (itself if neither)."""
    while node.op == "call_function" and op_name(node) in _WEIGHT_VIEWS and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _param_of(node: Any, gm: torch.fx.GraphModule) -> str | None:
    """The parameter a grouped matmul's weight is (through transposes and casts), or None."""
    node = _through_views(node) if isinstance(node, torch.fx.Node) else node
    if isinstance(node, torch.fx.Node) and node.op == "get_attr":
        value = getattr(gm, "_parameters", {}).get(node.target) if "." not in str(node.target) else None
        value = value if value is not None else _attr(gm, str(node.target))
        return str(node.target) if isinstance(value, torch.nn.Parameter) else None
    return None


def _attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        for i in n.all_input_nodes:
            if i not in seen:
                seen.add(i)
                todo.append(i)
    return seen


def _routing(offsets: torch.fx.Node) -> tuple[int, str] | None:
    """(k, router weight) of the ``topk`` over a router matmul's scores the offsets are counted from, or None."""
    todo, seen = [offsets], set()
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if op_name(n) == "topk":
            k = n.args[1] if len(n.args) > 1 else n.kwargs.get("k")
            router = _router(n)
            return (int(k), router) if isinstance(k, int) and router is not None else None
        if op_name(n) in _OFFSET_OPS or op_name(n) in ("floor_divide", "div", "remainder"):
            todo.extend(n.all_input_nodes)
    return None


def _router(topk: torch.fx.Node) -> str | None:
    """The weight of the nearest matmul above ``topk`` (the router's scores), or None."""
    todo, seen = list(topk.all_input_nodes), set()
    while todo:
        n = todo.pop(0)
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and is_matmul_class(op_name(n)):
            weight = next((w for w in map(_through_views, n.all_input_nodes) if w.op == "get_attr"), None)
            if weight is not None:
                return str(weight.target)
        todo.extend(n.all_input_nodes)
    return None


def _stacked(node: torch.fx.Node, gm: torch.fx.GraphModule, experts: int) -> bool:
    """Whether ``node`` is a parameter with one row per expert."""
    value = _attr(gm, str(node.target)) if node.op == "get_attr" else None
    return isinstance(value, torch.nn.Parameter) and value.dim() >= 1 and value.shape[0] == experts


def _is_ids(node: torch.fx.Node, offsets: torch.fx.Node, rows: int) -> bool:
    """Whether ``node`` is the rows' expert ids the offsets are counted from (integers, one per row)."""
    v = node.meta.get("val")
    return (isinstance(v, torch.Tensor) and not v.is_floating_point() and tuple(v.shape) == (rows,)
            and node in _ancestors(offsets))


def _rows_count(node: torch.fx.Node) -> int | None:
    v = node.meta.get("val")
    return int(v.shape[0]) if isinstance(v, torch.Tensor) and v.dim() >= 1 else None


def _bakes(node: torch.fx.Node, rows: int) -> bool:
    """Whether ``node`` has the row count as a constant argument (it would not run on another number of rows)."""
    flat: list[Any] = []

    def note(a: Any) -> Any:
        flat.append(a)
        return a
    torch.fx.node.map_aggregate((node.args, node.kwargs), note)
    return any(type(a) is int and a == rows for a in flat)


def _layer(gm: torch.fx.GraphModule, mms: list[torch.fx.Node]) -> ExpertLayer | str:
    """The expert layer of the grouped matmuls ``mms`` (one routing's, graph order), or why there is none."""
    offsets = mms[0].args[2] if len(mms[0].args) > 2 else mms[0].kwargs.get("offs")
    routing = _routing(offsets) if isinstance(offsets, torch.fx.Node) else None
    if routing is None or not isinstance(offsets, torch.fx.Node):
        return "its offsets do not come from a top-k routing over a router's scores"
    params: list[Any] = [_param_of(mm.args[1], gm) for mm in mms]
    if any(p is None for p in params):
        return "a grouped matmul's weight is not a parameter"
    sizes = {int(_attr(gm, p).shape[0]) for p in params if p is not None}
    if len(sizes) != 1:
        return f"its stacked weights hold different numbers of experts {sorted(sizes)}"
    rows, output = mms[0].args[0], mms[-1]
    while isinstance(rows, torch.fx.Node) and op_name(rows) in ("to", "_to_copy"):
        rows = rows.args[0]  # the cast to the weights' dtype runs on the rows' owner, inside the region
    count = _rows_count(rows) if isinstance(rows, torch.fx.Node) else None
    if not isinstance(rows, torch.fx.Node) or count is None:
        return "its rows are not a tensor"
    up = _ancestors(output) | {output}
    below = _ancestors(rows) | {rows} | _ancestors(offsets) | {offsets}
    allowed = {rows, offsets} | {n for n in gm.graph.nodes if n.op == "get_attr" and n.target in params}
    region = [n for n in gm.graph.nodes if n in up and n not in below and n.op == "call_function"]
    inside = set(region)
    # checks with no result (export's metadata asserts) on values inside go with them
    region = [n for n in gm.graph.nodes if n in inside or (n.op == "call_function" and not n.users and n.all_input_nodes
              and all(i in inside for i in n.all_input_nodes))]
    inside = set(region)
    experts = sizes.pop()
    ids = None
    for n in region:
        for i in n.all_input_nodes:
            if i in inside or i in allowed:
                continue
            if _stacked(i, gm, experts):  # a per-expert tensor (a bias) read by each row's expert: split likewise
                params.append(str(i.target))
                allowed.add(i)
            elif _is_ids(i, offsets, count) and ids in (None, i):  # each row's expert id, as its rows are sorted
                ids = i
            else:
                return (f"{n.name} inside its experts reads {i.name}, which is neither the rows, the experts' "
                        "weights nor their ids")
    for n in region:
        if n is not output and any(u not in inside for u in n.users):
            return f"{n.name} inside its experts is read outside them"
        if n not in mms and _bakes(n, count):
            return f"{n.name} inside its experts has the row count {count} as a constant"
    k, router = routing
    return ExpertLayer(_module(mms[0]) or mms[0].name, experts, tuple(dict.fromkeys(p for p in params if p)),
                       rows.name, offsets.name, output.name, tuple(n.name for n in region), k, router,
                       ids.name if ids is not None else None)


def find_experts(gm: torch.fx.GraphModule) -> ExpertLayers:
    """The mixture-of-experts layers of the traced program ``gm`` (see the module docstring), in graph order."""
    by_offsets: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and op_name(node) in GROUPED_MATMULS:
            offs = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
            if isinstance(offs, torch.fx.Node):
                by_offsets.setdefault(offs, []).append(node)
    out = ExpertLayers()
    for mms in by_offsets.values():
        got = _layer(gm, mms)
        if isinstance(got, str):
            out.skipped[_module(mms[0]) or mms[0].name] = got
        else:
            out.layers.append(got)
    return out
