"""One tensor-parallel rank's program: the traced graph rewritten to hold and compute that rank's shards.

From a :class:`partitioner.tp.sharding.Sharding` (which ops and parameters split, and along which dimension),
:func:`shard_graph` writes the graph tp rank ``rank`` runs, the way Megatron-LM writes its layers (Shoeybi et
al. 2019): sharded parameters become this rank's slices (copies, so no rank keeps a view of a whole weight),
shape constants of the ops between a column- and a row-parallel matmul shrink to the local sizes, a
row-parallel matmul's partial sums are all-reduced (``g``) before its bias is added, whole values entering
sharded ops pass through ``f``, the word embedding and the loss become vocabulary-parallel, sharded outputs
are gathered, and dropout draws from the engine's streams (:mod:`partitioner.tp.collectives`); with ``sequence``,
the regions between them run on a slice of the sequence (:mod:`partitioner.tp.sequence`). The collectives
read one :class:`~partitioner.tp.collectives.TPComm` held by the program (``TracedProgram.tp_comm``), which
the runtime binds to its process group; the partitioner itself never touches a process.

Every rank writes the same nodes under the same names, so one plan cut on rank 0's graph binds to all.
"""
from __future__ import annotations

import collections
import dataclasses
import operator
import warnings
from typing import Any, Callable, Collection, Sequence

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from ..capture.build import build_graph
from ..capture.flops import op_name
from ..capture.graph import OpGraph
from ..capture.program import copy_graph, keep_plain_constants, tensor_aliases
from .collectives import (
    FOLDED,
    TPComm,
    copy_to,
    gather_from,
    reduce_from,
    scatter_to,
    shard_range,
    tp_attention,
    tp_dropout,
    vocab_cross_entropy,
    vocab_embedding,
)
from .pricing import collective_seconds
from .rank_values import laid_out, storage_of, view_value
from .sequence import SequenceParallelWarning, sequence_parallel
from .shard_rules import node_args
from .sharding import Shard, Sharding, find_sharding

__all__ = ["shard_graph", "tensor_parallel_graph", "local_length", "shard_ranges", "shard_tensor",
           "unshard_tensor", "COMM_ATTR", "ReplicatedWarning"]


COMM_ATTR = "tp_comm"  # the attribute of a sharded program (and of its stage modules) holding its TPComm


class ReplicatedWarning(UserWarning):
    """Layers that tensor parallelism leaves whole on every tp rank (the message says which and why)."""


def local_length(s: Shard, tp: int, rank: int) -> int:
    """How long tp rank ``rank``'s piece of dimension ``s.dim`` is."""
    a, b = shard_range(s.size // s.groups, tp, rank)
    return s.groups * (b - a)


def shard_tensor(full: torch.Tensor, s: Shard, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` as a tensor of its own (not a view of ``full``)."""
    block = s.size // s.groups
    a, b = shard_range(block, tp, rank)
    parts = [full.narrow(s.dim, g * block + a, b - a) for g in range(s.groups)]
    return (torch.cat(parts, s.dim) if len(parts) > 1 else parts[0]).clone()


def shard_ranges(s: Shard, tp: int, rank: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` ranges of dimension ``s.dim`` of the whole tensor that make tp rank ``rank``'s shard
    (:func:`shard_tensor`), in the order the shard holds them: one, or one per block of a fused weight."""
    block = s.size // s.groups
    a, b = shard_range(block, tp, rank)
    return [(g * block + a, g * block + b) for g in range(s.groups)]


def unshard_tensor(pieces: Sequence[torch.Tensor], s: Shard, tp: int) -> torch.Tensor:
    """The whole tensor from every tp rank's shard (``pieces[r]`` is rank r's, as :func:`shard_tensor` cuts it):
    the inverse of :func:`shard_tensor`, block by block for a fused weight."""
    if len(pieces) != tp:
        raise ValueError(f"unshard_tensor needs the shards of all {tp} tp ranks, got {len(pieces)}")
    lengths = [local_length(s, tp, r) for r in range(tp)]
    got = [p.shape[s.dim] if p.dim() > s.dim else None for p in pieces]
    if got != lengths:
        raise ValueError(f"shards of lengths {got} along dim {s.dim} do not make a tensor of length {s.size} split "
                         f"over {tp} tp ranks ({s.groups} block(s)): expected lengths {lengths}")
    parts: list[torch.Tensor] = []
    for g in range(s.groups):
        for r, piece in enumerate(pieces):
            width = lengths[r] // s.groups
            parts.append(piece.narrow(s.dim, g * width, width))
    return torch.cat(parts, s.dim)


def _local_val(val: Any, s: Shard, tp: int, rank: int) -> Any:
    if not isinstance(val, torch.Tensor):
        return val
    shape = list(val.shape)
    shape[s.dim] = local_length(s, tp, rank)
    return laid_out(val, shape)


class _Writer:
    """Rewrites a copy of the traced graph for one tp rank."""

    def __init__(self, graph: torch.fx.Graph, sharding: Sharding, rank: int):
        self.g, self.sh, self.rank, self.tp = graph, sharding, rank, sharding.tp
        # the storage of each traced value, read before any is rewritten: which values are views of which
        self.storage = {n.name: storage_of(n.meta.get("val")) for n in graph.nodes}
        first = next(iter(graph.nodes))
        with graph.inserting_before(first):
            self.comm = graph.get_attr(COMM_ATTR)

    def add(self, after: torch.fx.Node, fn: Callable, args: tuple, name: str, val: Any) -> torch.fx.Node:
        with self.g.inserting_after(after):
            made = self.g.create_node("call_function", fn, args, name=name)
        made.meta = {k: after.meta[k] for k in ("nn_module_stack", "stack_trace") if k in after.meta}
        made.meta["val"] = val
        return made

    def length(self, s: Shard) -> int:
        return local_length(s, self.tp, self.rank)

    def write(self) -> None:
        nodes = {n.name: n for n in self.g.nodes}
        sharded_users = set(self.sh.values) | set(self.sh.roles)
        for consumer, inputs in self.sh.scatters.items():
            user = nodes[consumer]
            for name, dim, size in inputs:
                n = nodes[name]
                val = _local_val(n.meta.get("val"), Shard(dim, size), self.tp, self.rank)
                user.replace_input_with(n, self.add(n, scatter_to, (n, dim, self.comm), f"{name}_tp_scatter", val))
        for name in self.sh.copies:
            n = nodes[name]
            f = self.add(n, copy_to, (n, self.comm), f"{name}_tp_copy", n.meta.get("val"))
            n.replace_all_uses_with(f, delete_user_cb=lambda u: u.name in sharded_users)
        for node in list(self.g.nodes):
            if node.op == "call_function":
                self.node(node)
        out = next(n for n in self.g.nodes if n.op == "output")
        for name in self.sh.gathers:
            n, s = nodes[name], self.sh.values[name]
            gathered = self.add(n, gather_from, (n, s.dim, s.size, self.comm), f"{name}_tp_gather", n.meta.get("val"))
            out.replace_input_with(n, gathered)

    def node(self, node: torch.fx.Node) -> None:
        role, s, name = self.sh.roles.get(node.name), self.sh.values.get(node.name), op_name(node)
        val = node.meta.get("val")
        if role == "row":
            return self.row(node)
        if role == "embedding":
            rows = self.sh.params[str(node_args(node)[0].target)]
            start = shard_range(rows.size, self.tp, self.rank)[0]
            pad = node_args(node)[2] if len(node_args(node)) > 2 else node.kwargs.get("padding_idx", -1)
            node.target, node.args, node.kwargs = vocab_embedding, (node_args(node)[0], node_args(node)[1], start, pad,
                                                                    self.comm), {}
            return None
        if role == "loss":
            logits = self.sh.values[node_args(node)[0].name]
            a = list(node_args(node))
            a += [None, 1, -100][len(a) - 2:] if len(a) < 5 else []  # aten's defaults: no weight, mean, -100
            reduction = node.kwargs.get("reduction", a[3])
            ignore = node.kwargs.get("ignore_index", a[4])
            start = shard_range(logits.size, self.tp, self.rank)[0]
            node.target, node.args, node.kwargs = vocab_cross_entropy, (a[0], a[1], start, reduction, ignore,
                                                                        self.comm), {}
            return None
        if name == "scaled_dot_product_attention" and _dropout_p(node) > 0:
            node.target, node.kwargs = tp_attention, {**node.kwargs, "sharded": s is not None, "comm": self.comm}
        elif name == "dropout":
            sharded = s is not None
            node.target, node.args, node.kwargs = tp_dropout, (*node_args(node)[:3], sharded, self.comm), {}
        elif s is not None and name in ("view", "reshape", "_unsafe_view", "expand"):
            shape = list(node_args(node)[1])
            if shape[s.dim] != -1:
                shape[s.dim] = self.length(s)
            node.args = (node_args(node)[0], shape, *node_args(node)[2:])
        elif name in ("split", "split_with_sizes") and node_args(node)[0].name in self.sh.values:
            self.split(node)
            return None
        elif name == "_assert_tensor_metadata":
            node.kwargs = {k: v for k, v in node.kwargs.items() if k not in ("size", "stride")}
        if s is not None:
            node.meta["val"] = self.local(node, val, s)
        return None

    def local(self, node: torch.fx.Node, val: Any, s: Shard) -> Any:
        """``node``'s value on this rank: where the traced value is a view of an input's, that view of the input's
        value on this rank (its storage, so a tensor that two ops save through views counts once, as autograd holds
        it once); otherwise a new value laid out as the traced one."""
        if not isinstance(val, torch.Tensor):
            return val
        shape = list(val.shape)
        shape[s.dim] = self.length(s)
        base = self.storage.get(node.name)
        source = next((n for n in node.all_input_nodes if base is not None and self.storage.get(n.name) == base), None)
        view = view_value(node, source, shape) if source is not None else None
        return view if view is not None else laid_out(val, shape)

    def split(self, node: torch.fx.Node) -> None:
        src = self.sh.values[node_args(node)[0].name]
        d = (node_args(node)[2] if len(node_args(node)) > 2 else 0) % node_args(node)[0].meta["val"].dim()
        vals = list(node.meta["val"])
        if d == src.dim:
            chunk = Shard(d, src.size // src.groups)
            local = self.length(chunk)
            sizes = local if op_name(node) == "split" else [local] * len(vals)
            node.args = (node_args(node)[0], sizes, *node_args(node)[2:])
            node.meta["val"] = [_local_val(v, chunk, self.tp, self.rank) for v in vals]
        else:
            node.meta["val"] = [_local_val(v, src, self.tp, self.rank) for v in vals]
        for user in node.users:
            if user.target is operator.getitem:
                user.meta["val"] = node.meta["val"][user.args[1]]

    def row(self, node: torch.fx.Node) -> None:
        """``x @ W.T + b`` with ``x`` and ``W`` split along the features: partial sums, ``g``, then the bias."""
        name = op_name(node)
        val = node.meta["val"]
        if name == "linear":
            x, w, b = node_args(node)[0], node_args(node)[1], node_args(node)[2] if len(node_args(node)) > 2 else None
            node.args = (x, w)
        elif name == "addmm":
            b, x, w = node_args(node)
            node.target, node.args = torch.ops.aten.mm.default, (x, w)
        else:
            b = None
        users = list(node.users)
        reduced = self.add(node, reduce_from, (node, self.comm), f"{node.name}_tp_reduce", val)
        last = reduced
        if b is not None:
            last = self.add(reduced, torch.ops.aten.add.Tensor, (reduced, b), f"{node.name}_bias", val)
        for u in users:
            u.replace_input_with(node, last)


def _set(module: torch.nn.Module, owner: str, leaf: str, value: torch.nn.Parameter) -> None:
    """``module.<owner>.<leaf> = value``, creating the submodules a fresh ``GraphModule`` did not copy."""
    for part in owner.split(".") if owner else []:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    setattr(module, leaf, value)


def _dropout_p(node: torch.fx.Node) -> float:
    """The dropout probability of a traced ``scaled_dot_product_attention``."""
    args = node_args(node)
    p: Any = args[4] if len(args) > 4 else node.kwargs.get("dropout_p", 0.0)
    return float(p)


def shard_graph(graph: OpGraph, sharding: Sharding, rank: int, sequence: bool = False,
                defer_weights: bool = True) -> OpGraph:
    """The op graph of tp rank ``rank`` (see the module docstring), over a new module that holds this rank's
    shards of the sharded parameters (``OpGraph.fx.module``) and the unbound ``TPComm`` (``fx.tp_comm``); every
    other tensor is the model's own. ``sequence``: Megatron's sequence parallelism where it applies (its program's
    ``Sharding.sequence`` says whether it did; :class:`SequenceParallelWarning` says where it did not), and
    ``defer_weights``: the weights its sliced regions read whole sum their gradients once per step
    (``Sharding.deferred``; :func:`partitioner.tp.sequence.sequence_parallel`)."""
    prog = graph.fx
    if prog is None:
        raise ValueError("shard_graph needs a traced graph (partitioner.trace), not a synthetic one")
    if sharding.tp == 1:
        return graph
    fx_graph = copy_graph(prog.module.graph)
    writer = _Writer(fx_graph, sharding, rank)
    writer.write()
    if sequence:
        names = tensor_aliases(prog.module)
        counts = collections.Counter(names.values())
        tied = {n for n, c in names.items() if counts[c] > 1}
        rewrite = sequence_parallel(fx_graph, writer.comm, sharding.tp, defer_weights, tied)
        sharding = dataclasses.replace(sharding, sequence=rewrite.applied, deferred=tuple(rewrite.deferred))
        if rewrite.notes:
            warnings.warn("sequence_parallel: " + "; ".join(rewrite.notes), SequenceParallelWarning, stacklevel=2)
    fx_graph.lint()
    comm = TPComm(sharding.tp, rank)
    setattr(prog.module, COMM_ATTR, comm)
    try:
        # Its Python code is written when first run, not here: the layout search shards each trace for every tp
        # degree to price it, and never runs one (writing the code of a 4,000-op program takes a quarter second).
        module = _LazyGraphModule(prog.module, fx_graph)
    finally:
        delattr(prog.module, COMM_ATTR)
    keep_plain_constants(module, prog.module)
    made: dict[str, torch.nn.Parameter] = {}
    canonical = tensor_aliases(prog.module)
    shards = {canonical[t]: s for t, s in sharding.params.items()}
    for path, name in canonical.items():  # every name of a tied weight gets the same shard
        if name in shards and path not in made:
            full = prog.module.get_parameter(name)
            shard = made.setdefault(name, torch.nn.Parameter(shard_tensor(full.detach(), shards[name], sharding.tp,
                                                                          rank), requires_grad=full.requires_grad))
            owner, _, leaf = path.rpartition(".")
            _set(module, owner, leaf, shard)
    out = build_graph(module, prog.in_spec, prog.out_spec, prog.training, folded=FOLDED)
    out.fx.split_ops, out.fx.loss = dict(prog.split_ops), prog.loss
    out.fx.tp_comm, out.fx.sharding = comm, sharding
    out.fx.collective_pricing = (collective_seconds,) if sharding.tp > 1 else ()
    out.add_output_work(graph.output_work())
    return out


def tensor_parallel_graph(graph: OpGraph, tp: int, rank: int, shardable: Collection[str] | None = None,
                          sequence: bool = False, defer_weights: bool = True) -> OpGraph:
    """``graph`` as tp rank ``rank`` of ``tp`` runs it (:func:`partitioner.tp.sharding.find_sharding`, then
    :func:`shard_graph`); warns :class:`ReplicatedWarning` naming the matmuls and embeddings left whole.
    ``shardable``: the parameters that may be split (None: all); ``sequence``, ``defer_weights``: sequence
    parallelism (:func:`shard_graph`)."""
    if graph.fx is None:
        raise ValueError("tensor parallelism needs a traced graph (partitioner.trace), not a synthetic one")
    if tp == 1:
        return graph
    sharding = find_sharding(graph.fx.module, tp, shardable)
    if sharding.replicated:
        warnings.warn(f"tensor_parallel_degree={tp} leaves {len(sharding.replicated)} layer(s) whole on every tp "
                      "rank: " + "; ".join(f"{k}: {v}" for k, v in sorted(sharding.replicated.items())),
                      ReplicatedWarning, stacklevel=2)
    if not sharding.params:
        among = "" if shardable is None else " among the layers marked for tensor parallelism"
        raise ValueError(f"tensor_parallel_degree={tp}: no layer of this model{among} can be split (no matmul "
                         "pair matches Megatron's column/row pattern with sizes divisible by the degree); use "
                         "tensor_parallel_degree=1" + ("" if shardable is None else ", or mark more of the model "
                                                       "with smp.tensor_parallelism()"))
    return shard_graph(graph, sharding, rank, sequence, defer_weights)
