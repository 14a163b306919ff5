"""The price of expert parallelism: the all-to-alls of every expert layer of an ep rank's program.

Each expert layer (:func:`partitioner.ep.dispatch.expert_parallel`) moves its routed rows twice forward (to the
experts' ranks, and the results home) and their gradients twice backward, plus one exchange of per-expert counts
(a few bytes: latency only). Under balanced routing a rank keeps ``1 / ep`` of its rows and sends the rest, the
pattern of a pairwise all-to-all, which moves what a ring all-gather of the same output moves: ``(ep - 1) / ep x B``
per rank in ``ep - 1`` steps (:func:`partitioner.cost.collectives.all_gather_s`), on the link an ep group's ranks
share. Bytes are the traced rows' at the training precision (:mod:`partitioner.cost.precision`).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..capture.graph import OpGraph
from ..cost.collectives import all_gather_s, bytes_at, priced_calls
from ..cost.devices import DeviceRates
from .dispatch import expert_parallel

__all__ = ["all_to_all_seconds"]


def all_to_all_seconds(graph: OpGraph, rates: DeviceRates, dtype: str = "fp32",
                       needs_grad: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per op, the forward and the backward seconds of its expert all-to-alls (zeros for other ops)."""
    comm = graph.fx.ep_comm if graph.fx is not None else None
    ep = comm.size if comm is not None else 1

    def price(node: Any) -> tuple[float, float]:  # the rows there and back, and the counts forward
        one = all_gather_s(bytes_at(node.args[2].meta.get("val"), dtype), ep, rates)
        return 2 * one + all_gather_s(8.0 * ep, ep, rates), 2 * one

    return priced_calls(graph, {expert_parallel} if comm is not None else (), price, needs_grad)
