"""Megatron's sequence parallelism: the regions between tensor-parallel regions run on a slice of the sequence.

Tensor parallelism (:mod:`partitioner.tp.shard_program`) leaves every tp rank repeating the work between its regions
(norms, residual adds, dropout) on the whole sequence, and holding those activations whole. Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198, section 4.2.2) split them along
the sequence instead: every op there works token by token, so each rank can run them on its slice. Megatron's ``g``
(all-reduce after a row-parallel matmul) becomes a reduce-scatter along the sequence, its ``f`` (before a
column-parallel matmul) an all-gather forward and a reduce-scatter backward, and the vocabulary-parallel embedding
reduce-scatters its lookups (:mod:`partitioner.tp.collectives`); on a ring the bytes are an all-reduce's, while the
whole regions' compute and activations shrink to 1/tp per rank.

:func:`sequence_parallel` rewrites a tp rank's program (after :class:`~partitioner.tp.shard_program` has written its
shards) on the traced graph alone. The token layout comes from the ids an embedding looks up: a tensor holds tokens
along the first dimension where its leading sizes multiply to batch x sequence (:func:`token_layout`; GPT-2's
``(batch x sequence, hidden)`` rows as well as ``(batch, sequence, hidden)``). From the row-parallel outputs and the
embedding, the slice is followed op by op through what works per token (elementwise ops, norms and reductions over
other dimensions, matmuls by weights, views that keep the tokens on one dimension, dropout, which then draws each
rank's own mask from the engine's ``sharded`` stream). A whole value such an op reads is sliced alike where it runs
along the tokens (position embeddings), and otherwise (a norm's weight, a bias) leaves each rank a partial gradient,
which the runtime sums over the tp group once per step with the data-parallel average (Megatron's
``allreduce_layernorm_grads``; or, ``defer_weights=False``, ``f`` sums it in every backward), so every rank ends
with the whole gradient of a weight it holds whole. An op that
mixes positions (a cumsum over the sequence, attention left whole), and a graph output, get the whole sequence
gathered first, with a one-line note; a sequence that does not divide by the degree leaves the program unchanged.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Collection

import torch
import torch.fx

from ..capture.flops import op_name
from .collectives import (
    Tokens,
    copy_to,
    reduce_from,
    seq_gather,
    seq_gather_whole,
    seq_reduce_scatter,
    seq_scatter,
    tp_dropout,
    vocab_embedding,
)
from .shard_rules import ELEMENTWISE, VIEWS, node_args, node_inputs, value_of

__all__ = ["SequenceRewrite", "SequenceParallelWarning", "sequence_parallel", "token_layout", "view_tokens"]

_REDUCE = {"mean", "sum", "amax", "amin"}
_MATMUL = {"linear", "mm", "addmm"}


class SequenceParallelWarning(UserWarning):
    """Sequence parallelism gathered the sequence before an op, or could not apply (the message says which, why)."""


@dataclass
class SequenceRewrite:
    """What :func:`sequence_parallel` did: ``applied`` (some region runs on a slice of the sequence), ``notes``,
    one line each: why it did not apply, or which op reads the sequence whole, and ``deferred``: the parameters read
    whole by sliced ops whose gradients, partial sums on each rank, the runtime sums over the tp group once per step
    (with the data-parallel average) instead of through ``f`` in every microbatch's backward."""

    applied: bool = False
    notes: list[str] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)  # weights read whole whose partial gradients sum once per step


def token_layout(shape: Any, batch: int, seq: int) -> Tokens | None:
    """Where a tensor of ``shape`` holds the ``batch`` x ``seq`` tokens, batch-major: the first dimension at which
    the leading sizes multiply to the token count and whose size the sequence divides (None: not a per-token
    tensor)."""
    acc = 1
    for d, n in enumerate(shape):
        acc *= int(n)
        if acc == batch * seq and n % seq == 0:
            return d, int(n) // seq, 1
        if acc > batch * seq:
            return None
    return None


def view_tokens(ishape: list[int], tokens: Tokens, oshape: list[int]) -> Tokens | None:
    """Where the sequence of a tensor of ``ishape`` holding ``tokens`` lands in a view of it as ``oshape`` (None: the
    view splits the sequence or merges it with a dimension between it and its tokens' outer/inner factors)."""
    d, outer, inner = tokens
    before, after = math.prod(ishape[:d]) * outer, inner * math.prod(ishape[d + 1:])
    seq = ishape[d] // (outer * inner)
    for j, n in enumerate(oshape):
        pb, pa = math.prod(oshape[:j]), math.prod(oshape[j + 1:])
        if pb and pa and before % pb == 0 and after % pa == 0 and (before // pb) * seq * (after // pa) == n:
            return j, before // pb, after // pa
    return None


def _fake(like: Any, shape: list[int]) -> torch.Tensor:
    with getattr(like, "fake_mode", None) or contextlib.nullcontext():
        return torch.empty(tuple(shape), dtype=like.dtype, device=like.device)


def _ids(graph: torch.fx.Graph) -> tuple[int, int] | None:
    """(batch, sequence) of the ids the word embedding looks up (any embedding of a graph input if none is
    vocabulary-parallel)."""
    found = []
    for node in graph.nodes:
        if node.op == "call_function" and (node.target is vocab_embedding or op_name(node) == "embedding"):
            ids = node_args(node)[1]
            src = ids
            while isinstance(src, torch.fx.Node) and src.op == "call_function" and op_name(src) in VIEWS | {"to"}:
                src = node_args(src)[0]
            v = value_of(ids)
            if isinstance(src, torch.fx.Node) and src.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim():
                found.append((node.target is not vocab_embedding, (math.prod(v.shape[:-1]), int(v.shape[-1]))))
    return min(found)[1] if found else None


class _Rewrite:
    """One pass over a tp rank's graph (see the module docstring)."""

    def __init__(self, graph: torch.fx.Graph, comm: torch.fx.Node, tp: int, batch: int, seq: int,
                 defer_weights: bool = True, keep_whole: Collection[str] = ()):
        self.g, self.comm, self.tp, self.batch, self.seq = graph, comm, tp, batch, seq
        self.defer_weights = defer_weights
        self.keep_whole: set[str] = set(keep_whole)  # weights read under another name too (tied): always through f
        self.deferred: list[tuple[torch.fx.Node, torch.fx.Node, list[str]]] = []  # (op, its input, weights)
        self.tokens: dict[str, Tokens] = {}       # node -> where its slice of the sequence is
        self.whole: dict[str, Any] = {}           # node -> its whole value (meta['val'] before the slice)
        self.made: dict[tuple[str, Any], torch.fx.Node] = {}  # (value, how) -> the node that made it so
        self.out = SequenceRewrite()

    def insert(self, fn: Callable, args: tuple, where: Callable, name: str, val: Any, like: torch.fx.Node,
               how: Any) -> torch.fx.Node:
        if (like.name, how) in self.made:
            return self.made[(like.name, how)]
        with where():
            made = self.g.create_node("call_function", fn, args, name=name)
        made.meta = {k: like.meta[k] for k in ("nn_module_stack", "stack_trace") if k in like.meta}
        made.meta["val"] = val
        self.made[(like.name, how)] = made
        return made

    def slice(self, node: torch.fx.Node, tokens: Tokens) -> None:
        """Record that ``node`` now holds this rank's slice of the sequence."""
        val = value_of(node)
        self.whole[node.name], self.tokens[node.name] = val, tokens
        shape = list(val.shape)
        shape[tokens[0]] //= self.tp
        node.meta["val"] = _fake(val, shape)

    def run(self) -> SequenceRewrite:
        for node in list(self.g.nodes):
            if node.op == "output":
                for n in node_inputs(node):
                    if n.name in self.tokens:
                        node.replace_input_with(n, self.gathered(n))
            elif node.op == "call_function":
                self.visit(node)
        self.settle_deferred()
        self.out.applied = bool(self.tokens)
        return self.out

    def settle_deferred(self) -> None:
        """Weights whose every use is a sliced op's leave their gradients partial (:attr:`SequenceRewrite.deferred`);
        one also read elsewhere (whole there, so its gradient there is already whole) goes through ``f`` after all."""
        skipped = {(node, n) for node, n, _ in self.deferred}
        mixed = set()
        for _, _, weights in self.deferred:
            for attr in (a for a in self.g.nodes if a.op == "get_attr" and str(a.target) in weights):
                if any((user, v) not in skipped for v, user in _uses(attr)):
                    mixed.update(weights)
        for node, n, weights in self.deferred:
            if set(weights) & mixed:
                made = self.insert(copy_to, (n, self.comm), lambda: self.g.inserting_before(node),  # noqa: B023
                                   f"{n.name}_sp_copy", value_of(n), n, "f")
                node.replace_input_with(n, made)
            else:
                self.out.deferred.extend(w for w in weights if w not in self.out.deferred)

    def gathered(self, n: torch.fx.Node) -> torch.fx.Node:
        """The whole sequence of the sliced value ``n``, for ops every rank runs whole."""
        return self.insert(seq_gather_whole, (n, self.tokens[n.name], self.comm), lambda: self.g.inserting_after(n),
                           f"{n.name}_sp_gather", self.whole[n.name], n, "gather")

    def visit(self, node: torch.fx.Node) -> None:
        val = value_of(node)
        if node.target is reduce_from or node.target is vocab_embedding:
            tokens = token_layout(val.shape, self.batch, self.seq) if isinstance(val, torch.Tensor) else None
            if tokens is None:
                return
            if node.target is reduce_from:
                node.target, node.args = seq_reduce_scatter, (node_args(node)[0], tokens, self.comm)
            else:
                node.kwargs = {**node.kwargs, "tokens": tokens}
            return self.slice(node, tokens)
        sliced = [n for n in node_inputs(node) if n.name in self.tokens]
        if not sliced:
            return None
        name = op_name(node)
        if node.target is copy_to:  # Megatron's f: the column-parallel matmul after it reads the whole sequence
            node.target, node.args = seq_gather, (node_args(node)[0], self.tokens[sliced[0].name], self.comm)
            return None
        if name == "_assert_tensor_metadata":
            node.kwargs = {k: v for k, v in node.kwargs.items() if k not in ("size", "stride")}
            return None
        tokens = self.rule(node, name, sliced)
        if tokens is None:
            self.out.notes.append(f"{node.name} ({name}) reads the whole sequence")
            for n in sliced:
                node.replace_input_with(n, self.gathered(n))
            return None
        if node.target is tp_dropout:  # each rank masks its own tokens: the rank's own stream
            node.args = (*node_args(node)[:3], True, *node_args(node)[4:])
        return self.slice(node, tokens)

    def rule(self, node: torch.fx.Node, name: str, sliced: list[torch.fx.Node]) -> Tokens | None:
        """Where ``node``'s output holds its slice of the sequence, with its inputs rewritten to match (None: it
        cannot run on a slice)."""
        a, out, x = node_args(node), value_of(node), sliced[0]
        first = a[1] if name == "addmm" else a[0]
        if not isinstance(out, torch.Tensor) or (name in VIEWS | _REDUCE | _MATMUL | {"unsqueeze"} and first is not x):
            return None
        d, outer, inner = self.tokens[x.name]
        ishape = list(self.whole[x.name].shape)
        if name in VIEWS:
            found = view_tokens(ishape, self.tokens[x.name], list(out.shape))
            if found is not None:
                shape = list(a[1])
                if shape[found[0]] != -1:
                    shape[found[0]] //= self.tp
                node.args = (x, shape, *a[2:])
            return found
        if name == "unsqueeze":
            return d + (a[1] % out.dim() <= d), outer, inner
        if name in _REDUCE:
            dims = [k % len(ishape) for k in (a[1] if len(a) > 1 and a[1] is not None else range(len(ishape)))]
            keep = len(a) > 2 and bool(a[2]) or bool(node.kwargs.get("keepdim"))
            return None if d in dims else (d - (0 if keep else sum(k < d for k in dims)), outer, inner)
        if name in _MATMUL:
            if len(sliced) > 1 or d >= len(ishape) - 1:
                return None
            return self.broadcast(node, (d, outer, inner), sliced, everywhere=True)
        if name == "layer_norm" and d >= len(ishape) - len(a[1]):
            return None
        if name in ELEMENTWISE or name == "layer_norm" or node.target is tp_dropout:
            return self.broadcast(node, (d + out.dim() - len(ishape), outer, inner), sliced, everywhere=False)
        return None

    def broadcast(self, node: torch.fx.Node, tokens: Tokens, sliced: list[torch.fx.Node],
                  everywhere: bool) -> Tokens | None:
        """An op whose output holds ``tokens``: sliced inputs must agree with it; a whole input is sliced alike where
        it runs along the tokens, else read through ``f`` (its gradient is a partial sum on each rank); a matmul's
        weights (``everywhere``) are all read through ``f``."""
        out = value_of(node)
        d = tokens[0]
        for n in sliced:
            t = self.tokens[n.name]
            if (t[0] + out.dim() - self.whole[n.name].dim(), *t[1:]) != tokens:
                return None
        plan: list[tuple[torch.fx.Node, str]] = []
        for n in node_inputs(node):
            v = value_of(n)
            if n.name in self.tokens or n is self.comm or not isinstance(v, torch.Tensor):
                continue
            j = d - (out.dim() - v.dim())
            if everywhere or j < 0 or v.shape[j] == 1:
                if v.is_floating_point():
                    plan.append((n, "f"))
            elif v.shape[j] == out.shape[d]:
                plan.append((n, "slice"))
            else:
                return None
        for n, how in plan:
            before = lambda: self.g.inserting_before(node)  # noqa: E731
            weights = _weights_of(n) if how == "f" and self.defer_weights else None
            if weights and not set(weights) & self.keep_whole:  # its partial gradients sum once per step
                self.deferred.append((node, n, weights))
                continue
            if how == "f":
                made = self.insert(copy_to, (n, self.comm), before, f"{n.name}_sp_copy", value_of(n), n, "f")
            else:
                j = d - (out.dim() - value_of(n).dim())
                shape = list(value_of(n).shape)
                shape[j] //= self.tp
                made = self.insert(seq_scatter, (n, (j, *tokens[1:]), self.comm), before, f"{n.name}_sp_scatter",
                                   _fake(value_of(n), shape), n, ("slice", j, tokens[1:]))
            node.replace_input_with(n, made)
        return tokens


def _uses(attr: torch.fx.Node) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """(value, op) for every op that reads ``attr`` itself or a cast or view of it (a value made from it alone)."""
    out, todo = [], [attr]
    while todo:
        v = todo.pop()
        for user in v.users:
            if user.op == "call_function" and _weights_of(user) is not None:
                todo.append(user)  # a view or cast of the weight alone: its users read the weight
            out.append((v, user))
    return out


def _weights_of(node: torch.fx.Node) -> list[str] | None:
    """The parameters (get_attr targets) ``node`` is computed from alone, through casts and views; None when it
    reads anything else."""
    seen, todo, found = set(), [node], []
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr":
            found.append(str(n.target))
        elif n.op == "call_function" and n.all_input_nodes:
            todo.extend(n.all_input_nodes)
        else:
            return None
    return found or None


def sequence_parallel(graph: torch.fx.Graph, comm: torch.fx.Node, tp: int, defer_weights: bool = True,
                      keep_whole: Collection[str] = ()) -> SequenceRewrite:
    """Rewrite ``graph``, tp rank's program whose collectives read ``comm``, so that its whole regions run on
    this rank's slice of the sequence (see the module docstring); the graph is unchanged where it cannot.
    ``defer_weights``: weights read whole leave their gradients partial, for the runtime to sum once per step
    (:attr:`SequenceRewrite.deferred`); False: through ``f`` in every backward (where the runtime cannot sum them,
    sharded data parallelism's shards). ``keep_whole``: weights that go through ``f`` anyway (a tied weight, read
    under another name where its gradient is whole)."""
    ids = _ids(graph)
    if ids is None:
        return SequenceRewrite(notes=["no embedding looks up the model's input ids, so the sequence dimension is "
                                      "unknown: the regions between tp regions stay whole"])
    batch, seq = ids
    if seq % tp:
        return SequenceRewrite(notes=[f"the sequence length {seq} does not divide by tensor_parallel_degree {tp}: "
                                      "the regions between tp regions stay whole"])
    return _Rewrite(graph, comm, tp, batch, seq, defer_weights, keep_whole).run()

