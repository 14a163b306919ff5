"""Training precision: the bytes of activations, weights, gradients and optimizer state in each dtype.

``fp32`` and ``tf32`` train in fp32 (tf32 only changes the matmul rate). ``bf16`` and ``fp16`` are mixed
precision as accounted in ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory optimizations toward training
trillion parameter models", SC'20, section 3.1): 16-bit weights, activations and gradients, plus an fp32
master copy of the weights and fp32 optimizer state -- for Adam 2 + 2 + 4 + 4 + 4 = 16 bytes per
parameter. Only floating-point tensors shrink: token ids, masks and other integer tensors keep their width,
which is why the op graph records the floating-point part of every byte count at trace time
(:class:`partitioner.capture.graph.OpGraph`). Byte counts are as traced; the model is assumed traced in fp32
(torch's default dtype, and that of Hugging Face models built from a config).
"""
from __future__ import annotations

import numpy as np

from ..capture.graph import OpGraph
from .devices import PRECISIONS

__all__ = ["PRECISIONS", "OPTIMIZER_STATE_FACTOR", "at_precision", "weight_bytes", "activation_bytes",
           "value_bytes", "param_memory_parts", "param_memory"]

# Optimizer state per fp32 parameter byte (Adam keeps two moments; SGD with momentum one).
OPTIMIZER_STATE_FACTOR = {"adam": 2.0, "adamw": 2.0, "sgd": 1.0, "none": 0.0}
_SHRINK = {"fp32": 1.0, "tf32": 1.0, "bf16": 0.5, "fp16": 0.5}  # bytes per fp32 byte


def at_precision(total: np.ndarray, floating: np.ndarray | None, dtype: str) -> np.ndarray:
    """Bytes held at ``dtype``, from bytes as traced (``total``) and their floating-point part
    (``floating``; None: all of it, as in synthetic graphs)."""
    total = np.asarray(total, np.float64)
    if _SHRINK[dtype] == 1.0:
        return total
    floating = total if floating is None else np.asarray(floating, np.float64)
    return total - (1.0 - _SHRINK[dtype]) * floating


def weight_bytes(graph: OpGraph, dtype: str) -> np.ndarray:
    """Per parameter, the bytes of the weights the forward reads (16-bit copies under mixed precision)."""
    return at_precision(graph.param_bytes, graph.param_float_bytes, dtype)


def activation_bytes(graph: OpGraph, dtype: str) -> np.ndarray:
    """Per op, the bytes it keeps alive for backward, at ``dtype``."""
    return at_precision(graph.act_bytes, graph.act_float_bytes, dtype)


def value_bytes(graph: OpGraph, dtype: str) -> np.ndarray:
    """Per value, its bytes at ``dtype`` (what crosses a stage boundary)."""
    return at_precision(graph.value_bytes, graph.value_float_bytes, dtype)


def param_memory_parts(graph: OpGraph, dtype: str, optimizer: str) -> dict[str, np.ndarray]:
    """Per parameter, what it holds in training, by kind: ``weights`` (16-bit copies under mixed
    precision), and for a trainable one ``gradients`` (as wide as the weights), ``optimizer`` state (per fp32
    byte, :data:`OPTIMIZER_STATE_FACTOR`) and, under mixed precision, ``master`` fp32 weights (none without
    an optimizer)."""
    weights = weight_bytes(graph, dtype)
    fp32 = graph.param_bytes.astype(np.float64)
    trained = np.asarray(graph.param_trainable, bool)
    state = OPTIMIZER_STATE_FACTOR[optimizer]
    master = fp32 if _SHRINK[dtype] < 1.0 and state > 0 else np.zeros_like(fp32)
    return {"weights": weights, "gradients": np.where(trained, weights, 0.0),
            "optimizer": np.where(trained, state * fp32, 0.0), "master": np.where(trained, master, 0.0)}


def param_memory(graph: OpGraph, dtype: str, optimizer: str) -> np.ndarray:
    """Per parameter, the bytes it holds in training: the sum of :func:`param_memory_parts`."""
    parts = param_memory_parts(graph, dtype, optimizer)
    return np.sum(list(parts.values()), axis=0)
