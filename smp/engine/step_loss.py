"""The loss an ``@smp.step`` function computes from the model's outputs, as the plan prices it.

SMP v1 scripts compute the loss in the step function (``loss = criterion(model(x), y); model.backward(loss)``), on the
rank of the last stage, after the model's forward; it is work of the last stage the traced model does not show. A
cross-entropy over a 50,257-token vocabulary costs as much as a third of GPT-2's LM head, so a plan that leaves it out
gives the last stage too much of the model. The user's code cannot be traced before the first step runs it (it runs
once, in the microbatch's thread, and may have side effects), so the plan prices the loss those scripts compute: a
cross-entropy over the model's logits, its largest floating-point output of two or more dimensions
(:func:`step_loss`). A model that computes its loss itself (a Hugging Face model given ``labels``, which returns a
scalar) has it in its graph already, and nothing is added.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from partitioner import OpGraph

__all__ = ["step_loss"]


def step_loss(graph: OpGraph) -> tuple[Callable[[Any, Any], torch.Tensor], torch.Tensor] | None:
    """``(loss_fn, target)`` for :func:`partitioner.capture.tracing.price_loss`: a cross-entropy over the largest
    floating-point output of ``graph``'s model with two or more dimensions, against a target of class indices; None
    when the model returns a scalar loss itself, or has no such output."""
    prog = graph.fx
    if prog is None or prog.loss is not None:
        return None
    out = next(n for n in prog.module.graph.nodes if n.op == "output")
    leaves = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in pytree.tree_leaves(out.args[0])]
    floats = [(i, t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats or any(t.dim() == 0 for _, t in floats):  # no logits, or the model's own loss
        return None
    at, logits = max(((i, t) for i, t in floats if t.dim() >= 2), key=lambda it: it[1].numel(), default=(-1, None))
    if logits is None:
        return None

    def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
        scores = pytree.tree_leaves(output)[at]
        return F.cross_entropy(scores.flatten(0, -2).float(), target.flatten())

    return loss_fn, torch.zeros(tuple(logits.shape[:-1]), dtype=torch.long)
