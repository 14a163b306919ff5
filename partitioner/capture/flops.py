"""FLOPs and bytes of one traced op, from the shapes torch.export recorded on its fx node.

Counts follow the usual conventions of roofline analysis (Williams et al. 2009, "Roofline: an insightful
visual performance model", CACM 52(4)): a multiply-add is 2 FLOPs, so a matmul of (m, k) by (k, n) is
2mkn; a convolution is 2 FLOPs per multiply-add of every output element with its receptive field;
attention (``scaled_dot_product_attention`` and the flash / efficient kernels) is the two matmuls QK^T
and PV plus a few FLOPs per score for the softmax. Views (reshape, transpose, slicing, ...) are free: they
move no data and keep no activation of their own. Every other op costs one FLOP per output element and
moves its inputs and outputs once through memory.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx

__all__ = ["op_flops_and_bytes", "REGION_COST", "is_matmul_class", "tensor_bytes", "float_bytes", "op_name",
           "VIEW_OPS", "NORM_OPS", "TP_EQUIVALENT"]

# node.meta key: the (FLOPs, bytes, float bytes) of an op that stands for a region of ops (a parallel axis's, such
# as an expert layer run where its experts live), recorded by the axis that wrote it
REGION_COST = "smp_region_cost"
# Ops that return a view (or nothing at all) and cost no memory traffic of their own.
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "transpose", "permute", "t", "expand", "unsqueeze", "squeeze",
    "slice", "select", "alias", "detach", "as_strided", "split", "split_with_sizes", "chunk", "unbind",
    "_assert_tensor_metadata", "_assert_scalar", "sym_size", "lift_fresh_copy", "contiguous", "flatten",
    "unflatten", "view_as", "expand_as", "narrow", "movedim", "_to_copy_noop", "to", "type_as", "dropout",
})
# Normalisations and softmaxes: a handful of FLOPs per element (mean, variance, scale, shift).
NORM_OPS = frozenset({"layer_norm", "native_layer_norm", "batch_norm", "native_batch_norm", "group_norm",
                      "softmax", "_softmax", "log_softmax", "_log_softmax", "rms_norm", "instance_norm"})
# Losses reduce their input to a scalar: a log-softmax and a pick (cross-entropy) or a difference and a square
# per input element, not per output element.
LOSS_OPS = frozenset({"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d", "mse_loss", "l1_loss",
                      "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
                      "kl_div"})
# A grouped matmul multiplies each row by one matrix; an expert layer run where its experts live (expert_parallel,
# partitioner.ep.dispatch) is one op of its region, whose FLOPs are its grouped matmuls'.
_MATMULS = frozenset({"addmm", "mm", "bmm", "baddbmm", "matmul", "linear",
                      "_grouped_mm", "grouped_mm", "grouped_mm_fallback", "expert_parallel"})
_CONVS = frozenset({"conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d",
                    "conv_transpose2d", "conv_transpose3d"})
# The ops of a tensor-parallel rank's graph (partitioner.tp.collectives) cost what the ATen op they replace costs on
# this rank's shard; their collectives are priced on their own (partitioner.tp.pricing).
TP_EQUIVALENT = {"vocab_embedding": "embedding", "vocab_cross_entropy": "cross_entropy_loss", "tp_dropout": "dropout",
                 "tp_attention": "scaled_dot_product_attention"}


def tensor_bytes(v: Any) -> int:
    """Bytes of a tensor, or of the tensors in a (nested) list/tuple; 0 for anything else."""
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (list, tuple)):
        return sum(tensor_bytes(x) for x in v)
    return 0


def float_bytes(v: Any) -> int:
    """The part of :func:`tensor_bytes` held in floating-point tensors (what a lower training precision
    shrinks; token ids and masks keep their integer width)."""
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size() if v.is_floating_point() else 0
    if isinstance(v, (list, tuple)):
        return sum(float_bytes(x) for x in v)
    return 0


def op_name(node: torch.fx.Node) -> str:
    """The ATen op's short name (``addmm`` for ``aten.addmm.default``), or the callable's name."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(target, "__name__", str(target))


def _numel(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel()
    if isinstance(v, (list, tuple)):
        return sum(x.numel() for x in v if isinstance(x, torch.Tensor))
    return 0


def is_matmul_class(name: str) -> bool:
    """Whether the op of this short name (:func:`op_name`) runs on tensor cores where a device has them:
    matmuls, convolutions and attention."""
    return name in _MATMULS or name in _CONVS or _is_attention(name)


def _is_attention(name: str) -> bool:
    return name.startswith("scaled_dot_product") or "flash_attention" in name or "efficient_attention" in name


def op_flops_and_bytes(node: torch.fx.Node) -> tuple[float, int, int]:
    """Forward FLOPs, bytes moved and the floating-point part of those bytes, from the traced shapes (a free
    view: none)."""
    if REGION_COST in node.meta:
        return node.meta[REGION_COST]
    name = TP_EQUIVALENT.get(op_name(node), op_name(node))
    if name in VIEW_OPS:
        return 0.0, 0, 0
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
    out = node.meta.get("val")
    out_numel = _numel(out)
    moved = tensor_bytes(out) + sum(tensor_bytes(v) for v in vals)
    moved_float = float_bytes(out) + sum(float_bytes(v) for v in vals)
    t = [v for v in vals if isinstance(v, torch.Tensor)]
    if name in _MATMULS and len(t) >= 2:
        a = t[1] if name in ("addmm", "baddbmm") and len(t) >= 3 else t[0]
        k = a.shape[-1] if a.dim() else 1
        return 2.0 * out_numel * k, moved, moved_float
    if name in _CONVS and len(t) >= 2:
        w = t[1]
        if "transpose" in name:  # each input element scatters into Cout/groups * kernel outputs
            return 2.0 * t[0].numel() * w.shape[1] * math.prod(w.shape[2:]), moved, moved_float
        return 2.0 * out_numel * w.shape[1] * math.prod(w.shape[2:]), moved, moved_float
    if _is_attention(name):
        q, key = t[0], t[1]
        batch = q.numel() // (q.shape[-2] * q.shape[-1])
        scores = batch * q.shape[-2] * key.shape[-2]
        return 4.0 * scores * q.shape[-1] + 5.0 * scores, moved, moved_float
    if name == "embedding":  # reads the looked-up rows, writes them out
        return 0.0, 2 * tensor_bytes(out), 2 * float_bytes(out)
    if name in NORM_OPS:
        return 5.0 * out_numel, moved, moved_float
    if name in LOSS_OPS and t:
        return 5.0 * t[0].numel(), moved, moved_float
    return float(out_numel), moved, moved_float
