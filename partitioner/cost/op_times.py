"""The ops of a traced graph timed on this machine, measured once and kept on disk, as the CPU profile is.

:func:`partitioner.measure` times every op's forward and backward; two measurements differ by a few per cent (more on
a shared machine), and a plan made from them can move a boundary between two processes of the same script, and with
it the rounding of every later step (a tied weight's gradient summed across stages or within one). So the costs are
kept per graph and machine (:func:`timed_costs`): the first process that plans a model times its ops and writes them
to the cache folder of :mod:`partitioner.cost.calibration`, keyed by the graph's fingerprint (its ops, their kinds,
FLOPs and bytes, its edges and parameters), the machine (:func:`partitioner.cost.calibration.machine_key`, which
includes the thread count) and the device rates; every later process, ``smp inspect`` and the run alike, reads the
same costs and makes the same plan. ``SMP_RECALIBRATE=1`` times them again.

A machine's speed is not a constant: a laptop on battery, a shared VM whose host got busy (on the 2-core VM this
project tests on, the same forward and backward took 9 ms in one half hour and 16 ms in the next). So each entry
keeps, beside the op times, the seconds of a fixed reference workload timed right after them (:func:`probe_s`);
a later read times the workload again and keeps the entry only while the machine runs it within
:data:`STALE` of that speed, else times the ops again: the same plan while the machine is as it was, fresh
costs when it is not.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from typing import Any

import numpy as np
import torch

from ..capture.graph import OpGraph
from .calibration import (
    RECALIBRATE_ENV,
    RUNTIME_COSTS,
    TIMING_VERSION,
    cache_dir,
    cost_clock,
    machine_key,
    write_atomically,
)
from .devices import DeviceRates
from .roofline import NodeCosts, estimate
from .timing import measure, untimeable

__all__ = ["timed_costs", "fingerprint", "probe_s", "STALE"]

STALE = 0.25  # an entry is stale once the reference workload runs this much faster or slower than beside it


def fingerprint(graph: OpGraph, rates: DeviceRates) -> str:
    """A digest of what the timing of ``graph``'s ops depends on: its ops, their kinds, FLOPs and bytes, its edges and
    parameters, this machine, the device rates that price ops (not the runtime's costs per pass, step and collective)
    and how the ops are timed (:data:`partitioner.cost.calibration.TIMING_VERSION`)."""
    h = hashlib.sha256()
    # The runtime's costs (RUNTIME_COSTS) price steps, not ops: measuring them again keeps the op times.
    priced = {k: v for k, v in rates.to_dict().items() if k not in RUNTIME_COSTS}
    key = [TIMING_VERSION, graph.names, graph.kinds, graph.param_names, machine_key(), priced]
    h.update(json.dumps(key).encode())
    for array in (graph.flops, graph.move_bytes, graph.out_bytes, graph.src, graph.dst, graph.param_bytes):
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()[:24]


def timed_costs(graph: OpGraph, args: tuple, kwargs: dict, rates: DeviceRates) -> NodeCosts:
    """Every op of ``graph`` timed on this machine (:func:`partitioner.measure` with the example inputs ``args`` /
    ``kwargs``), read from the cache when this graph was timed before here (see the module docstring). A graph whose
    ops cannot run one at a time (:func:`partitioner.cost.timing.untimeable`) is priced by the cost model, with a
    warning."""
    why = untimeable(graph)
    if why:
        warnings.warn(f"{why}, which cannot run one op at a time: the cost model prices its ops", stacklevel=2)
        return estimate(graph, rates)
    path = cache_dir() / f"op-times-{fingerprint(graph, rates)}.json"
    if os.environ.get(RECALIBRATE_ENV, "") in ("", "0"):
        try:
            data: Any = json.loads(path.read_text())
            if (len(data["forward_s"]) == graph.num_nodes == len(data["backward_s"]) == len(data["needs_grad"])
                    and abs(probe_s() / float(data["probe_s"]) - 1.0) <= STALE):
                return NodeCosts(np.asarray(data["forward_s"], np.float64), np.asarray(data["backward_s"], np.float64),
                                 np.asarray(data["needs_grad"], bool), measured=True)
        except (OSError, ValueError, TypeError, KeyError, ZeroDivisionError):
            pass  # missing, unreadable or stale: time them and write it again
    costs = measure(graph, args, kwargs, rates=rates)
    write_atomically(path, {"forward_s": costs.forward_s.tolist(), "backward_s": costs.backward_s.tolist(),
                            "needs_grad": costs.needs_grad.tolist(), "probe_s": probe_s()})
    return costs


def probe_s(repeats: int = 15) -> float:
    """Seconds of a fixed reference workload on this thread, as :func:`partitioner.measure` clocks ops (the fastest of
    ``repeats`` after a warm-up: within about 10 % from one call to the next): a linear layer, a convolution and
    elementwise ops, forward and backward, a few milliseconds in all. Its inputs come from a generator of its own
    (the caller's random streams are untouched)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen, requires_grad=True)
    w = torch.randn(256, 256, generator=gen, requires_grad=True)
    img = torch.randn(4, 16, 32, 32, generator=gen, requires_grad=True)
    k = torch.randn(16, 16, 3, 3, generator=gen, requires_grad=True)
    clock = cost_clock(torch.device("cpu"))
    times = []
    for _ in range(repeats + 1):
        t0 = clock()
        y = torch.nn.functional.gelu(x @ w).softmax(-1).sum() + torch.conv2d(img, k, padding=1).relu().mean()
        y.backward()
        times.append(clock() - t0)
    return min(times[1:])
