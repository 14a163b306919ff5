"""What autograd keeps for backward: the activations a training forward leaves alive, per traced op.

Method: each ATen op's backward reads a few of its inputs and outputs, and autograd saves exactly those when the
op runs with gradients on. Which ones is torch's own derivative formula for the op (``tools/autograd/
derivatives.yaml`` in the torch source; composite ops such as ``linear``, ``layer_norm``, ``dropout`` and
``scaled_dot_product_attention`` by the ops they decompose into). :data:`SAVES` is that table: ``mm``/``addmm``/
``bmm``/``linear`` keep each operand whose partner needs a gradient (``mm_mat1_backward(grad, mat2)``), so a
layer keeps its input and, as a parameter, nothing new for its weight; ``_softmax``, ``tanh``, ``relu``,
``rsqrt`` keep their result; ``gelu``, ``silu``, ``pow`` keep their input; ``native_layer_norm`` its input, mean
and rstd; ``native_dropout`` its mask; ``embedding`` its indices; ``add``, ``sub``, ``cat``, casts and views
nothing. A few ops get a rule of their own (``_SPECIAL``): dropout (a bool mask where the fused kernel
runs, a mask as wide as the input on the CPU, nothing when it is off), attention (the fused kernels keep q, k,
v, the output and the log-sum-exp; the CPU's math fallback under dropout keeps the scaled q and k, v, the
probabilities, the mask and the dropped probabilities), norms (input and per-row statistics) and losses.

A tensor is counted by its storage: the fake tensors torch.export records on every node share storage the way
the real ones will (a view, a no-op cast or a ``split`` sees its base's storage), so a storage that several ops
save -- q, k and v sliced from one projection, a residual read by a norm and by a multiply -- counts once, on
the first op in graph order that saves it, with the bytes of the whole storage, as the memory it pins. Parameters,
buffers and constants and their views count nothing (they are held anyway). An op saves nothing when its
output needs no gradient: under ``torch.no_grad`` (``wrap_with_set_grad_enabled``), or when no input needs one
(masks, positions, the embedding's ids). Ops not in the table save their outputs (the conservative rule), and
are reported (:attr:`Saved.unknown`): nothing is under-counted silently.
"""
from __future__ import annotations

import inspect
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx

from .flops import op_name

__all__ = ["Saved", "saved_bytes", "SAVES", "SAVES_NOTHING"]

# Per op (short name, :func:`partitioner.capture.flops.op_name`): what its backward reads. ``"x"``: argument ``x`` (by
# its schema name) whenever the op's output needs a gradient; ``"x if y"``: argument ``x`` only when ``y`` needs one;
# ``"out"``, ``"out1"``, ...: the op's outputs.
SAVES: dict[str, tuple[str, ...]] = {
    **{k: ("self if mat2", "mat2 if self") for k in ("mm", "bmm")},
    "addmm": ("mat1 if mat2", "mat2 if mat1"),
    "_grouped_mm": ("self if mat2", "mat2 if self"), "grouped_mm_fallback": ("input", "weight"),
    **{k: ("batch1 if batch2", "batch2 if batch1") for k in ("baddbmm", "addbmm")},
    "linear": ("input if weight", "weight if input"),
    "mul": ("self if other", "other if self"),
    "div": ("other if self", "self if other", "other if other"),
    **{k: ("input", "weight") for k in ("convolution", "_convolution", "conv1d", "conv2d", "conv3d",
                                        "conv_transpose1d", "conv_transpose2d", "conv_transpose3d")},
    **{k: ("out",) for k in ("_softmax", "softmax", "_log_softmax", "log_softmax", "relu", "tanh", "sigmoid",
                             "exp", "rsqrt", "sqrt", "reciprocal", "elu", "_safe_softmax")},
    **{k: ("self",) for k in ("gelu", "silu", "mish", "hardswish", "hardsigmoid", "hardtanh", "relu6",
                              "leaky_relu", "softplus", "log", "log1p", "sin", "cos", "erf", "abs", "clamp",
                              "clamp_min", "clamp_max", "square", "avg_pool1d", "avg_pool2d", "avg_pool3d",
                              "adaptive_avg_pool1d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d", "var")},
    "pow": ("self", "exponent", "out if exponent"),
    **{k: ("self", "out") for k in ("amax", "amin", "prod", "std", "linalg_vector_norm", "norm")},
    **{k: ("out1",) for k in ("max", "min", "sort", "topk")},
    "max_pool2d_with_indices": ("self", "out1"),
    "native_layer_norm": ("input", "weight", "out1", "out2"),
    "native_group_norm": ("input", "weight", "out1", "out2"),
    **{k: ("input", "weight", "out1", "out2") for k in ("native_batch_norm", "_native_batch_norm_legit",
                                                        "_native_batch_norm_legit_no_training")},
    "native_dropout": ("out1",),
    "embedding": ("indices if weight",), "vocab_embedding": ("ids if weight",),
    "index": ("indices if self",),
    **{k: ("index if self",) for k in ("index_select", "gather", "scatter", "scatter_add")},
    "where": ("condition",),
    "masked_fill": ("mask",),
    **{k: ("self", "target", "weight") for k in ("nll_loss", "nll_loss_forward", "nll_loss_nd", "nll_loss2d",
                                                 "nll_loss2d_forward")},
    **{k: ("self", "target") for k in ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
                                       "binary_cross_entropy")},
    "binary_cross_entropy_with_logits": ("self", "target", "weight", "pos_weight"),
    **{k: ("query", "key", "value", "out", "out1") for k in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")},
}
# Ops whose backward reads no tensor (a sum, a copy, a reshaping, a concatenation) or that have no gradient.
SAVES_NOTHING = frozenset({
    "add", "sub", "rsub", "neg", "sum", "mean", "cumsum", "cat", "stack", "clone", "contiguous", "_to_copy", "to",
    "type_as", "copy", "copy_", "expand", "expand_as", "repeat", "flip", "roll", "constant_pad_nd", "pad", "tril",
    "triu", "view", "_unsafe_view", "reshape", "transpose", "permute", "t", "unsqueeze", "squeeze", "slice",
    "select", "alias", "detach", "as_strided", "split", "split_with_sizes", "chunk", "unbind", "flatten",
    "unflatten", "view_as", "narrow", "movedim", "diagonal", "masked_fill_", "fill_", "zero_", "lift_fresh_copy",
    "_assert_tensor_metadata", "_assert_scalar", "sym_size", "getitem", "scalar_tensor", "zeros_like", "ones_like",
    "empty_like", "full_like", "rand_like", "randn_like", "new_zeros", "new_ones", "new_empty", "new_full",
    "arange", "zeros", "ones", "full", "empty", "bernoulli", "argmax", "argmin", "copy_to", "reduce_from",
    "gather_from", "scatter_to", "_set_grad_enabled", "add_",
})
# Outputs of these never need a gradient, whatever their inputs.
_NO_GRAD = frozenset({"detach", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
                      "new_zeros", "new_ones", "new_empty", "new_full", "bernoulli", "argmax", "argmin"})


@dataclass
class Saved:
    """Per fx node name, the bytes of the storages it is the first to save for backward and their floating-point
    part; ``unknown``: the kinds of the ops that needed a gradient but are not in :data:`SAVES` (counted by their
    outputs)."""

    by_node: dict[str, tuple[int, int]] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Value:
    """A tensor as autograd sees it: the storage it pins (a key), that storage's bytes and float part, and
    whether it needs a gradient; ``held``: a parameter, buffer or constant (held anyway, never counted)."""

    key: Any
    nbytes: int
    float_bytes: int
    grad: bool
    held: bool = False


def saved_bytes(gm: torch.fx.GraphModule, inputs_require_grad: bool = False) -> Saved:
    """What each op of the exported graph ``gm`` saves for backward (see the module docstring).
    ``inputs_require_grad``: whether the graph's floating-point inputs need gradients (a loss applied to a
    model's output: yes; a model's data: no)."""
    saved = Saved()
    walker = _Walker(gm, saved)
    env: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node.name] = walker.value(node, inputs_require_grad and _is_float(node.meta.get("val")))
    walker.walk(gm, env, True, owner=None)
    return saved


def _is_float(v: Any) -> bool:  # what can need a gradient
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def _storage_key(v: Any) -> Any:
    try:
        return ("storage", v.untyped_storage()._cdata)
    except Exception:  # no storage to speak of (a symbolic or sparse tensor): the node's own value
        return None


def _nbytes(v: torch.Tensor) -> int:
    try:
        return int(v.untyped_storage().nbytes())
    except Exception:
        return v.numel() * v.element_size()


class _Walker:
    """Walks an fx graph (and the bodies of its grad-mode and autocast regions) in order, recording saves."""

    def __init__(self, gm: torch.fx.GraphModule, saved: Saved):
        self.saved, self.claimed = saved, set[Any]()
        self.alias: dict[Any, Any] = {}   # storage key of a region's or getitem's fake -> the key it stands for
        self.held: set[Any] = set()       # storage keys of parameters, buffers and constants

    def value(self, node: torch.fx.Node, grad: bool, held: bool = False, v: Any = None) -> Any:
        """The :class:`_Value` (or tuple of them) of ``node``'s result ``v`` (default: its traced value)."""
        v = node.meta.get("val") if v is None else v
        if isinstance(v, (tuple, list)):
            return tuple(self.value(node, grad, held, x) for x in v)
        if not isinstance(v, torch.Tensor):
            return None
        key = _storage_key(v)
        key = self.alias.get(key, key) if key is not None else ("node", node.name, id(v))
        return _Value(key, _nbytes(v), _nbytes(v) if _is_float(v) else 0, grad and _is_float(v), held)

    def claim(self, owner: str, value: Any) -> None:
        """``owner`` saves ``value`` (a :class:`_Value`, or a new buffer as ``(key, bytes, float bytes)``)."""
        if isinstance(value, tuple):
            if not value or isinstance(value[0], _Value) or value[0] is None:
                for v in value:
                    self.claim(owner, v)
                return
            value = _Value(value[0], value[1], value[2], False)
        if not isinstance(value, _Value) or value.held or value.key in self.held or value.key in self.claimed:
            return
        self.claimed.add(value.key)
        b, f = self.saved.by_node.get(owner, (0, 0))
        self.saved.by_node[owner] = (b + value.nbytes, f + value.float_bytes)

    def walk(self, gm: torch.fx.GraphModule, env: dict[str, Any], grad_on: bool, owner: str | None) -> Any:
        """Record the saves of ``gm``'s nodes (placeholders already in ``env``), attributed to ``owner`` if
        given (a region's body: its outer node); the graph's output values."""
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                attr = operator.attrgetter(node.target)(gm)
                if isinstance(attr, torch.Tensor):
                    env[node.name] = self.value(node, isinstance(attr, torch.nn.Parameter) and attr.requires_grad,
                                                held=True)
                    self.held.update(v.key for v in _flat([env[node.name]]) if isinstance(v, _Value))
                else:
                    env[node.name] = attr
            elif node.op == "output":
                return torch.fx.node.map_arg(node.args[0], lambda n: env.get(n.name))
            elif node.op == "call_function":
                if node.target is torch._C._set_grad_enabled:
                    grad_on = bool(node.args[0])
                    continue
                env[node.name] = self.call(gm, node, env, grad_on, owner or node.name)
        return None

    def call(self, gm: torch.fx.GraphModule, node: torch.fx.Node, env: dict[str, Any], grad_on: bool,
             owner: str) -> Any:
        """Record what ``node`` saves; its result's :class:`_Value`."""
        target, name = node.target, op_name(node)
        args: Any = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env.get(n.name))
        if target is operator.getitem:
            parent, own = args[0][0], self.value(node, False)
            got = parent[args[0][1]] if isinstance(parent, (tuple, list)) else None
            if isinstance(own, _Value) and isinstance(got, _Value) and own.key != got.key:
                self.alias[own.key] = got.key  # a region's result: the storage inside the region
            return got if isinstance(got, _Value) else own
        if name in ("wrap_with_set_grad_enabled", "wrap_with_autocast"):
            enabled = bool(args[0][0]) if name == "wrap_with_set_grad_enabled" else grad_on
            at = 1 if name == "wrap_with_set_grad_enabled" else 4
            body = args[0][at]
            return self.region(body, node, args[0][at + 1:], grad_on and enabled, owner)
        if (slot := getattr(target, "smp_region", None)) is not None:  # an axis's op standing for a region (ep)
            return self.region(args[0][slot], node, args[0][slot + 1:], grad_on, owner)
        if name in _DROPOUTS and not (_nth(_bind(target, *args), 1) and _nth(_bind(target, *args), 2)):
            return args[0][0]  # dropout that is off returns its input itself (the fake kernel copies it)
        inputs = [v for v in _flat(args) if isinstance(v, _Value)]
        grad = grad_on and name not in _NO_GRAD and any(v.grad for v in inputs)
        held = bool(inputs) and all(v.held for v in inputs) and name in SAVES_NOTHING  # a view of a weight
        out = self.value(node, grad, held)
        if not grad:
            return out
        bound = _bind(target, args[0], args[1])
        outs = out if isinstance(out, tuple) else (out,)
        if name in _SPECIAL:
            metas = torch.fx.node.map_arg(_bind(target, node.args, node.kwargs), lambda n: n.meta.get("val"))
            for item in _SPECIAL[name](metas, bound, outs, node.name):
                self.claim(owner, item)
        elif name in SAVES:
            for rule in SAVES[name]:
                what, _, when = rule.partition(" if ")
                if when and not any(v.grad for v in _flat([bound.get(when)]) if isinstance(v, _Value)):
                    continue
                self.claim(owner, _pick(what, bound, outs))
        elif name not in SAVES_NOTHING:
            if name not in self.saved.unknown:
                self.saved.unknown.append(name)
            self.claim(owner, outs)
        return out

    def region(self, body: torch.fx.GraphModule, node: torch.fx.Node, args: tuple, grad_on: bool,
               owner: str) -> Any:
        """A grad-mode or autocast region: its body walked with its placeholders bound to the outer values."""
        env: dict[str, Any] = {}
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        for p, outer in zip(placeholders, args):
            env[p.name] = outer
            key = _storage_key(p.meta.get("val"))
            if isinstance(outer, _Value) and key is not None:
                self.alias[key] = outer.key
        result = self.walk(body, env, grad_on, owner)
        return tuple(result) if isinstance(result, (list, tuple)) else result


def _flat(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)) and not isinstance(x, _Value):
        return [y for item in x for y in _flat(item)]
    if isinstance(x, dict):
        return _flat(list(x.values()))
    return [x]


def _bind(target: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by their schema (ATen op) or signature (Python function) names, in that order,
    defaults filled in."""
    schema = getattr(target, "_schema", None)
    if schema is not None:
        defaults = {a.name: a.default_value if a.has_default_value() else None for a in schema.arguments}
    else:
        try:
            defaults = {k: None if p.default is inspect.Parameter.empty else p.default
                        for k, p in inspect.signature(target).parameters.items()}
        except (TypeError, ValueError):
            defaults = {}
    return {**defaults, **dict(zip(defaults, args)), **kwargs}


def _pick(what: str, bound: dict[str, Any], outs: tuple) -> Any:
    if what.startswith("out"):
        i = int(what[3:] or 0)
        return outs[i] if i < len(outs) else None
    v = bound.get(what)
    return tuple(x for x in _flat([v]) if isinstance(x, _Value)) or None


Rule = Callable[[dict[str, Any], dict[str, Any], tuple, str], list[Any]]


def _nth(bound: dict[str, Any], i: int) -> Any:
    """The ``i``-th argument (ATen ops and the engine's tensor-parallel ops agree on positions, not names)."""
    values = list(bound.values())
    return values[i] if i < len(values) else None


def _new(op: str, tag: str, numel: int, itemsize: int, floating: bool = True) -> tuple:
    """A buffer the op allocates and saves (a mask, statistics): a storage of its own."""
    return (("new", op, tag), numel * itemsize, numel * itemsize if floating else 0)


def _dropout(metas: dict[str, Any], bound: dict[str, Any], outs: tuple, op: str) -> list[Any]:
    """``dropout(input, p, train)``: off (no training or p = 0) it returns its input; on, the fused kernel
    (``native_dropout``, off the CPU) keeps a bool mask, the CPU's composite (and the engine's ``tp_dropout``) a
    mask as wide as the input it multiplies."""
    x, p, train = _nth(metas, 0), _nth(bound, 1), _nth(bound, 2)
    if not isinstance(x, torch.Tensor) or not train or not p:
        return []
    fused = x.device.type != "cpu" and "input" in metas  # aten.dropout's first argument; tp_dropout's is x
    return [_new(op, "mask", x.numel(), 1 if fused else x.element_size(), not fused)]


def _attention(metas: dict[str, Any], bound: dict[str, Any], outs: tuple, op: str) -> list[Any]:
    """``scaled_dot_product_attention(q, k, v, attn_mask, dropout_p)``: the fused kernels (flash, memory-efficient,
    cuDNN; the CPU's flash kernel without dropout) keep q, k, v, the output, the per-row log-sum-exp and a float
    copy of a bool mask; the CPU's math fallback under dropout keeps the scaled q and k, v as batched, the
    probabilities, the dropout mask and the dropped probabilities."""
    q, k, v, mask = (_nth(metas, i) for i in range(4))
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return [_nth(bound, 0), _nth(bound, 1), _nth(bound, 2), outs[0]]
    rows, size = q.numel() // q.shape[-1], q.element_size()
    scores = rows * k.shape[-2]
    if q.device.type == "cpu" and _nth(bound, 4):
        return [_new(op, "q", q.numel(), size), _new(op, "k", k.numel() * q.shape[-3] // k.shape[-3], size),
                _new(op, "v", v.numel() * q.shape[-3] // v.shape[-3], size),
                *(_new(op, f"p{i}", scores, size) for i in range(3))]
    saved = [_nth(bound, 0), _nth(bound, 1), _nth(bound, 2), outs[0], _new(op, "lse", rows, 4)]
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        saved.append(_new(op, "mask", mask.numel(), size))
    else:
        saved.append(_nth(bound, 3))
    return saved


def _norm(groups: Callable[[torch.Tensor, dict[str, Any]], int], stats: int) -> Rule:
    """A composite norm: its input plus ``stats`` per-group statistics (mean, rstd) in the accumulation dtype."""
    def rule(metas: dict[str, Any], bound: dict[str, Any], outs: tuple, op: str) -> list[Any]:
        x, acc = _nth(metas, 0), 8 if _nth(metas, 0).dtype == torch.float64 else 4
        return [_nth(bound, 0), *(_new(op, f"stat{i}", groups(x, bound), acc) for i in range(stats))]
    return rule


def _rows(x: torch.Tensor, bound: dict[str, Any]) -> int:
    shape = _nth(bound, 1) or [x.shape[-1]]
    return x.numel() // max(1, math.prod(int(s) for s in shape))


def _matmul(metas: dict[str, Any], bound: dict[str, Any], outs: tuple, op: str) -> list[Any]:
    """``matmul``: each operand whose partner needs a gradient; a batched one that cannot be viewed as (batch, m,
    k) is copied by the reshape before the ``bmm``, and it is the copy that ``bmm`` keeps."""
    saved: list[Any] = []
    for i in (0, 1):
        v, partner, x = _nth(bound, i), _nth(bound, 1 - i), _nth(metas, i)
        if not isinstance(v, _Value) or not (isinstance(partner, _Value) and partner.grad):
            continue
        copied = isinstance(x, torch.Tensor) and x.dim() >= 3 and not _viewable(x)
        saved.append(_new(op, f"operand{i}", x.numel(), x.element_size()) if copied else v)
    return saved


def _viewable(x: torch.Tensor) -> bool:
    try:
        torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta").view(-1, *x.shape[-2:])
        return True
    except RuntimeError:
        return False


def _cross_entropy(metas: dict[str, Any], bound: dict[str, Any], outs: tuple, op: str) -> list[Any]:
    """``cross_entropy_loss(logits, target)`` = ``log_softmax`` (keeps its result, as big as the logits) then
    ``nll_loss`` (keeps that result again and the targets)."""
    x = _nth(metas, 0)
    logp = [_new(op, "log_softmax", x.numel(), x.element_size())] if isinstance(x, torch.Tensor) else []
    return [*logp, _nth(bound, 1), bound.get("weight")]


def _einsum(metas: dict[str, Any], bound: dict[str, Any], outs: tuple, op: str) -> list[Any]:
    """``einsum(equation, tensors)``: its operands (as the ``bmm`` it becomes keeps them)."""
    return [_nth(bound, 1)]


_DROPOUTS = frozenset({"dropout", "tp_dropout", "feature_dropout", "alpha_dropout"})
_SPECIAL: dict[str, Rule] = {
    "dropout": _dropout, "tp_dropout": _dropout, "feature_dropout": _dropout, "alpha_dropout": _dropout,
    "scaled_dot_product_attention": _attention, "tp_attention": _attention,
    "layer_norm": _norm(_rows, 2), "rms_norm": _norm(_rows, 1),
    "group_norm": _norm(lambda x, b: x.shape[0] * int(_nth(b, 1) or 1), 2),
    "batch_norm": _norm(lambda x, b: x.shape[1] if x.dim() > 1 else 1, 2),
    "instance_norm": _norm(lambda x, b: x.shape[0] * x.shape[1], 2),
    "matmul": _matmul, "einsum": _einsum,
    "cross_entropy_loss": _cross_entropy, "vocab_cross_entropy": _cross_entropy,
}
