"""Column chunks: a linear layer too heavy for one stage, split into pieces the partitioner can spread.

No cut between ops balances a pipeline when one op weighs more than a stage's fair share. That op is
almost always a language model's output layer: a GPT-2 of hidden size 256 with its 50,257-token vocabulary
spends two thirds of a training step in the LM head and the loss over its logits, so any split at op
boundaries leaves the last stage with most of the work. Vocabulary parallelism for pipelines (Yeung et al.,
"Balancing Pipeline Parallelism with Vocabulary Parallelism", MLSys 2025, arXiv:2411.05288) spreads the
vocabulary layers over the pipeline's devices instead; we do the part of it that needs no change to the
model or the loss:

``y = linear(x, W, b)`` becomes ``k`` linears over row slices of ``W`` (column chunks of ``y``) and
``y = cat(chunks, -1)``. Every chunk is an op of its own, so the partitioner places each like any other op:
stages before the last compute some chunks of the head, the last stage the rest, the concatenation and the
loss. Each element of ``y`` is the same dot product as before; the gradient of ``x`` is summed over the
chunks, so it differs from the unsplit layer's by rounding only. ``W`` is read on every stage that holds a
chunk, so it is a shared parameter there (as GPT-2's tied embedding already is): replicated, its gradients
summed (:mod:`pipeline.runner`).

:func:`heavy_linears` picks the layers (only where the pipeline has two or more stages and a layer outweighs
:data:`HEAVY` of a stage's share) and their chunk counts; :func:`split_columns` rewrites a traced graph, the
same way every time, so a plan made on one rank binds to another rank's trace (``PartitionPlan.split_ops``).
"""
from __future__ import annotations

import contextlib
import math
import operator
from typing import Any

import numpy as np
import torch
import torch.fx

from .build import build_graph
from .graph import OpGraph
from .program import TracedProgram, copy_graph

__all__ = ["heavy_linears", "split_columns", "merge_weight_slices", "HEAVY", "CHUNK", "MAX_CHUNKS", "MIN_ROWS"]

HEAVY = 0.5        # a linear outweighing half a stage's share of the step is split...
CHUNK = 0.125      # ...into chunks of at most an eighth of a stage's share each (the balance's finest step),
MAX_CHUNKS = 8     # at most this many (each chunk costs a kernel launch and a slice of W's gradient),
MIN_ROWS = 1024    # each with at least this many output features (a matmul that thin runs inefficiently).


def _linear(node: torch.fx.Node) -> tuple[int, int] | None:
    """(rows of the weight, input features) of a top-level ``aten.linear`` whose weight is a parameter."""
    if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
        return None
    weight = node.args[1] if len(node.args) > 1 else None
    out = node.meta.get("val")
    if not isinstance(weight, torch.fx.Node) or weight.op != "get_attr" or not isinstance(out, torch.Tensor):
        return None
    x = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return None
    return int(out.shape[-1]), int(x.shape[-1])


def heavy_linears(graph: OpGraph, time_s: np.ndarray, num_stages: int) -> dict[str, int]:
    """The linear layers of ``graph`` to split, as fx node name -> number of chunks: each one whose op takes
    more than :data:`HEAVY` of a stage's share of ``time_s`` (seconds per op, forward plus backward), cut into
    chunks of at most :data:`CHUNK` of a share (a stage boundary falls between chunks, so a chunk is the finest
    step the balance can take: an eighth leaves the stages within about 6 % of a share), :data:`MAX_CHUNKS` at
    most, :data:`MIN_ROWS` rows each at least. Empty for one stage or a graph without a traced program."""
    if num_stages < 2 or graph.fx is None:
        return {}
    share = float(np.sum(time_s)) / num_stages
    nodes = {n.name: n for n in graph.fx.module.graph.nodes}
    found: dict[str, int] = {}
    for i, name in enumerate(graph.names):
        node = nodes.get(name)
        shape = _linear(node) if node is not None and graph.kinds[i] == "aten.linear" else None
        if shape is None or share <= 0 or time_s[i] <= HEAVY * share:
            continue
        k = min(MAX_CHUNKS, math.ceil(time_s[i] / (CHUNK * share)), shape[0] // MIN_ROWS)
        if k >= 2:
            found[name] = k
    return found


def _bounds(rows: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous row ranges covering ``rows``, sizes differing by one at most."""
    cuts = [rows * i // k for i in range(k + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def split_columns(graph: OpGraph, chunks: dict[str, int]) -> OpGraph:
    """A new op graph over a copy of ``graph``'s traced program in which each linear named in ``chunks``
    (fx node name -> count, from :func:`heavy_linears`) is computed in that many column chunks and
    concatenated. The model's tensors are shared, not copied; chunk nodes are named ``<linear>_cols<i>``."""
    prog: TracedProgram = graph.fx
    if prog is None:
        raise ValueError("split_columns needs a traced graph (partitioner.trace), not a synthetic one")
    fx_graph = copy_graph(prog.module.graph)
    nodes = {n.name: n for n in fx_graph.nodes}
    for name, k in sorted(chunks.items()):
        node = nodes.get(name)
        shape = _linear(node) if node is not None else None
        if node is None or shape is None or not isinstance(k, int) or not 2 <= k <= shape[0]:
            raise ValueError(f"cannot split {name!r} into {k!r} column chunks: the traced graph has no linear "
                             "layer of that name with that many output features; trace the model the plan was "
                             "made for")
        weight: Any = node.args[1]
        _rewrite(fx_graph, node, k, operator.attrgetter(weight.target)(prog.module).shape)
    fx_graph.lint()
    module = torch.fx.GraphModule(prog.module, fx_graph)
    out = build_graph(module, prog.in_spec, prog.out_spec, prog.training, folded=prog.folded)
    out.fx.split_ops, out.fx.loss = {**prog.split_ops, **chunks}, prog.loss
    out.add_output_work(graph.output_work())  # a loss priced on the output op stays priced
    return out


def _rewrite(g: torch.fx.Graph, node: torch.fx.Node, k: int, weight_shape: torch.Size) -> None:
    """Replace ``node`` (``linear(x, W[, b])``) by ``cat([linear(x, W[a:b][, b[a:b]]) ...], -1)``."""
    x, weight, bias = node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else None
    out: Any = node.meta["val"]
    keep: dict[str, Any] = {key: node.meta[key] for key in ("nn_module_stack", "stack_trace", "source_fn_stack")
                            if key in node.meta}

    def add(target: Any, args: tuple, name: str, shape: tuple[int, ...]) -> torch.fx.Node:
        made = g.create_node("call_function", target, args, name=name)
        with getattr(out, "fake_mode", None) or contextlib.nullcontext():
            val = torch.empty(shape, dtype=out.dtype, device=out.device)
        made.meta = {**keep, "val": val}
        return made

    parts = []
    with g.inserting_before(node):
        for i, (a, b) in enumerate(_bounds(out.shape[-1], k)):
            rows = (b - a, *weight_shape[1:])
            w = add(torch.ops.aten.slice.Tensor, (weight, 0, a, b), f"{node.name}_cols{i}_weight", rows)
            args: tuple = (x, w)
            if isinstance(bias, torch.fx.Node):
                args += (add(torch.ops.aten.slice.Tensor, (bias, 0, a, b), f"{node.name}_cols{i}_bias", (b - a,)),)
            parts.append(add(torch.ops.aten.linear.default, args, f"{node.name}_cols{i}",
                             (*out.shape[:-1], b - a)))
        cat = add(torch.ops.aten.cat.default, (parts, -1), f"{node.name}_cat", tuple(out.shape))
    cat.meta["val"] = out
    node.replace_all_uses_with(cat)
    g.erase_node(node)


def merge_weight_slices(g: torch.fx.Graph, root: torch.nn.Module) -> None:
    """In a stage graph ``g`` (parameters fetched from ``root``), replace two or more non-overlapping row
    slices of one parameter by one ``split_with_sizes`` of it and a ``getitem`` per slice (see above)."""
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in g.nodes:
        if (node.op == "call_function" and node.target is torch.ops.aten.slice.Tensor and len(node.args) == 4
                and node.args[1] == 0 and isinstance(node.args[0], torch.fx.Node) and node.args[0].op == "get_attr"):
            groups.setdefault(node.args[0], []).append(node)
    for weight, slices in groups.items():
        rows = operator.attrgetter(str(weight.target))(root).shape[0]
        bounds: list[Any] = [n.args[2:4] for n in slices]
        spans = sorted((int(a), min(int(b), rows), n) for (a, b), n in zip(bounds, slices))
        if len(spans) < 2 or any(a < 0 or b <= a for a, b, _ in spans) or any(
                spans[i][1] > spans[i + 1][0] for i in range(len(spans) - 1)):
            continue
        sizes: list[int] = []
        piece: dict[torch.fx.Node, int] = {}
        at = 0
        for a, b, n in spans:
            if a > at:  # rows no slice of this stage reads
                sizes.append(a - at)
            piece[n] = len(sizes)
            sizes.append(b - a)
            at = b
        if at < rows:
            sizes.append(rows - at)
        with g.inserting_after(weight):
            whole = g.call_function(torch.ops.aten.split_with_sizes.default, (weight, sizes, 0))
        for n, i in piece.items():
            with g.inserting_before(n):
                part = g.call_function(operator.getitem, (whole, i))
            part.meta = dict(n.meta)
            n.replace_all_uses_with(part)
            g.erase_node(n)
