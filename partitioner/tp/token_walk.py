"""Following a slice of the sequence through a traced graph, op by op: the walk sequence and context parallelism share.

Sequence parallelism (:mod:`partitioner.tp.sequence`) and context parallelism (:mod:`partitioner.cp.context_program`)
both rewrite a program so that a rank runs some of its ops on a slice of the sequence: the first the regions between
tensor-parallel regions (Korthikanti et al. 2022, arXiv:2205.05198), the second every op but the ones that mix
positions (Liu et al. 2023, "Ring Attention with Blockwise Transformers", arXiv:2310.01889; Llama 3's all-gather
of keys and values, Dubey et al. 2024, arXiv:2407.21783, section 3.3.2). What is shared is the walk: where a tensor
holds its tokens (:func:`token_layout`, :func:`view_tokens`; a :data:`~partitioner.tp.collectives.Tokens`), and,
from the ops an axis starts a slice at, which ops can run on it too (elementwise ops, norms and reductions over
other dimensions, matmuls by weights, views, transposes, expands, slices and concatenations along other dimensions).
A whole value such an op reads is sliced alike where it runs along the tokens, and otherwise read whole (a weight);
an op that cannot run on a slice, and a graph output, get the whole sequence first. :class:`TokenWalk` is that walk;
an axis says where slices start, what its scatter and gather are, what reading a weight whole means for its
gradient, and which ops it rewrites itself (:meth:`TokenWalk.start`, :meth:`TokenWalk.special`, ...).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch
import torch.fx

from ..capture.flops import op_name
from .collectives import Tokens, vocab_embedding
from .rank_values import laid_out, storage_of, view_value
from .shard_rules import ELEMENTWISE, VIEWS, node_args, node_inputs, value_of

__all__ = ["TokenWalk", "token_layout", "view_tokens", "sequence_ids", "fake_like"]

_REDUCE = {"mean", "sum", "amax", "amin"}
_MATMUL = {"linear", "mm", "addmm"}
_SPLITS = {"split", "split_with_sizes", "chunk"}
_MOVES = {"unsqueeze", "transpose", "expand", "slice"}
_SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax"}


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


def fake_like(like: Any, shape: list[int], dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty tensor of ``shape`` with ``like``'s device and dtype (or ``dtype``), fake where ``like`` is (a node's
    new value)."""
    with getattr(like, "fake_mode", None) or contextlib.nullcontext():
        return torch.empty(tuple(shape), dtype=dtype or like.dtype, device=like.device)


def sequence_ids(graph: torch.fx.Graph) -> tuple[int, int] | None:
    """(batch, sequence) of the ids the word embedding looks up (any embedding of a graph input if none is
    vocabulary-parallel)."""
    found = []
    for node in graph.nodes:
        if node.op == "call_function" and (node.target is vocab_embedding or op_name(node) == "embedding"):
            v = value_of(ids_input(node))
            if ids_input(node, placeholder=True) is not None and isinstance(v, torch.Tensor) and v.dim():
                found.append((node.target is not vocab_embedding, (math.prod(v.shape[:-1]), int(v.shape[-1]))))
    return min(found)[1] if found else None


def ids_input(node: torch.fx.Node, placeholder: bool = False) -> Any:
    """The ids an embedding op looks up; ``placeholder``: the graph input they are (through views and casts), or
    None when they are computed."""
    ids = node_args(node)[1]
    if not placeholder:
        return ids
    src = ids
    while isinstance(src, torch.fx.Node) and src.op == "call_function" and op_name(src) in VIEWS | {"to"}:
        src = node_args(src)[0]
    return src if isinstance(src, torch.fx.Node) and src.op == "placeholder" else None


class TokenWalk:
    """One pass over a program that slices its sequence ``degree`` ways (see the module docstring). Subclasses say
    where slices start (:meth:`start`), which ops they rewrite themselves (:meth:`special`), how a whole value is
    sliced (:meth:`scatter`) and gathered back (:meth:`gathered`), and what reading a weight whole means
    (:meth:`read_whole`)."""

    def __init__(self, graph: torch.fx.Graph, degree: int, batch: int, seq: int):
        self.g, self.degree, self.batch, self.seq = graph, degree, batch, seq
        self.tokens: dict[str, Tokens] = {}       # node -> where its slice of the sequence is
        self.whole: dict[str, Any] = {}           # node -> its whole value (meta['val'] before the slice)
        self.made: dict[tuple[str, Any], torch.fx.Node] = {}  # (value, how) -> the node that made it so
        self.notes: list[str] = []
        # the storage of each traced value, read before any is sliced: which values are views of which
        self.storage = {n.name: storage_of(n.meta.get("val")) for n in graph.nodes}

    # What an axis says ------------------------------------------------------------------------------------------
    def start(self, node: torch.fx.Node) -> bool:
        """Rewrite ``node`` if a slice starts there (True), else leave it to the walk (False)."""
        raise NotImplementedError

    def special(self, node: torch.fx.Node, name: str, sliced: list[torch.fx.Node]) -> bool:
        """Rewrite ``node``, which reads the sliced values ``sliced``, if this axis has its own rule for it."""
        return False

    def scatter(self, node: torch.fx.Node, n: torch.fx.Node, tokens: Tokens) -> torch.fx.Node:
        """A node for this rank's slice of the whole value ``n`` (its tokens at ``tokens``), read by ``node``."""
        raise NotImplementedError

    def gathered(self, n: torch.fx.Node) -> torch.fx.Node:
        """A node for the whole sequence of the sliced value ``n``."""
        raise NotImplementedError

    def read_whole(self, node: torch.fx.Node, n: torch.fx.Node) -> None:
        """``node``, which runs on a slice, reads the floating-point value ``n`` whole (a weight, a bias)."""

    # The walk ---------------------------------------------------------------------------------------------------
    def insert(self, fn: torch.fx.node.Target, args: tuple, where: Callable, name: str, val: Any, like: torch.fx.Node,
               how: Any, kwargs: dict[str, Any] | None = None) -> torch.fx.Node:
        """``fn(*args, **kwargs)`` as a node at ``where()``, valued ``val``, made once per (``like``, ``how``)."""
        if (like.name, how) in self.made:
            return self.made[(like.name, how)]
        with where():
            made = self.g.create_node("call_function", fn, args, kwargs, name=name)
        made.meta = {k: like.meta[k] for k in ("nn_module_stack", "stack_trace") if k in like.meta}
        made.meta["val"] = val
        self.made[(like.name, how)] = made
        return made

    def slice(self, node: torch.fx.Node, tokens: Tokens) -> None:
        """Record that ``node`` now holds this rank's slice of the sequence (each of its tensors, for a split): where
        the traced value is a view of an input's, that view of the input's slice (its storage, which autograd keeps
        once however many ops save views of it), else a new value laid out as the traced one
        (:mod:`partitioner.tp.rank_values`)."""
        val = value_of(node)
        self.whole[node.name], self.tokens[node.name] = val, tokens

        def shape_of(v: torch.Tensor) -> list[int]:
            shape = list(v.shape)
            shape[tokens[0]] //= self.degree
            return shape

        if isinstance(val, (list, tuple)):
            node.meta["val"] = [laid_out(v, shape_of(v)) for v in val]
            return
        base = self.storage.get(node.name)
        source = next((n for n in node.all_input_nodes if base is not None and self.storage.get(n.name) == base), None)
        view = view_value(node, source, shape_of(val)) if source is not None else None
        node.meta["val"] = view if view is not None else laid_out(val, shape_of(val))

    def sliced_shape(self, n: torch.fx.Node, tokens: Tokens) -> list[int]:
        """The shape of this rank's slice of the whole value ``n`` along ``tokens``."""
        shape = list(value_of(n).shape)
        shape[tokens[0]] //= self.degree
        return shape

    def walk(self) -> None:
        """Visit every op in order; a graph output that holds a slice gets the whole sequence."""
        for node in list(self.g.nodes):
            if node.op == "output":
                for n in node_inputs(node):
                    if n.name in self.tokens:
                        node.replace_input_with(n, self.gathered(n))
            elif node.op == "call_function":
                self.visit(node)

    def visit(self, node: torch.fx.Node) -> None:
        """Slice ``node`` where it can run on its inputs' slices, else give it their whole sequence."""
        if self.start(node):
            return
        sliced = [n for n in node_inputs(node) if n.name in self.tokens]
        if not sliced:
            return
        name = op_name(node)
        if name == "_assert_tensor_metadata":
            node.kwargs = {k: v for k, v in node.kwargs.items() if k not in ("size", "stride")}
            return
        if self.special(node, name, sliced):
            return
        tokens = self.rule(node, name, sliced)
        if tokens is None:
            self.whole_op(node, name, sliced)
            return
        self.slice(node, tokens)

    def whole_op(self, node: torch.fx.Node, name: str, sliced: list[torch.fx.Node]) -> None:
        """``node`` reads its sliced inputs whole."""
        self.notes.append(f"{node.name} ({name}) reads the whole sequence")
        for n in sliced:
            node.replace_input_with(n, self.gathered(n))

    def rule(self, node: torch.fx.Node, name: str, sliced: list[torch.fx.Node]) -> Tokens | None:
        """Where ``node``'s output holds its slice of the sequence, with its inputs rewritten to match (None: it
        cannot run on a slice)."""
        a, out, x = node_args(node), value_of(node), sliced[0]
        first = a[1] if name == "addmm" else a[0]
        if name in VIEWS | _REDUCE | _MATMUL | _SPLITS | _MOVES | _SOFTMAX and first is not x:
            return None
        if name == "getitem":  # one tensor of a split along another dimension
            return self.tokens[x.name] if isinstance(self.whole[x.name], (list, tuple)) else None
        d, outer, inner = self.tokens[x.name]
        ishape = list(self.whole[x.name].shape)
        if name in _SPLITS:
            return (d, outer, inner) if (a[2] if len(a) > 2 else 0) % len(ishape) != d else None
        if not isinstance(out, torch.Tensor):
            return None
        if name in VIEWS:
            found = view_tokens(ishape, self.tokens[x.name], list(out.shape))
            if found is not None:
                shape = list(a[1])
                if shape[found[0]] != -1:
                    shape[found[0]] //= self.degree
                node.args = (x, shape, *a[2:])
            return found
        if name == "unsqueeze":
            return d + (a[1] % out.dim() <= d), outer, inner
        if name == "transpose":
            d0, d1 = a[1] % len(ishape), a[2] % len(ishape)
            return {d0: d1, d1: d0}.get(d, d), outer, inner
        if name == "expand":
            j = d + out.dim() - len(ishape)
            sizes = list(a[1])
            if sizes[j] != -1:
                sizes[j] //= self.degree
            node.args = (x, sizes, *a[2:])
            return j, outer, inner
        if name == "slice":  # along another dimension, or the whole of this one (``x[:, 0:]``)
            whole = len(a) > 3 and a[2] in (0, None) and (a[3] is None or a[3] >= ishape[d])
            return (d, outer, inner) if a[1] % len(ishape) != d or whole else None
        if name == "cat":
            dim = (a[1] if len(a) > 1 else 0) % len(ishape)
            parts = list(a[0])
            if dim == d or any(p.name not in self.tokens or self.tokens[p.name] != (d, outer, inner) for p in parts):
                return None
            return d, outer, inner
        if name in _SOFTMAX:  # over another dimension: each token's own
            return (d, outer, inner) if a[1] % len(ishape) != d else None
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
        if name in ELEMENTWISE or name == "layer_norm":
            return self.broadcast(node, (d + out.dim() - len(ishape), outer, inner), sliced, everywhere=False)
        return None

    def broadcast(self, node: torch.fx.Node, tokens: Tokens, sliced: list[torch.fx.Node],
                  everywhere: bool) -> Tokens | None:
        """An op whose output holds ``tokens``: sliced inputs must agree with it; a whole input is sliced alike where
        it runs along the tokens, else read whole (:meth:`read_whole`); a matmul's weights (``everywhere``) are all
        read whole."""
        out = value_of(node)
        d = tokens[0]
        for n in sliced:
            t = self.tokens[n.name]
            if (t[0] + out.dim() - self.whole[n.name].dim(), *t[1:]) != tokens:
                return None
        plan: list[tuple[torch.fx.Node, int | None]] = []
        for n in node_inputs(node):
            v = value_of(n)
            if n.name in self.tokens or not isinstance(v, torch.Tensor):
                continue
            j = d - (out.dim() - v.dim())
            if everywhere or j < 0 or v.shape[j] == 1:
                if v.is_floating_point():
                    plan.append((n, None))
            elif v.shape[j] == out.shape[d]:
                plan.append((n, j))
            else:
                return None
        for n, j in plan:
            if j is None:
                self.read_whole(node, n)
            else:
                node.replace_input_with(n, self.scatter(node, n, (j, *tokens[1:])))
        return tokens
