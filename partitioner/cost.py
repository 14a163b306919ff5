"""The cost model: seconds and bytes per op, per stage.

Compute is a roofline with a dispatch floor: an op's forward takes
``max(flops / flop_rate, moved_bytes / memory_bandwidth) + op_overhead`` seconds (Williams et al. 2009,
"Roofline: an insightful visual performance model", CACM 52(4)). The rates are *measured* on the
device by :func:`calibrate` (a matmul, a streaming add, a tiny op, a write to fresh memory). Backward is
2x forward (two matmuls per forward matmul: the input gradient and the weight gradient) for ops that need
a gradient, 1x for ops none of whose inputs needs one (the first layer: only its weight gradient), and 0
for ops that need none (frozen teachers, index math); on top of that, every trainable parameter an op
uses costs its bytes written at ``grad_bytes_per_s``: the weight gradient is a new tensor every step
(``zero_grad(set_to_none=True)``), and on CPU writing fresh pages is page-fault bound -- for a conv net,
whose late layers hold most of the weights and few of the FLOPs, this is most of the backward time.
``measure`` mode replaces the estimate by timing each op's forward and backward for real.

Memory per stage: parameters (+ gradients + optimizer state for trainable ones, by optimizer kind) and
the activations each op keeps for backward times the microbatches in flight on that stage.
Communication: bytes over a link of ``link_bytes_per_s`` plus ``link_latency_s`` per message.
"""
from __future__ import annotations

import math
import operator
import statistics
import time
from dataclasses import asdict, dataclass
from functools import cache
from typing import Any

import numpy as np
import torch
import torch.fx

from .graph import OpGraph

__all__ = ["DeviceRates", "calibrate", "NodeCosts", "estimate", "measure", "op_flops_and_bytes",
           "OPTIMIZER_STATE_FACTOR", "in_flight", "tensor_bytes"]

# Optimizer state per trainable parameter byte (Adam keeps two moments; SGD with momentum one).
OPTIMIZER_STATE_FACTOR = {"adam": 2.0, "adamw": 2.0, "sgd": 1.0, "none": 0.0}

_VIEW_OPS = {
    "view", "_unsafe_view", "reshape", "transpose", "permute", "t", "expand", "unsqueeze", "squeeze",
    "slice", "select", "alias", "detach", "as_strided", "split", "split_with_sizes", "chunk", "unbind",
    "_assert_tensor_metadata", "_assert_scalar", "sym_size", "lift_fresh_copy", "contiguous", "flatten",
    "unflatten", "view_as", "expand_as", "narrow", "movedim", "_to_copy_noop", "to", "type_as", "dropout",
}
_NORM_OPS = {"layer_norm", "native_layer_norm", "batch_norm", "native_batch_norm", "group_norm",
             "softmax", "_softmax", "log_softmax", "_log_softmax", "rms_norm", "instance_norm"}


@dataclass(frozen=True)
class DeviceRates:
    """Throughputs of one device and its link, as measured by :func:`calibrate` (or set by hand)."""

    flops_per_s: float = 5.0e10
    bytes_per_s: float = 1.0e10
    op_overhead_s: float = 5.0e-6
    link_bytes_per_s: float = 2.0e9
    link_latency_s: float = 5.0e-5
    grad_bytes_per_s: float = 2.0e9   # writing freshly allocated memory (a new weight gradient)

    def comm_s(self, nbytes: float, messages: float = 1.0) -> float:
        return 0.0 if nbytes <= 0 else nbytes / self.link_bytes_per_s + messages * self.link_latency_s

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def _median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _best_time(fn, repeats: int, clock=time.perf_counter) -> float:
    """Fastest of ``repeats`` runs: other load only ever slows a run down, so the minimum is the device's
    own speed (what makes plans stable on a shared machine; medians moved with the load)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def _cost_clock(device: torch.device):
    """With one intra-op thread on CPU all of an op's work runs on the calling thread, so that thread's CPU
    time is the op's cost; unlike wall time it does not grow while other processes hold the cores (which a
    minimum over runs cannot undo for a run of 100 ms under steady load), and it does include the
    kernel's page-fault time. Elsewhere (more threads, CUDA), wall time."""
    return time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter


@cache
def calibrate(device: str = "cpu") -> DeviceRates:
    """Measure this device's matmul rate, memory bandwidth and per-op overhead (about 0.2 s, cached).

    Rates are rounded to two significant digits so that plans stay byte-identical across runs on one
    machine unless the machine really changed speed.
    """
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    a = torch.randn(512, 512, device=dev)
    # Streaming bandwidth: two inputs and a preallocated output, each larger than a last-level cache.
    # (A 16 MiB ``big + big`` sat at the size of this class of CPU's L3 and allocated its output every
    # call, so it read as 7 GB/s in one process and 60 GB/s in the next.)
    n_big = 16 * 1024 * 1024
    x, y, z = (torch.randn(n_big, device=dev) for _ in range(3))
    tiny = torch.randn(8, device=dev)
    # Fresh memory: 64 MiB is above glibc's largest mmap threshold (32 MiB), so on CPU every call maps new
    # pages, as a step's new weight gradients do once malloc has trimmed them; CUDA's caching allocator
    # reuses its blocks, so there this is plain write bandwidth.
    n_fresh = 16 * 1024 * 1024

    def run(f):
        return lambda: (f(), sync())

    clock = _cost_clock(dev)
    mm = _best_time(run(lambda: a @ a), 10, clock)
    add = _best_time(run(lambda: torch.add(x, y, out=z)), 10, clock)
    small = _best_time(run(lambda: tiny + tiny), 200)  # ~1 us: reading a CPU-time clock costs about as much
    fresh = _best_time(run(lambda: torch.empty(n_fresh, device=dev).fill_(1.0)), 5, clock)
    del x, y, z

    def r2(x: float) -> float:
        return float(f"{x:.2g}")

    return DeviceRates(
        flops_per_s=r2(2 * 512 ** 3 / mm),
        bytes_per_s=r2(3 * n_big * 4 / add),
        op_overhead_s=r2(small),
        grad_bytes_per_s=r2(n_fresh * 4 / fresh),
    )


def _numel(v: Any) -> int:
    return v.numel() if isinstance(v, torch.Tensor) else 0


def tensor_bytes(v: Any) -> int:
    """Bytes of a tensor, or of the tensors in a (nested) list/tuple; 0 for anything else."""
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (list, tuple)):
        return sum(tensor_bytes(x) for x in v)
    return 0


def op_flops_and_bytes(node: torch.fx.Node) -> tuple[float, int, bool]:
    """Forward FLOPs, bytes moved and whether the op is a free view, from the traced shapes."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    name = packet.__name__ if packet is not None else getattr(target, "__name__", str(target))
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
    out = node.meta.get("val")
    out_numel = _numel(out) if isinstance(out, torch.Tensor) else sum(_numel(o) for o in (out or ()) if isinstance(o, torch.Tensor)) if isinstance(out, (list, tuple)) else 0
    if name in _VIEW_OPS:
        return 0.0, 0, True
    moved = tensor_bytes(out) + sum(tensor_bytes(v) for v in vals)
    t = [v for v in vals if isinstance(v, torch.Tensor)]
    if name in ("addmm", "mm", "bmm", "baddbmm", "matmul", "linear") and len(t) >= 2:
        a, b = (t[1], t[2]) if name in ("addmm", "baddbmm") and len(t) >= 3 else (t[0], t[1])
        k = a.shape[-1] if a.dim() else 1
        return 2.0 * out_numel * k, moved, False
    if name in ("conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose2d",
                "conv_transpose1d", "conv_transpose3d") and len(t) >= 2:
        w = t[1]
        per_out = w.shape[1] * math.prod(w.shape[2:])
        if "transpose" in name:  # each input element scatters into Cout/groups * kernel outputs
            return 2.0 * _numel(t[0]) * w.shape[1] * math.prod(w.shape[2:]), moved, False
        return 2.0 * out_numel * per_out, moved, False
    if name.startswith("scaled_dot_product") or "flash_attention" in name or "efficient_attention" in name:
        q, k = t[0], t[1]
        batch = q.numel() // (q.shape[-2] * q.shape[-1])
        return 4.0 * batch * q.shape[-2] * k.shape[-2] * q.shape[-1] + 5.0 * batch * q.shape[-2] * k.shape[-2], moved, False
    if name == "embedding":
        return 0.0, 2 * tensor_bytes(out), False
    if name in _NORM_OPS:
        return 5.0 * out_numel, moved, False
    return float(out_numel), moved, False


@dataclass
class NodeCosts:
    """Per-op costs: forward and backward seconds, and whether the op has a backward at all."""

    forward_s: np.ndarray
    backward_s: np.ndarray
    needs_grad: np.ndarray
    measured: bool = False

    @property
    def total_s(self) -> np.ndarray:
        return self.forward_s + self.backward_s


def _needs_grad(graph: OpGraph) -> np.ndarray:
    """An op has a backward when it reads a trainable parameter or a value that has one (index order is
    topological, so one sweep in order settles it)."""
    needs = np.zeros(graph.num_nodes, bool)
    if len(graph.use_node):
        needs[graph.use_node[graph.param_trainable[graph.use_param]]] = True
    if graph.num_edges:
        order = np.argsort(graph.dst, kind="stable")
        src, dst = graph.src[order], graph.dst[order]
        # Propagate along edges in order of destination; src < dst so a source is final when read.
        for s, d in zip(src.tolist(), dst.tolist()):
            if needs[s]:
                needs[d] = True
    return needs


def estimate(graph: OpGraph, rates: DeviceRates | None = None) -> NodeCosts:
    """Analytic costs of every op under ``rates`` (the measured defaults of :func:`calibrate` if None)."""
    rates = rates or calibrate()
    compute = np.maximum(graph.flops / rates.flops_per_s, graph.move_bytes / rates.bytes_per_s)
    is_op = np.array([k != "output" for k in graph.kinds], bool)
    fwd = np.where(is_op, compute + rates.op_overhead_s, 0.0)
    all_needs = _needs_grad(graph)
    needs = all_needs & is_op
    # Input gradients only where some input carries one; weight gradients are written to fresh memory.
    input_grad = np.zeros(graph.num_nodes, bool)
    input_grad[graph.dst[all_needs[graph.src]]] = True
    grad_bytes = np.zeros(graph.num_nodes)
    if len(graph.use_node):
        trainable = graph.param_trainable[graph.use_param]
        np.add.at(grad_bytes, graph.use_node[trainable], graph.param_bytes[graph.use_param[trainable]])
    factor = np.where(input_grad, 2.0, 1.0)
    bwd = np.where(needs, factor * compute + grad_bytes / rates.grad_bytes_per_s + rates.op_overhead_s, 0.0)
    return NodeCosts(forward_s=fwd, backward_s=bwd, needs_grad=needs)


def measure(graph: OpGraph, args: tuple, kwargs: dict | None = None, *, repeats: int = 3,
            rates: DeviceRates | None = None) -> NodeCosts:
    """Time every op's forward *and* backward for real (median of ``repeats``, after one warm-up pass).

    The traced graph runs node by node; each op reads its inputs as fresh autograd leaves, and right after
    its forward its own backward runs on random output gradients, so backward costs are per op -- a conv
    net's late layers, which hold most of the weights, pay for their weight gradients, where one
    backward/forward ratio for the whole model would spread that cost evenly. Each op's weight gradients
    are new tensors (as after ``zero_grad(set_to_none=True)``). The fixed cost of one
    ``autograd.backward`` call, which a stage pays once and not per op, is measured on a trivial op and
    subtracted. With one intra-op thread on CPU the clock is this thread's CPU time (robust on a shared
    machine, see :func:`_cost_clock`); otherwise wall time. The model's buffers (BatchNorm statistics) and gradients are restored.
    """
    import torch.utils._pytree as pytree

    from .trace import flatten_inputs

    if graph.fx is None:
        raise ValueError("measure() needs a traced graph (partitioner.trace), not a synthetic one")
    rates = rates or calibrate()
    fx = graph.fx
    gm = fx.module
    flat = flatten_inputs(fx, args, kwargs)
    clock = _cost_clock(next(iter(gm.parameters()), torch.empty(0)).device)
    params = {id(p): p for p in gm.parameters()}
    saved_grads = {k: p.grad for k, p in params.items()}
    for q in params.values():  # or the first backward would accumulate into the caller's gradients
        q.grad = None
    saved_buffers = [(b, b.detach().clone()) for b in gm.buffers()]
    gen = torch.Generator().manual_seed(0)
    fwd_samples: dict[str, list[float]] = {}
    bwd_samples: dict[str, list[float]] = {}
    call_overhead = _backward_call_overhead(clock, repeats) - rates.op_overhead_s

    def leaf(v: Any, written: bool) -> Any:
        if isinstance(v, torch.Tensor) and v.requires_grad and id(v) not in params:
            v = v.detach().requires_grad_(True)
            return v.clone() if written else v  # an in-place op may not write to a leaf
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
                        env[node.name] = node.target(*torch.fx.node.map_arg(node.args, lambda n: env[n.name]))
                        continue
                    written = {n.name for n in _written_args(node)}
                    a, k = torch.fx.node.map_arg((node.args, node.kwargs),
                                                 lambda n: leaf(env[n.name], n.name in written))
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
                        for q in params.values():
                            q.grad = None
                    if rep:
                        fwd_samples.setdefault(node.name, []).append(t1 - t0)
                        if outs:
                            bwd_samples.setdefault(node.name, []).append(max(t3 - t2 - call_overhead, 0.0))
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
    needs = estimate(graph, rates).needs_grad
    return NodeCosts(forward_s=fwd, backward_s=np.where(needs, bwd, 0.0), needs_grad=needs, measured=True)


def _written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The input nodes that ``node`` updates in place (by its ATen schema's alias annotations)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            val = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            out.extend(v for v in (val if isinstance(val, (list, tuple)) else [val]) if isinstance(v, torch.fx.Node))
    return out


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


def in_flight(stage: int, num_stages: int, microbatches: int, pipeline: str) -> int:
    """Microbatches whose activations a stage holds at once: GPipe keeps all m; 1F1B keeps p - s."""
    if pipeline in ("gpipe", "simple"):
        return microbatches
    return max(1, min(microbatches, num_stages - stage))
