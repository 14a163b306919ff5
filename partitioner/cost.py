"""The cost model: seconds and bytes per op, per stage.

Compute is a roofline with a dispatch floor: an op's forward takes
``max(flops / flop_rate, moved_bytes / memory_bandwidth) + op_overhead`` seconds (Williams et al. 2009,
"Roofline: an insightful visual performance model", CACM 52(4)). The three rates are *measured* on the
device by :func:`calibrate` (a matmul, a large add, a tiny op); backward is 2x forward (two matmuls per
forward matmul) for ops that need a gradient and 0 for ops that do not (frozen teachers, index math).
``measure`` mode replaces the estimate by timing each op's forward for real and scaling backward by the
measured backward/forward ratio of the whole model.

Memory per stage: parameters (+ gradients + optimizer state for trainable ones, by optimizer kind) and
the activations each op keeps for backward times the microbatches in flight on that stage.
Communication: bytes over a link of ``link_bytes_per_s`` plus ``link_latency_s`` per message.
"""
from __future__ import annotations

import math
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
           "OPTIMIZER_STATE_FACTOR", "in_flight"]

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


@cache
def calibrate(device: str = "cpu") -> DeviceRates:
    """Measure this device's matmul rate, memory bandwidth and per-op overhead (about 0.2 s, cached).

    Rates are rounded to two significant digits so that plans stay byte-identical across runs on one
    machine unless the machine really changed speed.
    """
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    a = torch.randn(512, 512, device=dev)
    big = torch.randn(4 * 1024 * 1024, device=dev)
    tiny = torch.randn(8, device=dev)

    def run(f):
        return lambda: (f(), sync())

    mm = _median_time(run(lambda: a @ a), 5)
    add = _median_time(run(lambda: big + big), 5)
    small = _median_time(run(lambda: tiny + tiny), 50)

    def r2(x: float) -> float:
        return float(f"{x:.2g}")

    return DeviceRates(
        flops_per_s=r2(2 * 512 ** 3 / mm),
        bytes_per_s=r2(3 * big.numel() * 4 / add),
        op_overhead_s=r2(small),
    )


def _numel(v: Any) -> int:
    return v.numel() if isinstance(v, torch.Tensor) else 0


def _tensor_bytes(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (list, tuple)):
        return sum(_tensor_bytes(x) for x in v)
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
    moved = _tensor_bytes(out) + sum(_tensor_bytes(v) for v in vals)
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
        return 0.0, 2 * _tensor_bytes(out), False
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
    needs = _needs_grad(graph) & is_op
    bwd = np.where(needs, 2.0 * compute + rates.op_overhead_s, 0.0)
    return NodeCosts(forward_s=fwd, backward_s=bwd, needs_grad=needs)


def measure(graph: OpGraph, args: tuple, kwargs: dict | None = None, *, repeats: int = 3,
            rates: DeviceRates | None = None) -> NodeCosts:
    """Time every op's forward for real (median of ``repeats``) and scale backward by the measured
    backward/forward ratio of the whole traced model."""
    import torch.utils._pytree as pytree

    from .trace import flatten_inputs

    if graph.fx is None:
        raise ValueError("measure() needs a traced graph (partitioner.trace), not a synthetic one")
    fx = graph.fx
    gm = fx.module
    flat = flatten_inputs(fx, args, kwargs)
    per_node = np.zeros(graph.num_nodes)
    samples: dict[str, list[float]] = {}
    for rep in range(repeats + 1):  # the first pass warms up and is not counted
        env: dict[str, Any] = {}
        placeholders = iter(flat)
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node.name] = next(placeholders)
            elif node.op == "get_attr":
                env[node.name] = _fetch(gm, node.target)
            elif node.op == "call_function":
                a, k = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name])
                t0 = time.perf_counter()
                env[node.name] = node.target(*a, **k)
                if rep:
                    samples.setdefault(node.name, []).append(time.perf_counter() - t0)
    for name, ts in samples.items():
        per_node[fx.op_of[name]] += statistics.median(ts)
    base = estimate(graph, rates)
    # Whole-model forward vs forward+backward, to turn measured forwards into backward estimates.
    out_leaves = [v for v in pytree.tree_leaves(gm(*args, **(kwargs or {}))) if isinstance(v, torch.Tensor)]
    diff = [o for o in out_leaves if o.requires_grad]
    if diff:
        def fwd():
            return [o for o in pytree.tree_leaves(gm(*args, **(kwargs or {}))) if isinstance(o, torch.Tensor) and o.requires_grad]

        def fwd_bwd():
            outs = fwd()
            torch.autograd.backward([o.float().sum() for o in outs])
        f = _median_time(fwd, repeats)
        fb = _median_time(fwd_bwd, repeats)
        gm.zero_grad(set_to_none=True)
        ratio = max(fb - f, 0.0) / max(f, 1e-12)
    else:
        ratio = 0.0
    bwd = np.where(base.needs_grad, per_node * ratio, 0.0)
    return NodeCosts(forward_s=per_node, backward_s=bwd, needs_grad=base.needs_grad, measured=True)


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
