"""The ops of a traced graph timed on this machine, measured once and kept on disk, as the CPU profile is.

:func:`partitioner.measure` times every op's forward and backward; two measurements differ by a few per cent (more on
a shared machine), and a plan made from them can move a boundary between two processes of the same script, and with
it the rounding of every later step (a tied weight's gradient summed across stages or within one). So the costs are
kept per graph and machine (:func:`timed_costs`): the first process that plans a model times its ops and writes them
to the cache folder of :mod:`partitioner.calibration`, keyed by the graph's fingerprint (its ops, their kinds, FLOPs
and bytes, its edges and parameters), the machine (:func:`partitioner.calibration.machine_key`, which includes the
thread count) and the device rates; every later process, ``smp inspect`` and the run alike, reads the same costs and
makes the same plan. ``SMP_RECALIBRATE=1`` times them again.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from typing import Any

import numpy as np

from .calibration import RECALIBRATE_ENV, cache_dir, machine_key, write_atomically
from .cost import NodeCosts, estimate
from .devices import DeviceRates
from .graph import OpGraph
from .timing import measure, untimeable

__all__ = ["timed_costs", "fingerprint"]


def fingerprint(graph: OpGraph, rates: DeviceRates) -> str:
    """A digest of what the timing of ``graph``'s ops depends on: its ops, their kinds, FLOPs and bytes, its edges and
    parameters, this machine and the device rates."""
    h = hashlib.sha256()
    h.update(json.dumps([graph.names, graph.kinds, graph.param_names, machine_key(), rates.to_dict()]).encode())
    for array in (graph.flops, graph.move_bytes, graph.out_bytes, graph.src, graph.dst, graph.param_bytes):
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()[:24]


def timed_costs(graph: OpGraph, args: tuple, kwargs: dict, rates: DeviceRates) -> NodeCosts:
    """Every op of ``graph`` timed on this machine (:func:`partitioner.measure` with the example inputs ``args`` /
    ``kwargs``), read from the cache when this graph was timed before here (see the module docstring). A graph whose
    ops cannot run one at a time (:func:`partitioner.timing.untimeable`) is priced by the cost model, with a warning."""
    why = untimeable(graph)
    if why:
        warnings.warn(f"{why}, which cannot run one op at a time: the cost model prices its ops", stacklevel=2)
        return estimate(graph, rates)
    path = cache_dir() / f"op-times-{fingerprint(graph, rates)}.json"
    if os.environ.get(RECALIBRATE_ENV, "") in ("", "0"):
        try:
            data: Any = json.loads(path.read_text())
            if len(data["forward_s"]) == graph.num_nodes == len(data["backward_s"]) == len(data["needs_grad"]):
                return NodeCosts(np.asarray(data["forward_s"], np.float64), np.asarray(data["backward_s"], np.float64),
                                 np.asarray(data["needs_grad"], bool), measured=True)
        except (OSError, ValueError, TypeError, KeyError):
            pass  # missing or unreadable: time them and write it again
    costs = measure(graph, args, kwargs, rates=rates)
    write_atomically(path, {"forward_s": costs.forward_s.tolist(), "backward_s": costs.backward_s.tolist(),
                            "needs_grad": costs.needs_grad.tolist()})
    return costs
