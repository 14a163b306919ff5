"""What each op's backward reads, the rules :mod:`partitioner.capture.autograd_saves` applies op by op.

:data:`SAVES` is torch's own derivative formulas (``tools/autograd/derivatives.yaml`` in the torch source) as a table:
``mm``/``addmm``/``bmm``/``linear`` keep each operand whose partner needs a gradient (``mm_mat1_backward(grad,
mat2)``), so a layer keeps its input and, as a parameter, nothing new for its weight; ``_softmax``, ``tanh``,
``relu``, ``rsqrt`` keep their result; ``gelu``, ``silu``, ``pow`` keep their input; ``native_layer_norm`` its
input, mean and rstd; ``native_dropout`` its mask; ``embedding`` its indices. :data:`SAVES_NOTHING` lists the ops
whose backward reads no tensor: ``add``, ``sub``, ``cat``, casts and views, and the collectives of tensor and
sequence parallelism (DTensor redistributions, whose backward is the conjugate collective). Composite ops get a
rule of their own (:data:`SPECIAL`), from the ops they decompose into: dropout (a bool mask where the fused kernel
runs, a mask as wide as the input on the CPU, nothing when it is off), attention (the fused kernels keep q, k, v,
the output and the log-sum-exp; the CPU's math fallback under dropout keeps the scaled q and k, v, the
probabilities, the mask and the dropped probabilities), norms (input and per-row statistics), losses, and the ops a
parallel axis writes into a program, known by name as capture imports no axis: the vocabulary-parallel
cross-entropy (:func:`partitioner.tp.collectives.vocab_cross_entropy`) and context parallelism's token selections
and losses (:mod:`partitioner.cp.comm`). Each rule was checked against what autograd's saved-tensor hooks see
(``tests/partitioner/capture/test_save_rules.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["SAVES", "SAVES_NOTHING", "NO_GRAD", "SPECIAL", "DROPOUTS", "Value", "Rule", "nth"]

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
# Ops whose backward reads no tensor (a sum, a copy, a reshaping, a concatenation, a collective of tensor or sequence
# parallelism: a DTensor redistribution keeps only placements) or that have no gradient.
SAVES_NOTHING = frozenset({
    "add", "sub", "rsub", "neg", "sum", "mean", "cumsum", "cat", "stack", "clone", "contiguous", "_to_copy", "to",
    "type_as", "copy", "copy_", "expand", "expand_as", "repeat", "flip", "roll", "constant_pad_nd", "pad", "tril",
    "triu", "view", "_unsafe_view", "reshape", "transpose", "permute", "t", "unsqueeze", "squeeze", "slice",
    "select", "alias", "detach", "as_strided", "split", "split_with_sizes", "chunk", "unbind", "flatten",
    "unflatten", "view_as", "narrow", "movedim", "diagonal", "masked_fill_", "fill_", "zero_", "lift_fresh_copy",
    "_assert_tensor_metadata", "_assert_scalar", "sym_size", "getitem", "scalar_tensor", "zeros_like", "ones_like",
    "empty_like", "full_like", "rand_like", "randn_like", "new_zeros", "new_ones", "new_empty", "new_full",
    "arange", "zeros", "ones", "full", "empty", "bernoulli", "argmax", "argmin", "copy_to", "reduce_from",
    "gather_from", "scatter_to", "seq_reduce_scatter", "seq_gather", "seq_scatter", "seq_gather_whole",
    "_set_grad_enabled", "add_",
})
# Outputs of these never need a gradient, whatever their inputs.
NO_GRAD = frozenset({"detach", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
                     "new_zeros", "new_ones", "new_empty", "new_full", "bernoulli", "argmax", "argmin"})


@dataclass(frozen=True)
class Value:
    """A tensor as autograd sees it: the storage it pins (a key), that storage's bytes and float part, and
    whether it needs a gradient; ``held``: a parameter, buffer or constant (held anyway, never counted)."""

    key: Any
    nbytes: int
    float_bytes: int
    grad: bool
    held: bool = False


Rule = Callable[[dict[str, Any], dict[str, Any], tuple, str], list[Any]]


def nth(bound: dict[str, Any], i: int) -> Any:
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
    x, p, train = nth(metas, 0), nth(bound, 1), nth(bound, 2)
    if not isinstance(x, torch.Tensor) or not train or not p:
        return []
    fused = x.device.type != "cpu" and "input" in metas  # aten.dropout's first argument; tp_dropout's is x
    return [_new(op, "mask", x.numel(), 1 if fused else x.element_size(), not fused)]


def _attention(metas: dict[str, Any], bound: dict[str, Any], outs: tuple, op: str) -> list[Any]:
    """``scaled_dot_product_attention(q, k, v, attn_mask, dropout_p)``: the fused kernels (flash, memory-efficient,
    cuDNN; the CPU's flash kernel without dropout) keep q, k, v, the output, the per-row log-sum-exp and a float
    copy of a bool mask; the CPU's math fallback under dropout keeps the scaled q and k, v as batched, the
    probabilities, the dropout mask and the dropped probabilities."""
    q, k, v, mask = (nth(metas, i) for i in range(4))
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return [nth(bound, 0), nth(bound, 1), nth(bound, 2), outs[0]]
    rows, size = q.numel() // q.shape[-1], q.element_size()
    scores = rows * k.shape[-2]
    if q.device.type == "cpu" and nth(bound, 4):
        return [_new(op, "q", q.numel(), size), _new(op, "k", k.numel() * q.shape[-3] // k.shape[-3], size),
                _new(op, "v", v.numel() * q.shape[-3] // v.shape[-3], size),
                *(_new(op, f"p{i}", scores, size) for i in range(3))]
    saved = [nth(bound, 0), nth(bound, 1), nth(bound, 2), outs[0], _new(op, "lse", rows, 4)]
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        saved.append(_new(op, "mask", mask.numel(), size))
    else:
        saved.append(nth(bound, 3))
    return saved


def _norm(groups: Callable[[torch.Tensor, dict[str, Any]], int], stats: int) -> Rule:
    """A composite norm: its input plus ``stats`` per-group statistics (mean, rstd) in the accumulation dtype."""
    def rule(metas: dict[str, Any], bound: dict[str, Any], outs: tuple, op: str) -> list[Any]:
        x, acc = nth(metas, 0), 8 if nth(metas, 0).dtype == torch.float64 else 4
        return [nth(bound, 0), *(_new(op, f"stat{i}", groups(x, bound), acc) for i in range(stats))]
    return rule


def _rows(x: torch.Tensor, bound: dict[str, Any]) -> int:
    shape = nth(bound, 1) or [x.shape[-1]]
    return x.numel() // max(1, math.prod(int(s) for s in shape))


def _matmul(metas: dict[str, Any], bound: dict[str, Any], outs: tuple, op: str) -> list[Any]:
    """``matmul``: each operand whose partner needs a gradient; a batched one that cannot be viewed as (batch, m,
    k) is copied by the reshape before the ``bmm``, and it is the copy that ``bmm`` keeps."""
    saved: list[Any] = []
    for i in (0, 1):
        v, partner, x = nth(bound, i), nth(bound, 1 - i), nth(metas, i)
        if not isinstance(v, Value) or not (isinstance(partner, Value) and partner.grad):
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
    x = nth(metas, 0)
    logp = [_new(op, "log_softmax", x.numel(), x.element_size())] if isinstance(x, torch.Tensor) else []
    return [*logp, nth(bound, 1), bound.get("weight")]


def _vocab_cross_entropy(metas: dict[str, Any], bound: dict[str, Any], outs: tuple, op: str) -> list[Any]:
    """``vocab_cross_entropy(logits, target, start, reduction, ...)`` over this rank's logit shard: the logits shifted
    by the group's maximum (kept by the ``gather`` of the targets' logits) and their exponentials (kept by ``exp``),
    two storages as big as the shard; per token, the index gathered, the sum of exponentials (kept by ``log``) and two
    bool masks (kept by ``where``); under the mean (``reduction`` 1), the count it divides by."""
    x, target = nth(metas, 0), nth(metas, 1)
    if not isinstance(x, torch.Tensor) or not isinstance(target, torch.Tensor):
        return [nth(bound, 0)]
    rows, size = target.numel(), x.element_size()
    width = x.shape[-1] if x.dim() else 0  # a rank holding no classes gathers nothing
    return [_new(op, "shifted", x.numel(), size), _new(op, "exp", x.numel(), size),
            *([_new(op, "index", rows, 8, False)] if width else []), _new(op, "total", rows, size),
            _new(op, "mine", rows, 1, False), _new(op, "valid", rows, 1, False),
            *([_new(op, "count", 1, size)] if bound.get("reduction") == 1 else [])]


def _positions(gathered: bool) -> Rule:
    """``cp_scatter`` and (``gathered``) ``cp_gather(x, tokens, comm)`` select tokens by ``index_select``, which keeps
    only its index: one int64 per token of the result's sequence (this rank's share of it, or all of it gathered
    from the group)."""
    def rule(metas: dict[str, Any], bound: dict[str, Any], outs: tuple, op: str) -> list[Any]:
        x, (dim, outer, inner), size = nth(metas, 0), nth(bound, 1), int(getattr(nth(bound, 2), "size", 1))
        seq = x.shape[dim] // (outer * inner)
        return [_new(op, "index", seq * size if gathered else seq // size, 8, False)]
    return rule


def _group_loss(metas: dict[str, Any], bound: dict[str, Any], outs: tuple, op: str) -> list[Any]:
    """``cp_group_loss(losses, kept, reduction)``: a sum all-reduced, which keeps nothing, divided under the mean
    (``reduction`` 1) by the group's count, which the division keeps."""
    losses = nth(metas, 0)
    return [_new(op, "count", 1, losses.element_size())] if bound.get("reduction") == 1 else []


def _einsum(metas: dict[str, Any], bound: dict[str, Any], outs: tuple, op: str) -> list[Any]:
    """``einsum(equation, tensors)``: its operands (as the ``bmm`` it becomes keeps them)."""
    return [nth(bound, 1)]


# Dropouts, which return their input itself when off.
DROPOUTS = frozenset({"dropout", "tp_dropout", "feature_dropout", "alpha_dropout"})
# Per op, its rule of its own: ``rule(metas, bound, outs, op)`` is what it saves (values of ``bound``, the arguments
# by name, or new buffers of ``op``, the node's name), from ``metas``, the arguments' traced values.
SPECIAL: dict[str, Rule] = {
    "dropout": _dropout, "tp_dropout": _dropout, "feature_dropout": _dropout, "alpha_dropout": _dropout,
    "scaled_dot_product_attention": _attention, "tp_attention": _attention,
    "layer_norm": _norm(_rows, 2), "rms_norm": _norm(_rows, 1),
    "group_norm": _norm(lambda x, b: x.shape[0] * int(nth(b, 1) or 1), 2),
    "batch_norm": _norm(lambda x, b: x.shape[1] if x.dim() > 1 else 1, 2),
    "instance_norm": _norm(lambda x, b: x.shape[0] * x.shape[1], 2),
    "matmul": _matmul, "einsum": _einsum,
    "cross_entropy_loss": _cross_entropy, "vocab_cross_entropy": _vocab_cross_entropy,
    "cp_cross_entropy": _cross_entropy, "cp_group_loss": _group_loss, "cp_scatter": _positions(False),
    "cp_gather": _positions(True),
}
