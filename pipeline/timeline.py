"""Pipeline timelines: recording per-rank action spans and drawing them.

The picture is the space-time diagram that GPipe (Huang et al. 2019, arXiv:1811.06965, Fig. 2) and
1F1B (Narayanan et al. 2021, arXiv:2006.09503) use to show pipeline bubbles: one row per rank,
one bar per forward (F), backward (B) or weight-grad (W, Qi et al. 2023, arXiv:2401.10241) pass.
The same ``Event`` list comes from real runs (``Recorder``) and from ``pipeline.simulate``, and
goes out as a Chrome trace (opens in Perfetto / chrome://tracing), a PNG Gantt chart, or text for a
terminal.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from time import perf_counter
from typing import Any

from .schedule import Action

__all__ = ["Event", "Recorder", "to_chrome_trace", "to_png", "to_text", "load_events"]

_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
_OTHER_COLOUR = "#8C8C8C"  # spans whose name is not an action, e.g. "optimizer"
_LABELS = {"F": "forward", "B": "backward", "W": "weight grad"}
_BACKWARD_LETTERS = "abcdefghij"  # microbatch k's backward in to_text, k mod 10


@dataclass(frozen=True)
class Event:
    """``rank`` ran ``action`` (e.g. "F3@s1") from ``start`` to ``end`` seconds."""

    rank: int
    action: str
    start: float
    end: float


class Recorder:
    """Records spans of one rank during a real run.

    Only ``perf_counter`` and a tuple append happen inside the run; ``Event`` objects are built when
    ``events`` is read.  ``perf_counter`` is CLOCK_MONOTONIC on Linux, so ranks on one host share a
    time base.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._spans: list[tuple[str, float, float]] = []

    @contextmanager
    def span(self, action: str | Action) -> Iterator[None]:
        """Record the enclosed block as one event named ``str(action)``."""
        start = perf_counter()
        try:
            yield
        finally:
            self._spans.append((str(action), start, perf_counter()))

    @property
    def events(self) -> list[Event]:
        return [Event(self.rank, name, start, end) for name, start, end in self._spans]


def _kind_and_label(action: str) -> tuple[str, str]:
    """("F"/"B"/"W", microbatch) for action names like "F3@s1"; ("", name) for anything else."""
    try:
        parsed = Action.parse(action)
    except ValueError:
        return "", action
    return parsed.kind, str(parsed.microbatch)


def to_chrome_trace(events: Sequence[Event], path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Chrome trace-event JSON: one complete ("X") event per span, microseconds, thread = rank.

    Written to ``path`` when given; open it in https://ui.perfetto.dev or chrome://tracing.
    """
    trace: list[dict[str, Any]] = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}}
        for rank in sorted({e.rank for e in events})
    ]
    trace += [
        {
            "name": e.action,
            "cat": _kind_and_label(e.action)[0] or "other",
            "ph": "X",
            "ts": e.start * 1e6,
            "dur": (e.end - e.start) * 1e6,
            "pid": 0,
            "tid": e.rank,
        }
        for e in events
    ]
    doc = {"traceEvents": trace, "displayTimeUnit": "ms"}
    if path is not None:
        with open(path, "w") as f:
            json.dump(doc, f)
    return doc


def load_events(path: str | os.PathLike[str]) -> list[Event]:
    """Events back from a Chrome trace written by ``to_chrome_trace`` (other phases are skipped)."""
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or "traceEvents" not in doc:
        raise ValueError(f"{path} is not a Chrome trace: expected a JSON object with 'traceEvents'")
    return [
        Event(int(e["tid"]), e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
        for e in doc["traceEvents"]
        if e.get("ph") == "X"
    ]


def to_png(events: Sequence[Event], path: str | os.PathLike[str], title: str | None = None) -> None:
    """Gantt chart of ``events``: one row per rank (rank 0 on top), F/B/W in different colours,
    the microbatch number inside each bar wide enough to hold it."""
    # Imported here because matplotlib is optional (the "viz" extra).  Figure + Agg canvas
    # directly: no pyplot global state, works headless and in threads.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if not events:
        raise ValueError("to_png needs at least one event; record or simulate a step first")
    origin = min(e.start for e in events)
    span = max(e.end for e in events) - origin or 1.0
    ranks = sorted({e.rank for e in events})
    row = {rank: i for i, rank in enumerate(ranks)}
    width_in, height_in = 12.0, min(0.45 * len(ranks), 24.0)  # rows get thinner past ~50 ranks
    fig = Figure(figsize=(width_in, 1.0 + height_in), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    parsed = [_kind_and_label(e.action) for e in events]
    bars: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for e, (kind, _) in zip(events, parsed):
        bars[row[e.rank], kind].append((e.start - origin, e.end - e.start))
    # The axes take roughly 0.8 of the figure; a 7 pt character is about 6 px wide, 10 px tall at 120 dpi.
    px_per_s = 0.8 * width_in * fig.dpi / span
    # White separators help between wide bars but wash out bars only a few pixels wide.
    mean_px = sum(e.end - e.start for e in events) / len(events) * px_per_s
    edge = {"edgecolor": "white", "linewidth": 0.3} if mean_px >= 4 else {"linewidth": 0}
    for (y, kind), spans in bars.items():  # one call per row and kind: fast for big traces
        ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=_COLOURS.get(kind, _OTHER_COLOUR), **edge)
    if 0.8 * height_in * fig.dpi / len(ranks) >= 10:
        for e, (_, label) in zip(events, parsed):
            if (e.end - e.start) * px_per_s >= 6 * len(label) + 4:
                x = (e.start + e.end) / 2 - origin
                ax.text(x, row[e.rank], label, ha="center", va="center", fontsize=7, color="white")
    shown = range(0, len(ranks), -(-len(ranks) // 32))  # at most 32 rank labels
    ax.set_yticks(list(shown), [f"rank {ranks[i]}" for i in shown])
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_xlabel("seconds")
    present = {kind for _, kind in bars}
    kinds = [k for k in ("F", "B", "W", "") if k in present]
    ax.legend(
        handles=[Patch(color=_COLOURS.get(k, _OTHER_COLOUR), label=_LABELS.get(k, "other")) for k in kinds],
        loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(kinds), frameon=False, fontsize=8,
    )
    if title:
        ax.set_title(title, loc="left")
    fig.savefig(path, format="png", bbox_inches="tight")


def to_text(events: Sequence[Event], width: int = 96) -> str:
    """The space-time diagram as text, one row per rank (rank 0 first), time left to right in ``width``
    columns: the digit k is a forward of microbatch k (mod 10), the letter a-j its backward, ``w`` a
    weight-gradient pass, ``#`` any other span, ``.`` idle. Sends and receives are instants and not drawn.

        rank  0 |0011..aabb..|
        rank  1 |..0011aabb..|

    Returns "" when there is nothing to draw."""
    if not events:
        return ""
    origin = min(e.start for e in events)
    span = max(e.end for e in events) - origin
    if span <= 0:
        return ""
    ranks = sorted({e.rank for e in events})
    rows = {rank: ["."] * width for rank in ranks}
    for e in events:
        kind, label = _kind_and_label(e.action)
        if kind in ("F", "B", "W"):
            mb = int(label) % 10
            ch = str(mb) if kind == "F" else _BACKWARD_LETTERS[mb] if kind == "B" else "w"
        elif kind:
            continue  # a transfer
        else:
            ch = "#"
        a = int(round((e.start - origin) / span * width))
        b = max(a + 1, int(round((e.end - origin) / span * width)))
        rows[e.rank][a:min(b, width)] = [ch] * (min(b, width) - a)
    return "\n".join(f"rank {r:>2} |{''.join(rows[r])}|" for r in ranks)
