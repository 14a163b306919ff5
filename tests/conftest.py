"""Shared helpers for the test suite: stage arrays of a plan, and one exact training step to compare with.

The helpers are plain functions (import them with ``from tests.conftest import ...``) so that test modules,
hypothesis tests included, can call them without fixtures.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.utils._pytree as pytree

# Exactness tolerances (fp32). Staged execution runs the same ATen ops in the same order, so in practice the
# results are bit-identical; these are ten times tighter than DESIGN.md's "fair start".
OUT_TOL = dict(rtol=1e-6, atol=1e-7)
GRAD_TOL = dict(rtol=1e-5, atol=1e-7)


def stage_array(plan, graph) -> np.ndarray:
    """The plan's assignment as one stage per graph node, in node order."""
    return np.array([plan.assignment[name] for name in graph.names], np.int64)


def assert_complete_and_acyclic(plan, graph) -> np.ndarray:
    """Every op on exactly one stage in range, and every edge goes from a stage to the same or a later one."""
    assert set(plan.assignment) == set(graph.names), "plan must assign every op, and only the graph's ops"
    assert len(plan.assignment) == graph.num_nodes
    stage = stage_array(plan, graph)
    assert stage.min() >= 0 and stage.max() < plan.num_stages, (stage.min(), stage.max(), plan.num_stages)
    if graph.num_edges:
        back = stage[graph.src] > stage[graph.dst]
        assert not back.any(), [(graph.names[graph.src[e]], graph.names[graph.dst[e]]) for e in np.flatnonzero(back)]
    return stage


def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


@dataclass
class StepResult:
    outputs: list[torch.Tensor]
    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]


def snapshot_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def restore_buffers(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(saved[name])


def train_step(model: torch.nn.Module, forward: Callable, args: tuple, kwargs: dict,
               loss_fn: Callable, target: torch.Tensor) -> StepResult:
    """One forward + backward through ``forward`` (the model itself or a staged copy that shares its
    parameters); gradients and buffers are read back from ``model``."""
    model.zero_grad(set_to_none=True)
    out = forward(*args, **kwargs)
    loss = loss_fn(out, target)
    loss.backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    result = StepResult([t.detach().clone() for t in tensor_leaves(out)], loss.detach().clone(), grads,
                        snapshot_buffers(model))
    model.zero_grad(set_to_none=True)
    return result


def assert_same_step(got: StepResult, want: StepResult) -> None:
    assert len(got.outputs) == len(want.outputs)
    for a, b in zip(got.outputs, want.outputs):
        torch.testing.assert_close(a, b, **OUT_TOL)
    torch.testing.assert_close(got.loss, want.loss, **OUT_TOL)
    assert got.grads.keys() == want.grads.keys()
    for name, g in want.grads.items():
        if g is None:
            assert got.grads[name] is None, f"{name}: staged run made a gradient the model does not have"
        else:
            assert got.grads[name] is not None, f"{name}: no gradient from the staged run"
            torch.testing.assert_close(got.grads[name], g, **GRAD_TOL, msg=lambda m, name=name: f"grad of {name}: {m}")
    for name, b in want.buffers.items():
        if b.is_floating_point():
            torch.testing.assert_close(got.buffers[name], b, **OUT_TOL, msg=lambda m, name=name: f"buffer {name}: {m}")
        else:
            assert torch.equal(got.buffers[name], b), f"buffer {name}: {got.buffers[name]} != {b}"


def pipeline_step(model: torch.nn.Module, split_model, args: tuple, kwargs: dict, loss_fn: Callable,
                  target: torch.Tensor) -> StepResult:
    """:func:`train_step` through :func:`run_stages_as_pipeline`."""
    model.zero_grad(set_to_none=True)
    out, loss = run_stages_as_pipeline(split_model, args, kwargs, loss_fn, target)
    grads = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    result = StepResult([t.detach().clone() for t in tensor_leaves(out)], loss.detach().clone(), grads,
                        snapshot_buffers(model))
    model.zero_grad(set_to_none=True)
    return result


def run_stages_as_pipeline(split_model, args: tuple, kwargs: dict, loss_fn: Callable, target: torch.Tensor):
    """Run the stages the way a pipeline runtime does (:func:`partitioner.cost.timing.run_stages`): every float
    tensor a stage receives from another stage is a fresh autograd leaf, and each stage runs its own backward
    with the gradients its consumers left on those leaves. Returns the model output object and the loss."""
    from partitioner.cost.timing import run_stages

    losses = []

    def seeds(output):
        losses.append(loss_fn(output, target))
        return [losses[0]], [None]

    output, _, _ = run_stages(split_model, args, kwargs, seeds)
    return output, losses[0]
