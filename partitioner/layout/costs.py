"""Per-op costs of one model at every microbatch size and tensor-parallel degree a layout search asks for.

Tracing is what costs time (seconds to a minute for a 70B-parameter shape, on meta), so the model is traced at most
twice, however many microbatch sizes are searched. The work of every op of a model whose ops treat the samples of a
batch alike (transformers, convolutional nets: anything without batch-size-dependent control flow) is *affine* in
the microbatch size ``b``: FLOPs, bytes moved, bytes kept for backward and bytes of every value are ``x0 + b x1``
(activations scale with ``b``; weights read and ops on the weights alone do not). So the model is traced (on fake
tensors, :func:`partitioner.trace`) at two sizes ``b1 < b2`` whose graphs have the same ops, and the graph at any
size is the line through them, array by array (:class:`BatchLine`): exact for those affine counts, and checked —
two traces whose ops differ are not interpolated, and every size is then traced on its own. The sizes traced are
the example inputs' own ``b0`` and ``2 b0`` (``2`` and ``4`` for ``b0 = 1``: torch elides a copy or two at batch 1,
so batch 1 is priced with the ops of larger batches, a copy more). A size that was traced is priced from its own
trace, exactly as ``smp inspect`` prices it.

Seconds follow: the roofline of :func:`partitioner.cost.roofline.estimate` on the graph at that size, plus the
tensor-parallel
collectives (:mod:`partitioner.tp.pricing`), whose seconds are affine in their bytes and so interpolated the same way.
Each tp degree is a graph of tp rank 0 (:func:`partitioner.tp.shard_program.shard_graph`), sharded from each trace as
the runtime runs it by default: with sequence parallelism where it applies (the config's ``sequence_parallel`` None,
:mod:`partitioner.tp.sequence`: the activations between tp regions on 1/tp of the sequence, each all-reduce a
reduce-scatter and an all-gather); ``sequence_parallel=False`` prices tp without it. Each expert-parallel degree is
ep rank 0's graph of that (:func:`partitioner.ep.expert_program.expert_parallel_graph`, as the runtime writes it over
the tp rank's), built the first time a layout asks for it; its all-to-alls are priced on the link within a node, and on
the inter-node link for the ep groups that span nodes (``across``). Each context-parallel degree likewise is cp rank
0's graph (:func:`partitioner.cp.context_program.context_parallel_graph`) of tp rank 0's without sequence
parallelism, which the runtime turns off under it, its gathers priced as the all-to-alls are.

``timed`` (planning for this machine's CPU, the model with its weights): the two traces run on real inputs (the
example's rows repeated to the size) and every op is timed (:func:`partitioner.cost.op_times.timed_costs`, as ``smp
inspect`` on ``cpu``), the upper size at least the largest searched; an op's seconds at other sizes are the line
through its two timings (an op costs a fixed dispatch plus work per sample). A tp degree above 1 cannot run in one
process, so its roofline is scaled by the whole model's timed / estimated seconds at that size, forward and backward
apart.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.fx
import torch.utils._pytree as pytree

from ..capture.graph import OpGraph
from ..capture.tracing import trace
from ..cost.devices import DeviceRates
from ..cost.op_times import timed_costs
from ..cost.roofline import NodeCosts, estimate, needs_grad
from ..cost.throughput import batch_counts
from ..cp.context_program import context_parallel_graph
from ..cp.pricing import context_seconds
from ..ep.expert_program import expert_parallel_graph
from ..ep.experts import find_experts
from ..ep.pricing import all_to_all_seconds
from ..tp.rank_zero import thin_params
from ..tp.sequence import SequenceParallelWarning
from ..tp.shard_program import shard_graph
from ..tp.sharding import find_sharding
from ..tp.token_walk import sequence_ids

__all__ = ["BatchLine", "LayoutCosts", "layout_costs", "example_batch", "with_batch", "tiled", "trace_sizes",
           "head_counts", "collector_paused"]

_PER_OP = ("flops", "out_bytes", "act_bytes", "move_bytes", "act_float_bytes", "move_float_bytes")
_PER_VALUE = ("value_bytes", "value_float_bytes")


def example_batch(args: tuple, kwargs: dict) -> int:
    """The example inputs' batch size: the leading dimension of the first tensor input with a dimension (as
    :func:`partitioner.cost.throughput.batch_counts` counts samples)."""
    for leaf in pytree.tree_leaves((tuple(args), dict(kwargs))):
        if isinstance(leaf, torch.Tensor) and leaf.dim():
            return int(leaf.shape[0])
    raise ValueError("the example inputs have no tensor with a batch dimension to rescale; give the model at least "
                     "one tensor input whose first dimension is the batch")


def with_batch(args: tuple, kwargs: dict, batch: int, size: int) -> tuple[tuple, dict]:
    """The example inputs with every tensor whose first dimension is ``batch`` given ``size`` rows instead (on
    the meta device: tracing needs shapes and dtypes only); other values are kept."""
    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != batch:
            return t
        return torch.empty((size, *t.shape[1:]), dtype=t.dtype, device="meta")

    out_args, out_kwargs = pytree.tree_map_only(torch.Tensor, resize, (tuple(args), dict(kwargs)))
    return tuple(out_args), dict(out_kwargs)


def tiled(args: tuple, kwargs: dict, batch: int, size: int) -> tuple[tuple, dict]:
    """The example inputs with every tensor whose first dimension is ``batch`` given ``size`` rows of its own, the
    example's rows repeated in order (real values: token ids stay in the vocabulary); other values are kept."""
    rows = torch.arange(size) % batch

    def tile(t: torch.Tensor) -> torch.Tensor:
        return t if t.dim() == 0 or t.shape[0] != batch else t[rows.to(t.device)]

    return pytree.tree_map_only(torch.Tensor, tile, (tuple(args), dict(kwargs)))


def trace_sizes(batch: int, sizes: Iterable[int], timed: bool = False) -> tuple[int, ...]:
    """The microbatch sizes to trace for ``sizes`` when the example inputs have ``batch`` samples: the one size
    needed, or two to draw the line through (``batch`` and ``2 batch``; 2 and 4 for a batch of 1). ``timed``: the
    upper one is at least the largest of ``sizes``, because timings are not exact as traced counts are: a line
    drawn beyond its two points multiplies their difference, and with it a shared machine's drift between them (a
    GPT-2 microbatch of 16 was priced at half its time from timings at 4 and 8)."""
    wanted = sorted(set(sizes))
    if len(wanted) == 1:
        return (wanted[0],)
    lo, hi = (batch, 2 * batch) if batch > 1 else (2, 4)
    return (lo, max(hi, wanted[-1])) if timed else (lo, hi)


def head_counts(model: torch.nn.Module) -> tuple[int, ...]:
    """The attention head counts a tensor-parallel degree must divide, read from a Hugging Face style ``config``
    (``num_attention_heads``, ``num_key_value_heads``, ``n_head``); empty when the model has none."""
    config = getattr(model, "config", None)
    names = ("num_attention_heads", "num_key_value_heads", "n_head")
    return tuple(sorted({int(v) for v in (getattr(config, n, None) for n in names) if isinstance(v, int) and v > 0}))


@dataclasses.dataclass
class BatchLine:
    """One graph at the microbatch sizes it was traced at (``traced``), and, when two of them have the same ops,
    the pair ``line`` to interpolate every other size from."""

    traced: dict[int, OpGraph]
    line: tuple[int, int] | None = None
    timed: dict[int, NodeCosts] | None = None  # per traced size, the ops timed on this machine
    # per (traced size, rates, dtype), its estimate: every size priced on the line reads the line's two
    _estimates: dict[tuple[int, DeviceRates, str], NodeCosts] = dataclasses.field(default_factory=dict, init=False,
                                                                                  repr=False, compare=False)

    def graph(self, size: int) -> OpGraph:
        """The graph at microbatch size ``size``: its own trace, or the line's arrays at ``size`` (``fx`` and the
        names of the lower trace: enough to price and partition, not to run)."""
        if size in self.traced:
            return self.traced[size]
        if self.line is None:
            raise ValueError(f"microbatch size {size} was not traced (traced: {sorted(self.traced)}) and the traces "
                             "differ in their ops, so no size can be interpolated")
        lo, hi = (self.traced[b] for b in self.line)
        changes: dict[str, Any] = {name: _at(getattr(lo, name), getattr(hi, name), self.line, size)
                                   for name in _PER_OP + _PER_VALUE if getattr(lo, name) is not None}
        return dataclasses.replace(lo, **changes)

    def seconds(self, size: int, rates: DeviceRates, dtype: str) -> NodeCosts:
        """Per-op seconds at ``size`` (:func:`partitioner.cost.roofline.estimate` on its trace, or on the interpolated
        graph with the tp collectives' seconds interpolated)."""
        if self.timed is not None:
            if size in self.timed:
                return self.timed[size]
            assert self.line is not None  # graph() raises first otherwise
            lo_t, hi_t = (self.timed[b] for b in self.line)
            return NodeCosts(np.maximum(_at(lo_t.forward_s, hi_t.forward_s, self.line, size), 0.0),
                             np.maximum(_at(lo_t.backward_s, hi_t.backward_s, self.line, size), 0.0),
                             lo_t.needs_grad, measured=True)
        if size in self.traced:
            return self._estimate(size, rates, dtype)
        assert self.line is not None  # graph() raises first otherwise
        roof = estimate(dataclasses.replace(self.graph(size), fx=None), rates, dtype)  # no fx: no collectives
        lo, hi = (self._estimate(b, rates, dtype) for b in self.line)
        if lo.tp_forward_s is None or hi.tp_forward_s is None or lo.tp_backward_s is None or hi.tp_backward_s is None:
            return roof
        tp_fwd = np.maximum(_at(lo.tp_forward_s, hi.tp_forward_s, self.line, size), 0.0)
        tp_bwd = np.maximum(_at(lo.tp_backward_s, hi.tp_backward_s, self.line, size), 0.0)
        return NodeCosts(roof.forward_s + tp_fwd, roof.backward_s + tp_bwd, roof.needs_grad, tp_forward_s=tp_fwd,
                         tp_backward_s=tp_bwd)

    def _estimate(self, size: int, rates: DeviceRates, dtype: str) -> NodeCosts:
        """:func:`partitioner.cost.roofline.estimate` of the trace at ``size`` (cached)."""
        key = (size, rates, dtype)
        if key not in self._estimates:
            self._estimates[key] = estimate(self.traced[size], rates, dtype)
        return self._estimates[key]


def _at(lo: np.ndarray, hi: np.ndarray, line: tuple[int, int], size: int) -> np.ndarray:
    """The line through ``lo`` (at ``line[0]``) and ``hi`` (at ``line[1]``), at ``size``; integer arrays stay
    integer (the counts are integers wherever the line is exact)."""
    b1, b2 = line
    lo_f = np.asarray(lo, np.float64)
    out = lo_f + (np.asarray(hi, np.float64) - lo_f) * ((size - b1) / (b2 - b1))
    return np.rint(out).astype(lo.dtype) if np.issubdtype(lo.dtype, np.integer) else out


class LayoutCosts:
    """A model's graphs and per-op seconds per (tp degree, ep or cp degree, microbatch size), computed once each;
    ``skipped``: tp degrees that cannot shard this model, and why; ``tokens_per_sample``: token ids per sample of the
    example inputs (None when the input is not token ids); ``experts``: the experts of each mixture-of-experts layer
    expert parallelism splits (empty: a dense model, ep 1 only); ``sequence``: the tokens of each sequence context
    parallelism splits (None: no embedding of the input ids says where they are, cp 1 only)."""

    def __init__(self, lines: dict[int, BatchLine], whole: BatchLine, rates: DeviceRates, dtype: str,
                 skipped: dict[int, str], tokens_per_sample: float | None, experts: tuple[int, ...] = (),
                 sequence: int | None = None) -> None:
        self.lines, self.whole, self.rates, self.dtype, self.skipped = lines, whole, rates, dtype, skipped
        self.tokens_per_sample, self.experts, self.sequence = tokens_per_sample, experts, sequence
        self._split_lines: dict[tuple[int, int, int], BatchLine] = {}
        self._costs: dict[tuple[int, int, int, int, DeviceRates | None], NodeCosts] = {}
        self._graphs: dict[tuple[int, int, int, int], OpGraph] = {}

    @property
    def tp_degrees(self) -> list[int]:
        """The tp degrees priced, ascending."""
        return sorted(self.lines)

    def line(self, tp: int, ep: int = 1, cp: int = 1) -> BatchLine:
        """The traces of tp rank 0 as ep rank 0 of ``ep``, or cp rank 0 of ``cp``, runs them (written once, when first
        asked for; under cp, tp's without sequence parallelism, which the runtime turns off under it)."""
        if ep == 1 and cp == 1:
            return self.lines[tp]
        if (tp, ep, cp) not in self._split_lines:
            base = self.lines[tp] if cp == 1 or tp == 1 else self._plain_line(tp)
            with _lean():
                traced = {b: expert_parallel_graph(g, ep, 0) if ep > 1 else context_parallel_graph(g, cp, 0)
                          for b, g in base.traced.items()}
            self._split_lines[(tp, ep, cp)] = BatchLine(traced, base.line)  # timed: scaled in costs(), as tp
        return self._split_lines[(tp, ep, cp)]

    def _plain_line(self, tp: int) -> BatchLine:
        """tp rank 0's traces without sequence parallelism."""
        with _lean():
            traced = {b: _shard(g, tp, False)[0] for b, g in self.whole.traced.items()}
        return BatchLine({b: g for b, g in traced.items() if g is not None}, self.whole.line)

    def graph(self, tp: int, size: int, ep: int = 1, cp: int = 1) -> OpGraph:
        """tp rank 0's graph at microbatch size ``size``, ep rank 0's of it for ``ep`` above 1 (cp rank 0's for
        ``cp``)."""
        key = (tp, ep, cp, size)
        if key not in self._graphs:
            self._graphs[key] = self.line(tp, ep, cp).graph(size)
        return self._graphs[key]

    def costs(self, tp: int, size: int, ep: int = 1, across: DeviceRates | None = None, cp: int = 1) -> NodeCosts:
        """Per-op seconds of :meth:`graph` (timed: see the module docstring), its all-to-alls (or gathers, under cp)
        on the link ``across`` (None: the link within a node) for an ep (cp) group that spans nodes."""
        key = (tp, ep, cp, size, across)
        if key not in self._costs:
            line = self.line(tp, ep, cp)
            costs = line.seconds(size, self.rates, self.dtype)
            if across is not None and max(ep, cp) > 1:
                costs = _priced_across(costs, line, size, self.rates, across, self.dtype,
                                       all_to_all_seconds if ep > 1 else context_seconds)
            if (tp > 1 or ep > 1 or cp > 1) and self.whole.timed is not None:  # the roofline, scaled to the timed
                timed = self.whole.seconds(size, self.rates, self.dtype)
                roof = BatchLine(self.whole.traced, self.whole.line).seconds(size, self.rates, self.dtype)
                f = timed.forward_s.sum() / max(roof.forward_s.sum(), 1e-30)
                b = timed.backward_s.sum() / max(roof.backward_s.sum(), 1e-30)
                costs = dataclasses.replace(costs, forward_s=costs.forward_s * f, backward_s=costs.backward_s * b,
                                            measured=True)
            self._costs[key] = costs
        return self._costs[key]

    def model_flops(self, size: int) -> float:
        """Forward FLOPs of the whole model (no tp) on one microbatch of ``size``: the model FLOPs of
        :mod:`partitioner.cost.throughput`."""
        return float(self.whole.graph(size).flops.sum())


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """CPython's cyclic garbage collector off meanwhile (as it was after): its full collections rescan every node and
    fake tensor of the graphs built so far (5 of the 30 s that tracing and sharding a 1T-parameter GPT take, 2 of its
    search's 25), and what cycles are dropped meanwhile are collected after."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


@contextlib.contextmanager
def _lean() -> Iterator[None]:
    """torch.export and the tp rewrite, lean: without the source line torch records for each op (a walk of the
    Python stack per op, a third of an export's time; the planner's graphs are priced and sharded, never debugged)
    and without the garbage collector (:func:`collector_paused`)."""
    traces = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        with collector_paused():
            yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = traces


def _priced_across(costs: NodeCosts, line: BatchLine, size: int, rates: DeviceRates, across: DeviceRates, dtype: str,
                   pricing: Callable[..., tuple[np.ndarray, np.ndarray]]) -> NodeCosts:
    """``costs`` (the collectives ``pricing`` prices, an ep group's all-to-alls or a cp group's gathers, on ``rates``'
    link) with them on ``across``'s instead: the difference at the traced sizes, on the line through them at others
    (it is affine in the bytes, as the collectives are)."""
    def extra(b: int) -> tuple[np.ndarray, np.ndarray]:
        g = line.traced[b]
        needs = needs_grad(g)
        (f0, b0), (f1, b1) = (pricing(g, r, dtype, needs) for r in (rates, across))
        return f1 - f0, b1 - b0

    if size in line.traced or line.line is None:
        fwd, bwd = extra(size)
    else:
        (lo_f, lo_b), (hi_f, hi_b) = (extra(b) for b in line.line)
        fwd, bwd = _at(lo_f, hi_f, line.line, size), _at(lo_b, hi_b, line.line, size)
    tp_f = fwd if costs.tp_forward_s is None else costs.tp_forward_s + fwd
    tp_b = bwd if costs.tp_backward_s is None else costs.tp_backward_s + bwd
    return dataclasses.replace(costs, forward_s=costs.forward_s + fwd, backward_s=costs.backward_s + bwd,
                               tp_forward_s=tp_f, tp_backward_s=tp_b)


def _same_ops(a: OpGraph, b: OpGraph) -> bool:
    return a.names == b.names and a.kinds == b.kinds and np.array_equal(a.src, b.src) and np.array_equal(a.dst, b.dst)


def _shard(graph: OpGraph, tp: int, sequence: bool) -> tuple[OpGraph | None, str]:
    """tp rank 0's graph of ``graph`` (``sequence``: with sequence parallelism where it applies, quietly, as the
    runtime's default), or None and why tensor parallelism of degree ``tp`` cannot split it."""
    if graph.fx is None:
        return None, "the graph is synthetic (no traced program to shard)"
    with warnings.catch_warnings():  # torch's deprecation notices while copying the graph; where sp does not apply
        warnings.simplefilter("ignore")
        sharding = find_sharding(graph.fx.module, tp)
        if not sharding.params:
            return None, "no layer splits (no column/row-parallel matmul pair with sizes it divides)"
        thin = thin_params(sharding)
        if thin:
            return None, f"{thin[0][1]} has only {thin[0][0]} slices along its split dimension"
        warnings.simplefilter("ignore", SequenceParallelWarning)
        return shard_graph(graph, sharding, 0, sequence), ""


def layout_costs(model: torch.nn.Module, args: tuple, kwargs: dict, *, sizes: Iterable[int], tp_degrees: Iterable[int],
                 rates: DeviceRates, dtype: str, progress: Callable[[str], None] = lambda m: None,
                 timed: bool = False, sequence_parallel: bool = True) -> LayoutCosts:
    """Trace ``model`` (example inputs ``args``/``kwargs``: one microbatch) at the sizes :func:`trace_sizes` picks
    for microbatch ``sizes``, shard each trace for every degree of ``tp_degrees`` (those that cannot split the model
    are skipped, with the reason; ``sequence_parallel``: with sequence parallelism where it applies), find its
    mixture-of-experts layers, and return the :class:`LayoutCosts` that prices any of those sizes and degrees;
    ``timed``: the ops timed on this machine at the traced sizes (see the module docstring)."""
    wanted = sorted(set(sizes))
    batch = example_batch(args, kwargs)
    times: dict[int, NodeCosts] = {}

    def traced_at(size: int) -> OpGraph:
        progress(f"tracing at microbatch size {size}" + (" and timing its ops" if timed else ""))
        a, k = tiled(args, kwargs, batch, size) if timed else with_batch(args, kwargs, batch, size)
        graph = trace(model, a, k)
        if timed:
            times[size] = timed_costs(graph, a, k, rates)
        return graph

    with _lean():  # tracing and sharding
        whole = {b: traced_at(b) for b in trace_sizes(batch, wanted, timed)}
        line: tuple[int, int] | None = (min(whole), max(whole)) if len(whole) == 2 else None
        if line is not None and not _same_ops(whole[line[0]], whole[line[1]]):
            progress(f"the traces at microbatch sizes {line} differ in their ops: tracing every size on its own")
            line = None
            whole.update({b: traced_at(b) for b in wanted if b not in whole})
        lines: dict[int, BatchLine] = {}
        skipped: dict[int, str] = {}
        for tp in sorted(set(tp_degrees)):
            if tp == 1:
                lines[1] = BatchLine(dict(whole), line, dict(times) if timed else None)
                continue
            progress(f"sharding for tensor parallelism of degree {tp}")
            shards: dict[int, OpGraph] = {}
            for b, g in whole.items():
                local, why = _shard(g, tp, sequence_parallel)
                if local is None:
                    skipped[tp] = why
                    break
                shards[b] = local
            else:
                lines[tp] = BatchLine(shards, line)
    first = whole[min(whole)]
    samples, tokens = batch_counts([dict(zip(first.fx.input_names, first.fx.input_meta))]) if first.fx else (0, None)
    per_sample = tokens / samples if tokens is not None and samples else None
    experts = tuple(x.experts for x in find_experts(first.fx.module).layers) if first.fx else ()
    return LayoutCosts(lines, BatchLine(dict(whole), line, dict(times) if timed else None), rates, dtype, skipped,
                       per_sample, experts,
                       ids[1] if first.fx and (ids := sequence_ids(first.fx.module.graph)) else None)
