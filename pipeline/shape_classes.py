"""Variable input shapes with one plan: one stage set per *shape class*, kept in a bounded LRU cache.

A shape class is the tuple of (shape, dtype) of the tensor inputs of one microbatch. Stages are specialised to
the shapes they were traced with (sizes are constants in the exported graph), and so are the receive buffers of
the values that cross stages. So a :class:`pipeline.PipelineRunner` keeps, per shape class, a :class:`StageSet`:
the plan re-bound to a trace of that class (:func:`partitioner.cut.respecialise.respecialise`, the same stages by op
names), its stage modules (reading the user's own parameters, so training updates are shared by every class),
this rank's stages and an :class:`pipeline.executor.Executor` whose buffers and boundary flags come from that
trace. Every rank derives the same stage set from the same microbatch shapes, so ranks agree on what travels
without exchanging metadata, per class. A class not seen before is traced on the fly (:func:`retrace`: torch.export
on fake tensors, a fraction of a second for a small model); when more than ``size`` classes have run, the least
recently used one is dropped and, if it comes back, traced again.

Why not one trace with dynamic dimensions (``torch.export.Dim``)? It exports GPT-2 and Llama, but its graphs
compute sizes (``sym_size``) that would cross stages as integers, receive buffers would need sizes per step, and
the cost model prices concrete shapes; a re-trace per class keeps every stage static and exact.
"""
from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from partitioner import PartitionPlan
from partitioner.capture.program import TracedProgram, flatten_inputs
from partitioner.capture.stage_modules import SplitModel, Stage
from partitioner.capture.tracing import trace
from partitioner.cut.respecialise import respecialise
from partitioner.errors import EngineError
from pipeline.executor import Executor
from pipeline.param_gather import is_sharded

__all__ = ["ShapeKey", "StageSet", "ShapeCache", "ShapeChangeError", "shape_key", "describe", "check_retraceable",
           "retrace", "boundary_requires_grad", "DEFAULT_SHAPE_CACHE_SIZE"]

DEFAULT_SHAPE_CACHE_SIZE = 8
ShapeKey = tuple[tuple[tuple[int, ...], str], ...]  # per tensor input of one microbatch: (shape, dtype)


class ShapeChangeError(EngineError, ValueError):
    """A microbatch of a shape the runner cannot specialise its stages to; the message says why and the fix."""


def shape_key(program: TracedProgram, flat: list[Any]) -> ShapeKey:
    """The shape class of one microbatch's flat inputs (in ``program``'s placeholder order)."""
    return tuple((tuple(v.shape), str(v.dtype).removeprefix("torch."))
                 for v, meta in zip(flat, program.input_meta) if isinstance(meta, torch.Tensor)
                 and isinstance(v, torch.Tensor))


def describe(program: TracedProgram, key: ShapeKey) -> str:
    """``key`` in words: ``input_ids (4, 12) int64, labels (4, 12) int64``."""
    names = [n for n, m in zip(program.input_names, program.input_meta) if isinstance(m, torch.Tensor)]
    return ", ".join(f"{n} {shape} {dtype}" for n, (shape, dtype) in zip(names, key))


@dataclass
class StageSet:
    """The stages of one shape class on this rank (see the module docstring)."""

    key: ShapeKey
    plan: PartitionPlan          # the plan bound to this class's trace (its per-stage FLOPs)
    split_model: SplitModel
    local_stages: list[Stage]
    executor: Executor


class ShapeCache:
    """At most ``size`` stage sets, by shape class, least recently used dropped first. ``hits``, ``misses`` and
    ``evictions`` count lookups and drops."""

    def __init__(self, size: int = DEFAULT_SHAPE_CACHE_SIZE):
        """``size``: the most shape classes kept at once (a positive integer)."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"shape_cache_size must be a positive integer (the most input shape classes whose "
                             f"stages are kept), got {size!r}")
        self.size = size
        self.sets: OrderedDict[ShapeKey, StageSet] = OrderedDict()
        self.hits = self.misses = self.evictions = 0

    def get(self, key: ShapeKey) -> StageSet | None:
        """The stage set of ``key`` (now the most recently used), or None (a miss)."""
        found = self.sets.get(key)
        if found is None:
            self.misses += 1
            return None
        self.hits += 1
        self.sets.move_to_end(key)
        return found

    def put(self, stage_set: StageSet) -> StageSet:
        """Keep ``stage_set`` as the most recently used; drop the least recently used beyond ``size``."""
        self.sets[stage_set.key] = stage_set
        self.sets.move_to_end(stage_set.key)
        while len(self.sets) > self.size:
            self.sets.popitem(last=False)
            self.evictions += 1
        return stage_set


def check_retraceable(program: TracedProgram, key: ShapeKey, current: ShapeKey,
                      model: torch.nn.Module | None) -> torch.nn.Module:
    """``model``, to trace stages for the shape class ``key`` with; :class:`ShapeChangeError` when they cannot be
    traced (``current``: the shapes the stages have): without the model, or under tensor, expert, context or
    sharded data parallelism (its ranks hold shards, or its program the traced sequence length)."""
    why = ("the runner was made without the model (pass PipelineRunner(model=...), as "
           "smp.engine.planning.pipeline_runner does)" if model is None else
           f"tensor parallelism (degree {program.tp_comm.size}) holds shards, which cannot be traced again "
           "(variable shapes need tensor_parallel_degree 1)" if program.tp_comm is not None else
           f"expert parallelism (degree {program.ep_comm.size}) holds shards of the experts, which cannot be traced "
           "again (variable shapes need expert_parallel_degree 1)" if program.ep_comm is not None else
           f"context parallelism (degree {program.cp_comm.size}) was written for the traced sequence length, which "
           "is not traced again (variable shapes need context_parallel_degree 1)" if program.cp_comm is not None else
           "sharded data parallelism holds shards of the parameters, which cannot be traced again (variable shapes "
           "need sharded_data_parallel_degree 1)" if any(is_sharded(p) for p in model.parameters()) else None)
    if model is None or why is not None:
        raise ShapeChangeError(f"a microbatch of shapes {describe(program, key)} differs from the traced shapes "
                               f"{describe(program, current)}, and {why}: keep the shapes fixed (pad to one length; "
                               "drop or pad a short last batch) or partition again for these shapes")
    return model


@contextmanager
def _in_mode(model: torch.nn.Module, training: bool) -> Iterator[None]:
    """``model`` in train (or eval) mode for the block, its own mode restored after."""
    before = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for m, mode in before:
            m.training = mode


def retrace(plan: PartitionPlan, model: torch.nn.Module, args: tuple, kwargs: dict,
            autocast: tuple[str, torch.dtype] | None = None, loss: tuple[Any, Any] | None = None) -> PartitionPlan:
    """``plan`` re-bound to a trace of ``model`` on one microbatch ``(args, kwargs)`` of another shape class,
    traced as the plan's own trace was: in its train/eval mode, with grad
    mode on, under ``autocast``, with the loss priced when the plan's trace priced one (``loss``: ``(loss_fn, this
    microbatch's target)``). Raises :class:`partitioner.cut.respecialise.ShapeClassError` when the stages do not fit."""
    home = plan.traced_graph().fx
    priced = loss if home.loss is not None and loss is not None and loss[0] is not None else (None, None)
    with _in_mode(model, home.training), torch.enable_grad(), \
            torch.autocast(autocast[0], dtype=autocast[1]) if autocast else nullcontext():
        graph = trace(model, args, kwargs, loss_fn=priced[0], target=priced[1])
    return respecialise(plan, graph, describe(home, shape_key(home, flatten_inputs(home, args, kwargs))))


def boundary_requires_grad(sm: SplitModel, autocast: tuple[str, torch.dtype] | None = None) -> dict[str, bool]:
    """Which values crossing stages carry a gradient back: one run of the stages on fake tensors
    (no memory, no compute) so every rank agrees without exchanging metadata; under ``autocast``
    ((device type, dtype)) when the model was traced under it, as the values' dtypes then say."""
    flags: dict[str, bool] = {}
    with FakeTensorMode() as mode, torch.autocast(autocast[0], dtype=autocast[1]) if autocast else nullcontext():
        values = {n: mode.from_tensor(torch.empty(tuple(m.shape), dtype=m.dtype)) if isinstance(m, torch.Tensor) else m
                  for n, m in zip(sm.program.input_names, sm.program.input_meta)}
        for stage in sm.stages:
            # Fake copies of the weights (in-place updates such as BatchNorm statistics must not touch real ones),
            # all on the CPU: another rank's stages are on the meta device here, this rank's maybe on a GPU.
            state = {n: torch.empty(tuple(t.shape), dtype=t.dtype, requires_grad=t.requires_grad)
                     for n, t in list(stage.module.named_parameters(remove_duplicate=False))
                     + list(stage.module.named_buffers(remove_duplicate=False))}
            outs = torch.func.functional_call(stage.module, state, tuple(values[n] for n in stage.inputs),
                                              tie_weights=False, strict=False)
            values.update(zip(stage.outputs, outs))
            for n, t in zip(stage.outputs, outs):
                flags[n] = isinstance(t, torch.Tensor) and t.requires_grad
    return flags

