"""One context-parallel rank's program: the traced graph rewritten so that it runs on this rank's tokens of every
sequence, attention reading every rank's keys and values.

Context parallelism splits the sequence across a group of ranks for every op, attention included (Liu et al. 2023,
"Ring Attention with Blockwise Transformers", arXiv:2310.01889; Megatron-Core's and torchtitan's
``context_parallel``). This program takes the all-gather form Llama 3 trained with (Dubey et al. 2024,
arXiv:2407.21783, section 3.3.2): each attention gathers the group's keys and values and runs its own queries
against them, which is exact for any mask and any attention variant the model's ``scaled_dot_product_attention``
call expresses; the ring form overlaps the transfers with blocks of the attention but needs the online softmax
of every variant, and is left for later.

:func:`context_parallel_graph` rewrites a traced program, on the graph alone, with the walk sequence parallelism
uses (:class:`partitioner.tp.token_walk.TokenWalk`): the ids an embedding looks up are cut to this rank's tokens
(:func:`partitioner.cp.comm.cp_scatter`, the load-balanced chunks of :meth:`CPComm.positions`), and the slice is
followed through every op that works token by token. What every rank computes whole from no tokens (positions,
rotary angles, masks, the labels and their shift) stays whole and is cut alike where it meets the slice, so
positions stay global. ``scaled_dot_product_attention`` reads the keys and values gathered (:func:`cp_gather`;
before grouped-query attention repeats their heads, so the key-value heads travel, not their copies) and its mask's
rows of this rank's queries (:mod:`partitioner.cp.mask_rows`); ``is_causal`` becomes the global-position mask of
those rows (:func:`cp_causal_mask`); ``aten.cross_entropy_loss`` becomes :func:`cp_cross_entropy`, the group's sum
over the group's count of targets. An op that mixes positions otherwise gets the whole sequence gathered first (correct,
not cheaper; :attr:`ContextSharding.notes` names each), and so do the graph's outputs. Parameters stay whole on every
rank; their gradients are this rank's share, averaged over the data-parallel ranks as a replica's.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from ..capture.build import build_graph
from ..capture.flops import op_name
from ..capture.graph import OpGraph
from ..capture.program import copy_graph, rewritten_module
from ..tp.collectives import (
    copy_to,
    gather_from,
    reduce_from,
    scatter_to,
    tp_attention,
    tp_dropout,
    vocab_cross_entropy,
    vocab_embedding,
)
from ..tp.shard_rules import node_args, value_of
from ..tp.token_walk import TokenWalk, fake_like, ids_input, sequence_ids, token_layout
from .comm import CPComm, cp_causal_mask, cp_cross_entropy, cp_gather, cp_group_loss, cp_scatter
from .mask_rows import mask_rows
from .pricing import context_seconds

__all__ = ["ContextSharding", "context_parallel_graph", "cp_degree", "CP_COMM_ATTR"]

CP_COMM_ATTR = "cp_comm"  # the attribute of a context-parallel program (and of its stage modules) holding its CPComm
_SDPA = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
_CROSS_ENTROPY = ("self", "target", "weight", "reduction", "ignore_index", "label_smoothing")
_REPEAT = {"unsqueeze", "expand", "reshape", "view", "_unsafe_view"}  # how keys and values get their heads repeated
_PER_TOKEN = (copy_to, reduce_from, tp_dropout)  # tensor parallelism's ops that act on each token alone
_ALONG = (gather_from, scatter_to)  # ... and along another dimension of each token


@dataclass(frozen=True)
class ContextSharding:
    """What a context-parallel program does: ``cp`` ranks per group, this one ``rank``, the ``sequence`` it splits
    (tokens per sequence of the traced batch), the attentions that gather keys and values and the ``notes``, one
    line per op that reads the whole sequence otherwise."""

    cp: int
    rank: int
    sequence: int
    attentions: int = 0
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        return {"degree": self.cp, "sequence": self.sequence, "attentions": self.attentions, "notes": list(self.notes)}


def cp_degree(graph: OpGraph) -> int:
    """The context-parallel degree a program was written for (1: none)."""
    context = graph.fx.context if graph.fx is not None else None
    return int(context.cp) if context is not None else 1


def _call_args(node: torch.fx.Node, names: tuple[str, ...]) -> dict[str, Any]:
    """An aten call's arguments by schema name (positional and keyword alike)."""
    return {**dict(zip(names, node_args(node))), **node.kwargs}


class _ContextWalk(TokenWalk):
    """One pass over a program (see the module docstring)."""

    def __init__(self, graph: torch.fx.Graph, comm: torch.fx.Node, cp: int, batch: int, seq: int):
        super().__init__(graph, cp, batch, seq)
        self.comm, self.attentions = comm, 0

    def start(self, node: torch.fx.Node) -> bool:
        if (op_name(node) != "embedding" and node.target is not vocab_embedding
                or ids_input(node, placeholder=True) is None):
            return False
        ids, out = ids_input(node), value_of(node)
        at, tokens = token_layout(value_of(ids).shape, self.batch, self.seq), token_layout(out.shape, self.batch,
                                                                                          self.seq)
        if at is None or tokens is None:
            return False
        node.replace_input_with(ids, self.scatter(node, ids, at))
        self.slice(node, tokens)
        return True

    def scatter(self, node: torch.fx.Node, n: torch.fx.Node, tokens: tuple[int, int, int]) -> torch.fx.Node:
        return self.insert(cp_scatter, (n, tokens, self.comm), lambda: self.g.inserting_before(node),
                           f"{n.name}_cp_scatter", fake_like(value_of(n), self.sliced_shape(n, tokens)), n,
                           ("slice", *tokens))

    def gathered(self, n: torch.fx.Node) -> torch.fx.Node:
        return self.insert(cp_gather, (n, self.tokens[n.name], self.comm), lambda: self.g.inserting_after(n),
                           f"{n.name}_cp_gather", self.whole[n.name], n, "gather")

    def special(self, node: torch.fx.Node, name: str, sliced: list[torch.fx.Node]) -> bool:
        if name == "scaled_dot_product_attention" or node.target is tp_attention:
            return self.attention(node)
        if name == "cross_entropy_loss":
            return self.cross_entropy(node)
        if name == "matmul":
            return self.attention_matmul(node)
        if node.target is vocab_cross_entropy:
            return self.vocab_cross_entropy(node)
        x = node_args(node)[0]
        if not isinstance(x, torch.fx.Node) or x.name not in self.tokens:
            return False
        tokens = self.tokens[x.name]
        if node.target in _PER_TOKEN or (node.target in _ALONG
                                         and node_args(node)[1] % value_of(node).dim() != tokens[0]):
            self.slice(node, tokens)
            return True
        return False

    def at_rows(self, n: Any, rows: int) -> bool:
        """Whether ``n`` holds this rank's tokens on dimension ``rows`` (and nothing else of the sequence)."""
        return isinstance(n, torch.fx.Node) and self.tokens.get(n.name) == (rows, 1, 1)

    def attention(self, node: torch.fx.Node) -> bool:
        """This rank's queries against the group's keys and values (see the module docstring); False: the queries
        are not this rank's tokens alone, and the walk gathers the whole sequence."""
        a = _call_args(node, _SDPA)
        q, k, v, mask = a["query"], a["key"], a["value"], a.get("attn_mask")
        rows = value_of(q).dim() - 2
        if not self.at_rows(q, rows) or any(x.name in self.tokens and not self.at_rows(x, value_of(x).dim() - 2)
                                            for x in (k, v)):
            return False
        k, v = (self.gathered_early(x, node) if x.name in self.tokens else x for x in (k, v))
        if isinstance(mask, torch.fx.Node):
            if mask.name in self.tokens:
                return False
            if value_of(mask).shape[-2] != 1:  # one row per query: this rank's rows, made where the mask is
                mask = mask_rows(self, node, mask, value_of(mask).dim() - 2)
        elif a.get("is_causal"):
            keys = value_of(k).shape[-2]
            mask = self.insert(cp_causal_mask, (q, keys, self.comm), lambda: self.g.inserting_before(node),
                               f"{node.name}_cp_mask", fake_like(value_of(q), [value_of(q).shape[-2], keys],
                                                                 torch.bool), q, "mask")
        node.args = (q, k, v, mask, a.get("dropout_p", 0.0), False)
        node.kwargs = {key: val for key, val in node.kwargs.items() if key not in _SDPA}
        self.attentions += 1
        self.slice(node, (value_of(node).dim() - 2, 1, 1))
        return True

    def gathered_early(self, x: torch.fx.Node, node: torch.fx.Node) -> torch.fx.Node:
        """The whole sequence of keys or values ``x`` that ``node`` reads, gathered before the views and expands that
        made ``x`` from fewer heads (grouped-query attention's ``repeat_kv``) and those replayed on the whole: the
        gather moves the key-value heads, not their copies."""
        chain = []
        while (x.op == "call_function" and op_name(x) in _REPEAT and len(x.users) == 1
               and isinstance(src := node_args(x)[0], torch.fx.Node) and src.name in self.tokens):
            chain.append(x)
            x = src
        out = self.gathered(x)
        for op in reversed(chain):  # each as traced, on the whole sequence
            args = (out, list(self.whole[op.name].shape)) if op_name(op) != "unsqueeze" else (out, node_args(op)[1])
            out = self.insert(op.target, args, lambda: self.g.inserting_before(node), f"{op.name}_cp_whole",
                              self.whole[op.name], op, "whole", dict(op.kwargs))
        return out

    def attention_matmul(self, node: torch.fx.Node) -> bool:
        """Attention spelt out (``eager``): this rank's rows (queries, or their weights) times the group's keys or
        values, gathered; False: the left operand's tokens are not its rows."""
        a, b = node_args(node)[:2]
        rows = value_of(a).dim() - 2
        if not self.at_rows(a, rows) or not isinstance(b, torch.fx.Node) or b.name not in self.tokens:
            return False
        if self.tokens[b.name][0] == value_of(b).dim() - 1:  # the keys, transposed: one attention's scores
            self.attentions += 1
        node.replace_input_with(b, self.gathered(b))
        self.slice(node, (value_of(node).dim() - 2, 1, 1))
        return True

    def cross_entropy(self, node: torch.fx.Node) -> bool:
        """The loss over the group's tokens from this rank's logits (``(tokens, classes)``) and targets."""
        a = _call_args(node, _CROSS_ENTROPY)
        logits, target = a["self"], a["target"]
        tokens = self.tokens.get(logits.name)
        if tokens is None or tokens[0] != 0 or value_of(logits).dim() != 2 or not isinstance(target, torch.fx.Node):
            return False
        if target.name not in self.tokens:
            target = self.scatter(node, target, tokens)
        elif self.tokens[target.name] != tokens:
            return False
        reduction = a.get("reduction", 1)
        node.target = cp_cross_entropy
        node.args = (logits, target, a.get("weight"), reduction, a.get("ignore_index", -100),
                     a.get("label_smoothing", 0.0))
        node.kwargs = {"comm": self.comm}
        if reduction == 0:
            self.slice(node, tokens)
        return True

    def vocab_cross_entropy(self, node: torch.fx.Node) -> bool:
        """Tensor parallelism's vocabulary-parallel loss on this rank's tokens, per token, then the group's
        (:func:`partitioner.cp.comm.cp_group_loss`)."""
        logits, target, start, reduction, ignore_index, tp_comm = node_args(node)
        tokens = self.tokens.get(logits.name)
        if tokens is None or tokens[0] != 0 or value_of(logits).dim() != 2:
            return False
        if target.name not in self.tokens:
            target = self.scatter(node, target, tokens)
        node.args = (logits, target, start, 0, ignore_index, tp_comm)
        node.meta["val"] = fake_like(value_of(logits), [value_of(logits).shape[0] * self.degree])  # one per token
        self.slice(node, tokens)
        if reduction == 0:
            return True
        users = list(node.users)
        with self.g.inserting_after(node):
            kept = self.g.call_function(torch.ne, (target, ignore_index))
        with self.g.inserting_after(kept):
            loss = self.g.call_function(cp_group_loss, (node, kept, reduction), {"comm": self.comm})
        kept.meta["val"] = fake_like(value_of(target), list(value_of(target).shape), torch.bool)
        loss.meta["val"] = fake_like(value_of(node), [])
        for user in users:
            user.replace_input_with(node, loss)
        return True


def _drop_unread(graph: torch.fx.Graph, read: set[str]) -> None:
    """Drop the ops that the rewrite left unread (a mask whose rows are now made apart, and what made it), with the
    metadata checks on them: each would still compute a whole value. Ops unread before stay as traced."""
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node.name not in read:
            continue
        checks = [u for u in node.users if op_name(u) == "_assert_tensor_metadata"]
        if len(checks) == len(node.users):
            for check in checks:
                graph.erase_node(check)
            graph.erase_node(node)


def context_parallel_graph(graph: OpGraph, cp: int, rank: int) -> OpGraph:
    """``graph`` as cp rank ``rank`` of ``cp`` runs it (see the module docstring); the program's ``context``
    (:class:`ContextSharding`) and ``cp_comm`` (the unbound :class:`~partitioner.cp.comm.CPComm`) say so. Raises
    when no embedding of the model's input ids says where the sequence is, or the sequence does not split over
    ``cp``."""
    prog = graph.fx
    if prog is None:
        raise ValueError("context parallelism needs a traced graph (partitioner.trace), not a synthetic one")
    if cp == 1:
        return graph
    ids = sequence_ids(prog.module.graph)
    if ids is None:
        raise ValueError(f"context_parallel_degree={cp}: no embedding looks up the model's input ids, so the sequence "
                         "dimension is unknown; use context_parallel_degree=1")
    batch, seq = ids
    comm = CPComm(cp, rank)
    comm.positions(seq)  # a sequence that does not split raises here, with the fix
    fx_graph = copy_graph(prog.module.graph)
    with fx_graph.inserting_before(next(iter(fx_graph.nodes))):
        comm_node = fx_graph.get_attr(CP_COMM_ATTR)
    walk = _ContextWalk(fx_graph, comm_node, cp, batch, seq)
    read = {n.name for n in fx_graph.nodes if n.users}
    walk.walk()
    _drop_unread(fx_graph, read)
    fx_graph.lint()
    module = rewritten_module(prog.module, fx_graph, {CP_COMM_ATTR: comm})
    out = build_graph(module, prog.in_spec, prog.out_spec, prog.training, folded=prog.folded)
    keep = ("split_ops", "loss", "tp_comm", "sharding", "ep_comm", "experts")
    out.fx = dataclasses.replace(out.fx, **{k: getattr(prog, k) for k in keep},
                                 collective_pricing=(*prog.collective_pricing, context_seconds), cp_comm=comm,
                                 context=ContextSharding(cp, rank, seq, walk.attentions, tuple(walk.notes)))
    out.add_output_work(graph.output_work())
    return out
