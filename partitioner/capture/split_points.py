"""The user's own split points: ``torch.distributed.pipelining.pipe_split()`` markers in a model's forward.

A model written for torch.distributed.pipelining marks its stage boundaries by calling ``pipe_split()``
between layers; the call is a no-op when the model runs eagerly, and the trace keeps it as an op of kind
``pippy._pipe_split`` with no inputs and no outputs. Such markers are the user's placement, as ``smp.partition``
blocks are: ``k`` markers make ``k + 1`` stages, cut in the order the forward runs (which is the order data
flows, so the stages are acyclic). :func:`partitioner.partition` honours them instead of searching; priced and
scored like any plan, under the method name ``"pipe_split"``.

As torch.distributed.pipelining does, a pipeline of fewer ranks than the markers' stages runs them as interleaved
virtual stages: ``k + 1`` stages on ``p`` ranks, ``(k + 1) / p`` per rank, stage ``s`` on rank ``s mod p``
(:func:`stages_on_ranks` checks the counts); a plan records its ranks under :data:`RANKS_KEY` then, and
:func:`stages_note` says so in its summary.
"""
from __future__ import annotations

import numpy as np

from .graph import OpGraph

__all__ = ["MARKER_KIND", "RANKS_KEY", "marker_count", "marker_stages", "stages_on_ranks", "stages_note"]

MARKER_KIND = "pippy._pipe_split"
RANKS_KEY = "pipeline_ranks"  # a plan's extra key: the ranks its stages run on, when fewer than its stages


def marker_count(graph: OpGraph) -> int:
    """How many ``pipe_split()`` markers the forward traced in ``graph`` called."""
    return sum(k == MARKER_KIND for k in graph.kinds)


def stages_on_ranks(graph: OpGraph, ranks: int) -> int | None:
    """The stages ``graph``'s ``pipe_split()`` markers make (None without markers), checked to run on a pipeline of
    ``ranks`` ranks: as many, or a multiple run as interleaved virtual stages (the same number on every rank). Any
    other count is an error that names the counts and the markers or pipeline degrees that would fit."""
    markers = marker_count(graph)
    stages = markers + 1
    if not markers or stages % ranks == 0:
        return stages if markers else None
    fits = [n for n in (stages - stages % ranks, stages - stages % ranks + ranks) if n > 1]
    degrees = [d for d in range(1, stages + 1) if stages % d == 0]
    raise ValueError(f"the model's {markers} pipe_split() marker(s) make {stages} stages, which a pipeline of {ranks} "
                     f"ranks cannot share: every rank runs the same number of stages (interleaved virtual stages "
                     f"when several), so the stages must be a multiple of {ranks}; add or remove markers to make "
                     f"{_either(fits)} stages ({_either([n - 1 for n in fits])} markers), or use a pipeline degree "
                     f"that divides {stages} ({_either(degrees)})")


def stages_note(method: str, num_stages: int, ranks: int | None) -> list[str]:
    """What a plan's summary says of where its stages come from and run, as lines: "4 stages from the model's 3
    pipe_split() markers" (a ``"pipe_split"`` plan), ", 2 per rank on 2 ranks (interleaved virtual stages)" when
    ``ranks`` (:data:`RANKS_KEY`) are fewer than the stages; none for a plan of one stage per rank, searched."""
    p = ranks if isinstance(ranks, int) and 0 < ranks < num_stages else None  # virtual stages
    if method != "pipe_split" and p is None:
        return []
    markers = num_stages - 1
    text = f"{num_stages} stages" + (f" from the model's {markers} pipe_split() marker{'s' * (markers != 1)}"
                                     if method == "pipe_split" else "")
    if p is not None:
        text += f", {num_stages // p} per rank on {p} rank{'s' * (p != 1)} (interleaved virtual stages)"
    return [text]


def _either(values: list[int]) -> str:
    """``[3, 6]`` as "3 or 6", ``[1, 2, 4]`` as "1, 2 or 4"."""
    words = [str(v) for v in values]
    return " or ".join([", ".join(words[:-1]), words[-1]] if len(words) > 1 else words)


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
