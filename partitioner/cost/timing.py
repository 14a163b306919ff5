"""Timing real execution: every op of a traced graph (:func:`measure`) or every stage of a plan
(:func:`measure_stages`), forward and backward, in this process.

Measured times replace the cost model's estimates where the roofline misjudges ops (Python-heavy blocks,
sorts and scatters, kernels far from peak). With one intra-op thread on CPU the clock is this thread's CPU
time (robust on a shared machine, see :func:`partitioner.cost.calibration.cost_clock`); otherwise wall time.
The model's random ops (dropout) draw from torch's global generators while they are timed, so both
measurements run on forked generators (:func:`_keeps_random_streams`): the engine never consumes the
caller's random streams.
"""
from __future__ import annotations

import functools
import operator
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.fx
import torch.utils._pytree as pytree

from ..capture.graph import OpGraph
from ..capture.mutation import written_inputs
from ..capture.program import flatten_inputs
from ..capture.stage_modules import MODEL_INPUT, SplitModel, check_runnable
from .calibration import calibrate, cost_clock
from .devices import DeviceRates
from .roofline import NodeCosts, estimate, view_ops

__all__ = ["measure", "measure_stages", "run_stages", "StageTimes", "untimeable", "UntimeableGraphError"]


def _keeps_random_streams(fn: Callable) -> Callable:
    """Run ``fn`` under ``torch.random.fork_rng``: the CPU generator's and the current GPU's state are
    restored after it."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        gpus = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=gpus):
            return fn(*args, **kwargs)
    return wrapper


class UntimeableGraphError(ValueError):
    """A traced graph whose ops cannot run one at a time outside their context (see :func:`untimeable`)."""


# functorch's vmap enters and leaves a transform level around the ops it batches (transformers builds attention masks
# with it): run one at a time, an entered level stays entered, and every later op, sends included, runs under it.
_TRANSFORM_OPS = ("_vmap_increment_nesting", "_vmap_decrement_nesting", "_add_batch_dim", "_remove_batch_dim")


def untimeable(graph: OpGraph) -> str:
    """Why ``graph``'s ops cannot be timed one by one (:func:`measure`), or "" when they can."""
    found = sorted({k for k in graph.kinds if k.rpartition(".")[2] in _TRANSFORM_OPS})
    return f"the graph holds functorch transform ops ({', '.join(found)})" if found else ""


@_keeps_random_streams
def measure(graph: OpGraph, args: tuple, kwargs: dict | None = None, *, repeats: int = 3,
            rates: DeviceRates | None = None) -> NodeCosts:
    """Time every op's forward *and* backward for real (median of ``repeats``, after one warm-up pass).

    The traced graph runs node by node; each op reads its inputs as fresh autograd leaves, and right after
    its forward its own backward runs on random output gradients, so backward costs are per op -- a conv
    net's late layers, which hold most of the weights, pay for their weight gradients, where one
    backward/forward ratio for the whole model would spread that cost evenly. Each op's weight gradients
    are added into those the warm-up pass left, as a step's every microbatch after the first adds into the kept
    gradient: a fresh gradient, freed and reallocated op after op, would reuse warm memory and time neither that
    read-add-write nor the first microbatch's page faults (a 4-layer MLP stage's backward was timed at 6.4 ms and
    runs in 10 ms). The fixed cost of one ``autograd.backward`` call, which a stage pays once and not per op, is
    measured on a trivial op and subtracted. With one intra-op thread on CPU the clock is this thread's CPU time
    (robust on a shared machine, see :func:`partitioner.cost.calibration.cost_clock`); otherwise wall time. The model's
    buffers (BatchNorm statistics) and gradients are restored.
    """
    if graph.fx is None:
        raise ValueError("measure() needs a traced graph (partitioner.trace), not a synthetic one")
    why = untimeable(graph)
    if why:
        raise UntimeableGraphError(f"the ops cannot be timed one by one: {why}; price them with the cost model "
                                   "(measure=False, smp's trace_execution_times=False, the CLI's --estimate)")
    check_runnable(graph.fx.module, "time the ops (measure=True)", (args, kwargs))
    rates = rates or calibrate()
    fx = graph.fx
    gm = fx.module
    flat = flatten_inputs(fx, args, kwargs)
    clock = cost_clock(next(iter(gm.parameters()), torch.empty(0)).device)
    params = {id(p): p for p in gm.parameters()}
    saved_grads = {k: p.grad for k, p in params.items()}
    for q in params.values():  # or the first backward would accumulate into the caller's gradients
        q.grad = None
    saved_buffers = [(b, b.detach().clone()) for b in gm.buffers()]
    gen = torch.Generator().manual_seed(0)
    fwd_samples: dict[str, list[float]] = {}
    bwd_samples: dict[str, list[float]] = {}
    call_overhead = _backward_call_overhead(clock, repeats) - rates.op_overhead_s

    def leaf(env: dict[str, Any], written: set[str], n: torch.fx.Node) -> Any:
        v = env[n.name]
        if isinstance(v, torch.Tensor) and v.requires_grad and id(v) not in params:
            v = v.detach().requires_grad_(True)
            return v.clone() if n.name in written else v  # an in-place op may not write to a leaf
        return v

    try:
        for rep in range(repeats + 1):  # the first pass warms up and is not counted
            env: dict[str, Any] = {}
            placeholders = iter(flat)
            for node in gm.graph.nodes:
                if node.op == "placeholder":
                    env[node.name] = next(placeholders)
                elif node.op == "get_attr":
                    env[node.name] = _fetch(gm, node.target)
                elif node.op == "call_function":
                    if node.target is operator.getitem:  # part of its producer, timed there
                        env[node.name] = node.target(*torch.fx.node.map_arg(node.args, functools.partial(_value, env)))
                        continue
                    written = {n.name for n in written_inputs(node)}
                    a, k = torch.fx.node.map_arg((node.args, node.kwargs), functools.partial(leaf, env, written))
                    t0 = clock()
                    out = node.target(*a, **k)
                    t1 = clock()
                    env[node.name] = out
                    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
                    if outs:
                        grads = [torch.randn(o.shape, generator=gen).to(o.dtype).to(o.device) for o in outs]
                        t2 = clock()
                        torch.autograd.backward(outs, grads)
                        t3 = clock()
                    if rep:
                        fwd_samples.setdefault(node.name, []).append(t1 - t0)
                        if outs:
                            bwd_samples.setdefault(node.name, []).append(max(t3 - t2 - call_overhead, 0.0))
                elif node.op == "output" and fx.loss is not None:  # the loss the last stage computes
                    f, b = _time_loss(fx, [leaf(env, set(), n) if isinstance(n, torch.fx.Node) else n
                                           for n in pytree.tree_leaves(node.args[0])], clock)
                    if rep:
                        fwd_samples.setdefault(node.name, []).append(f)
                        bwd_samples.setdefault(node.name, []).append(max(b - call_overhead, 0.0))
    finally:
        with torch.no_grad():
            for b, value in saved_buffers:
                b.copy_(value)
        for k, q in params.items():
            q.grad = saved_grads[k]
    fwd = np.zeros(graph.num_nodes)
    bwd = np.zeros(graph.num_nodes)
    for name, ts in fwd_samples.items():
        fwd[fx.op_of[name]] += statistics.median(ts)
    for name, ts in bwd_samples.items():
        bwd[fx.op_of[name]] += statistics.median(ts)
    est = estimate(graph, rates)
    # A view's backward, timed alone, builds a zero tensor of its base's size; in a stage, the views of one
    # weight share one (partitioner.capture.chunk.merge_weight_slices), so the estimate (its share) stands in.
    bwd = np.where(view_ops(graph), est.backward_s, bwd)
    if fx.loss is None:  # a loss priced from outside the trace (price_loss: @smp.step's) is not here to time
        outputs = np.asarray(graph.kinds) == "output"
        fwd, bwd = np.where(outputs, est.forward_s, fwd), np.where(outputs, est.backward_s, bwd)
    return NodeCosts(forward_s=fwd, backward_s=np.where(est.needs_grad, bwd, 0.0), needs_grad=est.needs_grad,
                     measured=True)


def _time_loss(fx: Any, outputs: list[Any], clock: Callable[[], float]) -> tuple[float, float]:
    """Seconds of the traced loss's forward and backward on the model's outputs (fresh leaves)."""
    loss_fn, target = fx.loss
    t0 = clock()
    loss = loss_fn(pytree.tree_unflatten(outputs, fx.out_spec), target)
    t1 = clock()
    loss.backward()
    return t1 - t0, clock() - t1


def _backward_call_overhead(clock, repeats: int) -> float:
    """Seconds of one ``autograd.backward`` call on a trivial op (what timing ops one by one adds)."""
    x = torch.ones(8, requires_grad=True)
    g = torch.ones(8)
    times = []
    for _ in range(10 * (repeats + 1)):
        y = x * 1.0
        t0 = clock()
        torch.autograd.backward([y], [g])
        times.append(clock() - t0)
    return statistics.median(times)


def _fetch(module: torch.nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _value(env: dict[str, Any], node: torch.fx.Node) -> Any:
    return env[node.name]


@dataclass
class StageTimes:
    """Seconds per stage of a plan run for real: medians of forward and backward, and the fastest repeat
    of forward + backward (other load only ever adds time)."""

    forward_s: list[float]
    backward_s: list[float]
    best_s: list[float]

    @property
    def total_s(self) -> list[float]:
        """Median forward + median backward per stage."""
        return [f + b for f, b in zip(self.forward_s, self.backward_s)]


Seeds = Callable[[Any], "tuple[list[torch.Tensor], list[torch.Tensor | None]]"]


def run_stages(sm: SplitModel, args: tuple, kwargs: dict | None, seeds: Seeds | None = None,
               clock: Callable[[], float] = time.perf_counter) -> tuple[Any, list[float], list[float]]:
    """Run every stage in order the way a pipeline does, in this process; return the model's output object
    and each stage's forward and backward seconds.

    Every float tensor a stage receives from another stage is a fresh autograd leaf, so each stage's
    backward is its own autograd pass: from the last stage to the first, a stage backpropagates the
    gradients its consumers left on their leaves. The last stage starts from ``seeds(output)`` (tensors and
    their gradients, e.g. ``([loss], [None])``), whose time counts as the last stage's forward (a loss is
    computed there); without ``seeds`` only the forward runs.
    """
    flat = flatten_inputs(sm.program, args, kwargs)
    values: dict[str, Any] = dict(zip(sm.program.input_names, flat))
    leaves: list[dict[str, torch.Tensor]] = []
    outs_of: list[tuple] = []
    fwd, bwd = [0.0] * len(sm.stages), [0.0] * len(sm.stages)
    for st in sm.stages:
        ins, mine = [], {}
        for name in st.inputs:
            v = values[name]
            if st.sources[name] != MODEL_INPUT and isinstance(v, torch.Tensor) and v.requires_grad:
                v = v.detach().requires_grad_(True)
                mine[name] = v
            ins.append(v)
        t0 = clock()
        outs = tuple(st.module(*ins))
        fwd[st.index] = clock() - t0
        values.update(zip(st.outputs, outs))
        leaves.append(mine)
        outs_of.append(outs)
    output = pytree.tree_unflatten(list(outs_of[-1]), sm.program.out_spec)
    if seeds is None:
        return output, fwd, bwd
    for st in reversed(sm.stages):
        if st.index == len(sm.stages) - 1:
            t0 = clock()
            tensors, grads = seeds(output)
            fwd[st.index] += clock() - t0
        else:
            tensors, grads = [], []
            for name, o in zip(st.outputs, outs_of[st.index]):
                received = [leaves[c][name].grad for c in st.consumers.get(name, []) if name in leaves[c]]
                parts = [g for g in received if g is not None]
                if isinstance(o, torch.Tensor) and o.requires_grad and parts:
                    tensors.append(o)
                    grads.append(sum(parts[1:], parts[0]))
        t0 = clock()
        if tensors:
            torch.autograd.backward(tensors, grads)
        bwd[st.index] = clock() - t0
    return output, fwd, bwd


@_keeps_random_streams
def measure_stages(sm: SplitModel, args: tuple, kwargs: dict | None = None, *, repeats: int = 3,
                   progress: Callable[[str], None] = lambda message: None) -> StageTimes:
    """Time every stage's forward and backward (:func:`run_stages`), ``repeats`` times after one warm-up run.
    The last stage computes the loss traced with the model (``partitioner.trace(loss_fn=...)``), its time
    counted in that stage's; without one it backpropagates a fixed random gradient standing in for the
    loss. Gradients are added into those of the run before, as a step's microbatches after the first add
    into the kept ones (:func:`measure`); the parameters' gradients are left as they were."""
    check_runnable(sm.program.module, "time the stages", (args, kwargs))
    params = list(dict.fromkeys(p for st in sm.stages for p in st.module.parameters()))
    saved = [p.grad for p in params]
    gen = torch.Generator().manual_seed(0)
    grads: list[torch.Tensor] = []

    def seeds(output: Any) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        if sm.program.loss is not None:
            loss_fn, target = sm.program.loss
            return [loss_fn(output, target)], [None]
        outs = [o for o in pytree.tree_leaves(output) if isinstance(o, torch.Tensor) and o.requires_grad]
        if not grads:
            grads.extend(torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs)
        return outs, list(grads)

    clock = cost_clock(next(iter(params), torch.empty(0)).device)
    fwd: list[list[float]] = [[] for _ in sm.stages]
    bwd: list[list[float]] = [[] for _ in sm.stages]
    for p in params:
        p.grad = None
    try:
        for rep in range(repeats + 1):  # the first run warms up (and leaves the gradients later runs add into)
            progress(f"measuring every stage's forward and backward, run {rep + 1} of {repeats + 1}")
            _, f, b = run_stages(sm, args, kwargs, seeds, clock)
            if rep:
                for s in range(len(sm.stages)):
                    fwd[s].append(f[s])
                    bwd[s].append(b[s])
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    return StageTimes([statistics.median(t) for t in fwd], [statistics.median(t) for t in bwd],
                      [min(a + b for a, b in zip(tf, tb)) for tf, tb in zip(fwd, bwd)])
