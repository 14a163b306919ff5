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

from dataclasses import dataclass, field
from typing import Collection

import torch
import torch.fx

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
from .shard_rules import node_args, value_of
from .token_walk import TokenWalk, fake_like, sequence_ids, token_layout, view_tokens

__all__ = ["SequenceRewrite", "SequenceParallelWarning", "sequence_parallel", "token_layout", "view_tokens"]


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


class _Rewrite(TokenWalk):
    """One pass over a tp rank's graph (see the module docstring)."""

    def __init__(self, graph: torch.fx.Graph, comm: torch.fx.Node, tp: int, batch: int, seq: int,
                 defer_weights: bool = True, keep_whole: Collection[str] = ()):
        super().__init__(graph, tp, batch, seq)
        self.comm = comm
        self.defer_weights = defer_weights
        self.keep_whole: set[str] = set(keep_whole)  # weights read under another name too (tied): always through f
        self.deferred: list[tuple[torch.fx.Node, torch.fx.Node, list[str]]] = []  # (op, its input, weights)
        self.out = SequenceRewrite()

    def run(self) -> SequenceRewrite:
        self.walk()
        self.settle_deferred()
        self.out.applied = bool(self.tokens)
        self.out.notes = self.notes
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
                node.replace_input_with(n, self.copied(node, n))
            else:
                self.out.deferred.extend(w for w in weights if w not in self.out.deferred)

    def copied(self, node: torch.fx.Node, n: torch.fx.Node) -> torch.fx.Node:
        """``n`` read through Megatron's ``f`` by ``node``: its gradient summed over the group in every backward."""
        return self.insert(copy_to, (n, self.comm), lambda: self.g.inserting_before(node), f"{n.name}_sp_copy",
                           value_of(n), n, "f")

    def gathered(self, n: torch.fx.Node) -> torch.fx.Node:
        return self.insert(seq_gather_whole, (n, self.tokens[n.name], self.comm), lambda: self.g.inserting_after(n),
                           f"{n.name}_sp_gather", self.whole[n.name], n, "gather")

    def scatter(self, node: torch.fx.Node, n: torch.fx.Node, tokens: Tokens) -> torch.fx.Node:
        return self.insert(seq_scatter, (n, tokens, self.comm), lambda: self.g.inserting_before(node),
                           f"{n.name}_sp_scatter", fake_like(value_of(n), self.sliced_shape(n, tokens)), n,
                           ("slice", *tokens))

    def read_whole(self, node: torch.fx.Node, n: torch.fx.Node) -> None:
        weights = _weights_of(n) if self.defer_weights else None
        if weights and not set(weights) & self.keep_whole:  # its partial gradients sum once per step
            self.deferred.append((node, n, weights))
        else:
            node.replace_input_with(n, self.copied(node, n))

    def start(self, node: torch.fx.Node) -> bool:
        if node.target is not reduce_from and node.target is not vocab_embedding:
            return False
        val = value_of(node)
        tokens = token_layout(val.shape, self.batch, self.seq) if isinstance(val, torch.Tensor) else None
        if tokens is None:
            return True
        if node.target is reduce_from:
            node.target, node.args = seq_reduce_scatter, (node_args(node)[0], tokens, self.comm)
        else:
            node.kwargs = {**node.kwargs, "tokens": tokens}
        self.slice(node, tokens)
        return True

    def special(self, node: torch.fx.Node, name: str, sliced: list[torch.fx.Node]) -> bool:
        if node.target is copy_to:  # Megatron's f: the column-parallel matmul after it reads the whole sequence
            node.target, node.args = seq_gather, (node_args(node)[0], self.tokens[sliced[0].name], self.comm)
            return True
        if node.target is not tp_dropout:
            return False
        out = value_of(node)
        d, outer, inner = self.tokens[sliced[0].name]
        tokens = self.broadcast(node, (d + out.dim() - self.whole[sliced[0].name].dim(), outer, inner), sliced,
                                everywhere=False)
        if tokens is None:
            self.whole_op(node, name, sliced)
            return True
        node.args = (*node_args(node)[:3], True, *node_args(node)[4:])  # each rank masks its own tokens
        self.slice(node, tokens)
        return True


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
    ids = sequence_ids(graph)
    if ids is None:
        return SequenceRewrite(notes=["no embedding looks up the model's input ids, so the sequence dimension is "
                                      "unknown: the regions between tp regions stay whole"])
    batch, seq = ids
    if seq % tp:
        return SequenceRewrite(notes=[f"the sequence length {seq} does not divide by tensor_parallel_degree {tp}: "
                                      "the regions between tp regions stay whole"])
    return _Rewrite(graph, comm, tp, batch, seq, defer_weights, keep_whole).run()

