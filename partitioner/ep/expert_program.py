"""One expert-parallel rank's program: the traced graph rewritten so that each layer's experts run where they live.

From the expert layers :func:`partitioner.ep.experts.find_experts` finds, :func:`expert_parallel_graph` writes the
program ep rank ``rank`` of ``ep`` runs: each layer's region (the experts' MLPs) becomes one op, a call of
:func:`partitioner.ep.dispatch.expert_parallel` with the region as its body (a ``GraphModule`` of those nodes, the
rows, offsets and weights its placeholders), so the rows go to their experts' ranks and back around it; the stacked
weights become this rank's ``experts / ep`` rows of them (copies: no rank keeps the whole weight). Everything else,
the router and its auxiliary losses included, is the model's own and runs on every rank's own tokens.

The region being one op means no pipeline cut falls inside it (what crosses between its nodes has as many rows as
the routing sends, known only at run time), and the op is priced as the region it replaces: its FLOPs at the traced
rows (balanced routing sends a rank as many rows as it sends away) on this rank's weights
(:data:`partitioner.capture.flops.REGION_COST`), its all-to-alls by :mod:`partitioner.ep.pricing`.
Every rank writes the same nodes under the same names, so one plan cut on rank 0's program binds to all.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from ..capture.build import build_graph
from ..capture.flops import REGION_COST, op_flops_and_bytes
from ..capture.graph import OpGraph
from ..capture.program import copy_graph, rewritten_module, tensor_aliases
from .dispatch import EPComm, expert_parallel, expert_range
from .experts import ExpertLayer, ExpertLayers, find_experts
from .pricing import all_to_all_seconds

__all__ = ["ExpertSharding", "expert_parallel_graph", "ep_degree", "EP_COMM_ATTR"]

EP_COMM_ATTR = "ep_comm"  # the attribute of an expert-parallel program (and of its stage modules) holding its EPComm


@dataclass(frozen=True)
class ExpertSharding:
    """What an expert-parallel program holds: ``ep`` ranks per group, this one ``rank``, per stacked weight (every
    name of it) the experts it has of them ``(start, stop, whole)``, and the layers found."""

    ep: int
    rank: int
    params: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    found: ExpertLayers = field(default_factory=ExpertLayers)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary: the degree and the layers found (and skipped)."""
        return {"degree": self.ep, **self.found.to_dict()}


def ep_degree(graph: OpGraph) -> int:
    """The expert-parallel degree a program was written for (1: none)."""
    experts = graph.fx.experts if graph.fx is not None else None
    return int(experts.ep) if experts is not None else 1


def _body(layer: ExpertLayer, nodes: dict[str, torch.fx.Node]) -> torch.fx.GraphModule:
    """The layer's region as a graph of its own: placeholders rows, offsets, one per stacked weight and, when the
    region reads them, the rows' expert ids."""
    g = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {layer.rows: g.placeholder("rows"), layer.offsets: g.placeholder("offsets")}
    for i, p in enumerate(layer.params):
        slot = g.placeholder(f"weight_{i}")
        env.update({n.name: slot for n in nodes.values() if n.op == "get_attr" and n.target == p})
    if layer.ids is not None:  # each row's expert, numbered among this rank's experts
        env[layer.ids] = g.placeholder("expert_ids")
    for name in layer.region:
        env[name] = g.node_copy(nodes[name], lambda n: env[n.name])
    g.output(env[layer.output])
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _region_cost(layer: ExpertLayer, nodes: dict[str, torch.fx.Node], share: float) -> tuple[float, int, int]:
    """FLOPs and bytes of the region's ops at the traced rows, the weights' bytes at this rank's ``share``."""
    flops, moved, moved_float = 0.0, 0, 0
    for name in layer.region:
        f, b, bf = op_flops_and_bytes(nodes[name])
        flops, moved, moved_float = flops + f, moved + b, moved_float + bf
    weights = sum(int(n.meta["val"].numel() * n.meta["val"].element_size()) for n in nodes.values()
                  if n.op == "get_attr" and n.target in layer.params and "val" in n.meta)
    less = int(weights * (1 - share))
    return flops, max(moved - less, 0), max(moved_float - less, 0)


def _rewrite(fx_graph: torch.fx.Graph, found: ExpertLayers, ep: int) -> dict[str, torch.fx.GraphModule]:
    """Replace every layer's region in ``fx_graph`` by one :func:`expert_parallel` op; the bodies by attribute."""
    nodes = {n.name: n for n in fx_graph.nodes}
    with fx_graph.inserting_before(next(iter(fx_graph.nodes))):
        comm = fx_graph.get_attr(EP_COMM_ATTR)
    bodies: dict[str, torch.fx.GraphModule] = {}
    for i, layer in enumerate(found.layers):
        attr = f"ep_experts_{i}"
        bodies[attr] = _body(layer, nodes)
        out = nodes[layer.output]
        weights = [next(n for n in nodes.values() if n.op == "get_attr" and n.target == p) for p in layer.params]
        with fx_graph.inserting_after(out):
            body = fx_graph.get_attr(attr)
        with fx_graph.inserting_after(body):
            call = fx_graph.create_node("call_function", expert_parallel,
                                        (comm, body, nodes[layer.rows], nodes[layer.offsets], *weights),
                                        name=f"{layer.output}_ep")
        call.meta = {k: out.meta[k] for k in ("nn_module_stack", "stack_trace", "val") if k in out.meta}
        call.meta[REGION_COST] = _region_cost(layer, nodes, 1 / ep)
        out.replace_all_uses_with(call)
        for name in reversed(layer.region):
            fx_graph.erase_node(nodes[name])
    return bodies


def expert_parallel_graph(graph: OpGraph, ep: int, rank: int) -> OpGraph:
    """``graph`` as ep rank ``rank`` of ``ep`` runs it (see the module docstring), over a new module holding this
    rank's experts of every stacked weight; the program's ``experts`` (:class:`ExpertSharding`) and ``ep_comm``
    (the unbound :class:`~partitioner.ep.dispatch.EPComm`) say so. Raises when the model has no expert layer, or a
    layer's experts do not split over ``ep``."""
    prog = graph.fx
    if prog is None:
        raise ValueError("expert parallelism needs a traced graph (partitioner.trace), not a synthetic one")
    if ep == 1:
        return graph
    found = find_experts(prog.module)
    if not found.layers:
        why = "; ".join(f"{k}: {v}" for k, v in sorted(found.skipped.items())) or "no grouped matmul of experts"
        raise ValueError(f"expert_parallel_degree={ep}: this model has no mixture-of-experts layer expert "
                         f"parallelism can shard ({why}); use expert_parallel_degree=1")
    odd = sorted({x.experts for x in found.layers if x.experts % ep})
    if odd:
        raise ValueError(f"expert_parallel_degree={ep} does not divide the {odd} experts of this model's layers: use "
                         "a degree that divides every layer's number of experts")
    fx_graph = copy_graph(prog.module.graph)
    bodies = _rewrite(fx_graph, found, ep)
    fx_graph.lint()
    comm = EPComm(ep, rank)
    module = rewritten_module(prog.module, fx_graph, {EP_COMM_ATTR: comm, **bodies})
    params: dict[str, tuple[int, int, int]] = {}
    canonical = tensor_aliases(prog.module)
    stacked = {p: x.experts for x in found.layers for p in x.params}
    for path, name in canonical.items():
        if name not in stacked:
            continue
        whole = prog.module.get_parameter(name)
        start, stop = expert_range(stacked[name], ep, rank)
        owner, _, leaf = path.rpartition(".")
        try:
            holder = module.get_submodule(owner)
        except AttributeError:  # another name of the weight that the graph never reads
            continue
        setattr(holder, leaf,
                torch.nn.Parameter(whole.detach()[start:stop].clone(), requires_grad=whole.requires_grad))
        params[path] = (start, stop, stacked[name])
    out = build_graph(module, prog.in_spec, prog.out_spec, prog.training, folded=prog.folded)
    keep = ("split_ops", "loss", "tp_comm", "sharding", "cp_comm", "context")
    out.fx = dataclasses.replace(out.fx, **{k: getattr(prog, k) for k in keep},
                                 collective_pricing=(*prog.collective_pricing, all_to_all_seconds),
                                 ep_comm=comm, experts=ExpertSharding(ep, rank, params, found))
    out.add_output_work(graph.output_work())
    return out
