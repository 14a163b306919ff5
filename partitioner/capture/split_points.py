"""The user's own split points: ``torch.distributed.pipelining.pipe_split()`` markers in a model's forward.

A model written for torch.distributed.pipelining marks its stage boundaries by calling ``pipe_split()``
between layers; the call is a no-op when the model runs eagerly, and the trace keeps it as an op of kind
``pippy._pipe_split`` with no inputs and no outputs. Such markers are the user's placement, as ``smp.partition``
blocks are: ``k`` markers make ``k + 1`` stages, cut in the order the forward runs (which is the order data
flows, so the stages are acyclic). :func:`partitioner.partition` honours them instead of searching; priced and
scored like any plan, under the method name ``"pipe_split"``.
"""
from __future__ import annotations

import numpy as np

from .graph import OpGraph

__all__ = ["MARKER_KIND", "marker_stages"]

MARKER_KIND = "pippy._pipe_split"


def marker_stages(graph: OpGraph, num_stages: int) -> np.ndarray | None:
    """The stage of every op of ``graph`` as its ``pipe_split()`` markers cut it (None without markers): the ops
    after the i-th marker, in program order, are stage i. A marker count that does not make ``num_stages``
    stages, or two markers with no op between them, is an error that says where."""
    is_marker = np.array([k == MARKER_KIND for k in graph.kinds], bool)
    markers = int(is_marker.sum())
    if markers == 0:
        return None
    if markers + 1 != num_stages:
        raise ValueError(f"the model has {markers} pipe_split() marker(s), which make {markers + 1} stages, but "
                         f"{num_stages} were asked for: pass num_stages={markers + 1}, or add or remove markers")
    stage = np.cumsum(is_marker).astype(np.int64)  # a marker opens the stage after it
    real = ~is_marker & (np.array(graph.kinds) != "output")
    counts = np.bincount(stage[real], minlength=num_stages)
    empty = [int(s) for s in np.flatnonzero(counts == 0)]
    if empty:
        opened = np.flatnonzero(is_marker)
        where = [_after(graph, real, int(opened[s - 1])) if s > 0 else "at the start of the forward" for s in empty]
        raise ValueError(f"stage(s) {empty} would hold no op: the pipe_split() markers that open them stand "
                         f"{', '.join(where)} with no op up to the next marker or the end; remove the extra markers")
    return stage


def _after(graph: OpGraph, real: np.ndarray, marker: int) -> str:
    """Where the marker at op index ``marker`` stands: after the last submodule that ran before it (or the last op,
    when only the root module's own code ran)."""
    before = [int(i) for i in np.flatnonzero(real[:marker])]
    named = [i for i in before if graph.modules[i]]
    if named:
        return f"after {graph.modules[named[-1]]}"
    return f"after op {graph.names[before[-1]]}" if before else "at the start"
