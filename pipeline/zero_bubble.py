"""The split backward of zero-bubble schedules: input gradients now (B), weight gradients later (W).

ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv:2401.10241) splits each backward in two
with torch's own helpers (``torch.distributed.pipelining._backward``): ``B`` computes only the gradients
of the stage's boundary inputs (``stage_backward_input``, which also records the gradients reaching the
parameters' subgraphs) so they can be sent upstream at once; ``W`` later turns those into parameter
gradients (``stage_backward_weight``). B keeps the graph for W (``retain_graph``), so W is what frees a
microbatch's activations. Every parameter still gets its exact gradient:

* a stage with no boundary input that carries a gradient (the first stage) has nothing to send upstream,
  so its ``B`` only stores the output gradients and ``W`` runs the whole backward, as torch's stage does;
* the split sees a parameter's gradient only where it meets the inputs' part of the graph, so any other
  stage with an output that does not depend on its inputs runs the fused backward in ``B`` and has nothing
  left for ``W``; so does any other checkpointed stage, whose ``W`` would recompute the forward once per
  parameter group (``stage_backward_weight`` runs one autograd pass per group).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed.pipelining._backward import (
    _get_grad_fn_or_grad_acc,
    construct_reverse_graph,
    reverse_closure,
    stage_backward_input,
    stage_backward_weight,
)

__all__ = ["SplitBackward", "backward_input"]


@dataclass
class SplitBackward:
    """What B did: the boundary inputs' gradients, and what W still has to do (None: B did everything).
    ``keeps_outputs``: W still backpropagates from the stage outputs, which must stay held until then."""

    input_grads: dict[str, torch.Tensor | None]
    weight_pass: Callable[[], None] | None
    keeps_outputs: bool = False


def backward_input(tensors: list[torch.Tensor], grads: list[torch.Tensor | None], inputs: dict[str, torch.Tensor],
                   params: list[torch.nn.Parameter], checkpointed: bool) -> SplitBackward:
    """B of a split backward from the stage outputs ``tensors`` (with output gradients ``grads``) to its
    boundary ``inputs`` (autograd leaves, by value name); see the module docstring for the three cases."""
    leaves = list(inputs.values())
    if tensors and not leaves:
        return SplitBackward({}, lambda: torch.autograd.backward(tensors, grads), keeps_outputs=True)
    if not tensors or checkpointed or not _inputs_reach_all(tensors, leaves):
        if tensors:
            torch.autograd.backward(tensors, grads)
        return SplitBackward({n: t.grad for n, t in inputs.items()}, None)
    # stage_backward_input detaches its roots in place to free the output side, but an output may be a
    # view, which refuses (pytorch#142229), or saved by a node W still needs (a residual stream that the
    # stage also reads), which would break W: hand it throwaway copies, roots of the same graph.
    roots = [t.clone() for t in tensors]
    # torch annotates output_grads as list[Tensor], but passes each entry on to autograd.grad, where None
    # (a scalar loss's implicit 1) is valid: the executor gives a loss root None.
    dinputs, groups = stage_backward_input(roots, grads, leaves, iter(params))  # type: ignore[arg-type]
    return SplitBackward(dict(zip(inputs, dinputs)), lambda: _weight_grads(params, groups))


def _inputs_reach_all(roots: list[torch.Tensor], inputs: list[torch.Tensor]) -> bool:
    """Does every root depend on some input? Then each path from a parameter to a root meets the inputs'
    part of the graph, where ``stage_backward_input`` records the gradient, so W's parameter gradients are
    complete; a root that depends on parameters alone would have its contribution lost."""
    root_nodes = [n for n in map(_get_grad_fn_or_grad_acc, roots) if n is not None]
    if len(root_nodes) < len(roots):  # a root outside autograd depends on no input
        return False
    input_nodes = [n for n in map(_get_grad_fn_or_grad_acc, inputs) if n is not None]  # None: reaches nothing
    reached, _ = reverse_closure(input_nodes, set(), construct_reverse_graph(root_nodes))
    return all(n in reached for n in root_nodes)


def _weight_grads(params: list[torch.nn.Parameter], groups: list[dict[str, Any]]) -> None:
    """W of a split backward: accumulate the parameter gradients into ``.grad``."""
    fresh = [p for p in params if p.grad is None]
    stage_backward_weight(iter(params), groups)
    # A first gradient is stored as autograd returned it, which may be the very tensor it also gave another
    # parameter or the input gradient (x + b): own it before the next microbatch adds to it in place.
    for p in fresh:
        if p.grad is not None:
            p.grad = p.grad.clone()
