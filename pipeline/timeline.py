"""Pipeline timelines: recording per-rank action spans and drawing them.

The picture is the space-time diagram that GPipe (Huang et al. 2019, arXiv:1811.06965, Fig. 2) and
1F1B (Narayanan et al. 2021, arXiv:2006.09503) use to show pipeline bubbles: one row per rank,
one bar per forward (F), backward (B) or weight-grad (W, Qi et al. 2023, arXiv:2401.10241) pass.
The same ``Event`` list comes from real runs (``Recorder``, which also keeps ``Counter`` samples such as
memory, and the waits, sends and steps around the passes) and from ``pipeline.simulate``, and goes out as
a Chrome trace (opens in Perfetto / chrome://tracing), a PNG Gantt chart (one or more panels on one time
scale: a measured step above its simulated prediction), or text for a terminal.
"""

from __future__ import annotations

import json
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from types import TracebackType
from typing import Any

from pipeline.schedule import Action

__all__ = ["Event", "Counter", "Recorder", "to_chrome_trace", "to_png", "to_png_panels", "to_text", "load_events",
           "load_trace", "THREAD_TID"]

_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "wait": "#C44E52"}
_OTHER_COLOUR = "#8C8C8C"  # spans whose name is not an action, e.g. "optimizer"
_LABELS = {"F": "forward", "B": "backward", "W": "weight grad", "wait": "receive wait"}
# A rank's events from other threads than its pipeline's (the @smp.step function's) get their own track:
# Chrome-trace tid = rank + thread * THREAD_TID, so they never overlap the pipeline's nested spans.
THREAD_TID = 1 << 20
_BACKWARD_LETTERS = "abcdefghij"  # microbatch k's backward in to_text, k mod 10


@dataclass(frozen=True)
class Event:
    """``rank`` ran ``action`` (e.g. "F3@s1") from ``start`` to ``end`` seconds.

    ``cat`` says what kind of span it is where the name does not ("wait", "step", "optimizer", ...; empty
    for a pass of the schedule); ``thread`` is 0 for the rank's pipeline thread, 1 for other threads.
    """

    rank: int
    action: str
    start: float
    end: float
    cat: str = ""
    thread: int = 0
    cost: float | None = None  # the pass's seconds on the recorder's cost clock (thread CPU time), if kept

    @property
    def duration(self) -> float:
        """``end - start`` in seconds."""
        return self.end - self.start


@dataclass(frozen=True)
class Counter:
    """Values sampled by ``rank`` at ``time`` under ``name`` (e.g. "memory": {"rss_bytes": ...})."""

    rank: int
    name: str
    time: float
    values: Mapping[str, float] = field(default_factory=dict)


class _Span:
    """The context manager of :meth:`Recorder.span`: two clock reads and one append (no generator), and two
    reads of the cost clock for a pass when the recorder keeps costs."""

    __slots__ = ("_recorder", "_name", "_cat", "_start", "_cost_clock", "_cost_start")

    def __init__(self, recorder: Recorder, name: str, cat: str) -> None:
        self._recorder, self._name, self._cat = recorder, name, cat
        self._cost_clock = recorder.cost_clock if not cat else None

    def __enter__(self) -> None:
        self._start = self._recorder.clock()
        if self._cost_clock is not None:
            self._cost_start = self._cost_clock()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        rec = self._recorder
        end = rec.clock()
        cost = None if self._cost_clock is None else self._cost_clock() - self._cost_start
        rec.add(self._name, self._start, end, self._cat, cost)


class Recorder:
    """Records spans and counters of one rank during a real run.

    Only two clock reads and a tuple append happen inside the run; ``Event`` objects are built when
    ``events`` is read.  The clock is ``perf_counter`` (CLOCK_MONOTONIC on Linux: ranks on one host share
    a time base; :mod:`pipeline.clock` aligns hosts). Spans recorded from another thread than the one
    that made the recorder land on that rank's second track (``Event.thread == 1``). ``detail`` tells the
    executor to record receive waits, sends and receives besides the passes; ``cost_clock`` (e.g. the
    thread's CPU time, :func:`partitioner.cost.calibration.cost_clock`) times the passes (spans without a category)
    a second time, robust to other processes on the cores (``Event.cost``).
    """

    def __init__(self, rank: int, clock: Callable[[], float] = perf_counter, detail: bool = True,
                 cost_clock: Callable[[], float] | None = None) -> None:
        self.rank = rank
        self.clock = clock
        self.detail = detail
        self.cost_clock = cost_clock
        main = threading.get_ident()
        self.thread: Callable[[], int] = lambda: 0 if threading.get_ident() == main else 1
        self._spans: list[tuple[str, str, float, float, int, float | None]] = []
        self._counters: list[tuple[str, float, dict[str, float]]] = []

    def span(self, action: str | Action, cat: str = "") -> _Span:
        """Record the enclosed block as one event named ``str(action)`` of category ``cat``."""
        return _Span(self, str(action), cat)

    def add(self, name: str, start: float, end: float, cat: str = "", cost: float | None = None) -> None:
        """Record a span whose times were taken elsewhere (on this recorder's clock); ``cost``: the time the
        cost clock counted in it, if one runs."""
        self._spans.append((name, cat, start, end, self.thread(), cost))

    def counter(self, name: str, values: Mapping[str, float]) -> None:
        """Record ``values`` (e.g. memory in bytes) under ``name`` at this moment."""
        self._counters.append((name, self.clock(), dict(values)))

    @property
    def events(self) -> list[Event]:
        """Every span recorded so far, in the order they ended."""
        return [Event(self.rank, name, start, end, cat, thread, cost)
                for name, cat, start, end, thread, cost in self._spans]

    @property
    def counters(self) -> list[Counter]:
        """Every counter sample recorded so far."""
        return [Counter(self.rank, name, t, values) for name, t, values in self._counters]


def _kind_and_label(action: str) -> tuple[str, str]:
    """("F"/"B"/"W", microbatch) for action names like "F3@s1"; ("", name) for anything else."""
    try:
        parsed = Action.parse(action)
    except ValueError:
        return "", action
    return parsed.kind, str(parsed.microbatch)


def to_chrome_trace(events: Sequence[Event], path: str | os.PathLike[str] | None = None, *,
                    counters: Sequence[Counter] = (), metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Chrome trace-event JSON: one complete ("X") event per span, microseconds, thread = rank (plus
    ``THREAD_TID`` per other thread), a counter ("C") event per sample, ``metadata`` as ``otherData``.

    Written to ``path`` when given; open it in https://ui.perfetto.dev or chrome://tracing.
    """
    tracks = sorted({(e.rank, e.thread) for e in events} | {(c.rank, 0) for c in counters})
    trace: list[dict[str, Any]] = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": rank + thread * THREAD_TID,
         "args": {"name": f"rank {rank}" if not thread else f"rank {rank} (step function)"}}
        for rank, thread in tracks
    ]
    trace += [
        {
            "name": e.action,
            "cat": e.cat or _kind_and_label(e.action)[0] or "other",
            "ph": "X",
            "ts": e.start * 1e6,
            "dur": (e.end - e.start) * 1e6,
            "pid": 0,
            "tid": e.rank + e.thread * THREAD_TID,
            **({"args": {"cost_s": e.cost}} if e.cost is not None else {}),
        }
        for e in events
    ]
    trace += [{"name": f"rank {c.rank} {c.name}", "ph": "C", "ts": c.time * 1e6, "pid": 0, "tid": c.rank,
               "args": dict(c.values)} for c in counters]
    doc: dict[str, Any] = {"traceEvents": trace, "displayTimeUnit": "ms"}
    if metadata is not None:
        doc["otherData"] = dict(metadata)
    if path is not None:
        with open(path, "w") as f:
            json.dump(doc, f)
    return doc


def load_trace(path: str | os.PathLike[str]) -> tuple[list[Event], list[Counter], dict[str, Any]]:
    """Events, counters and metadata back from a Chrome trace written by ``to_chrome_trace``."""
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or "traceEvents" not in doc:
        raise ValueError(f"{path} is not a Chrome trace: expected a JSON object with 'traceEvents'")
    events = []
    counters = []
    for e in doc["traceEvents"]:
        if e.get("ph") == "X":
            cat = e.get("cat", "")
            thread, rank = divmod(int(e["tid"]), THREAD_TID)
            events.append(Event(rank, e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6,
                                "" if cat in ("F", "B", "W", "other") else cat, thread,
                                e.get("args", {}).get("cost_s")))
        elif e.get("ph") == "C":
            rank = int(e["tid"])
            counters.append(Counter(rank, e["name"].removeprefix(f"rank {rank} "), e["ts"] / 1e6, e["args"]))
    return events, counters, dict(doc.get("otherData", {}))


def load_events(path: str | os.PathLike[str]) -> list[Event]:
    """Events back from a Chrome trace written by ``to_chrome_trace`` (other phases are skipped)."""
    return load_trace(path)[0]


def to_png(events: Sequence[Event], path: str | os.PathLike[str], title: str | None = None) -> None:
    """Gantt chart of ``events``: one row per rank (rank 0 on top), F/B/W in different colours,
    the microbatch number inside each bar wide enough to hold it; receive waits (``cat == "wait"``,
    nested in the pass that waited) drawn over their pass."""
    to_png_panels([(title, events)], path)


def to_png_panels(panels: Sequence[tuple[str | None, Sequence[Event]]], path: str | os.PathLike[str]) -> None:
    """Gantt charts of several event lists, one above the other on one time scale (seconds from each
    panel's first event), e.g. a measured step above the simulator's prediction of it."""
    # Imported here because matplotlib is optional (the "viz" extra).  Figure + Agg canvas
    # directly: no pyplot global state, works headless and in threads.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not panels or any(not events for _, events in panels):
        raise ValueError("to_png needs at least one event; record or simulate a step first")
    span = max(max(e.end for e in ev) - min(e.start for e in ev) for _, ev in panels) or 1.0
    rows = [len({e.rank for e in ev}) for _, ev in panels]
    width_in = 12.0
    heights = [min(0.45 * n, 24.0) + 0.6 for n in rows]  # rows get thinner past ~50 ranks
    fig = Figure(figsize=(width_in, 0.4 + sum(heights)), dpi=120)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, (title, events), height in zip(axes, panels, heights):
        _gantt(ax, events, span, width_in * fig.dpi, (height - 0.6) * fig.dpi)
        if title:
            ax.set_title(title, loc="left")
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, format="png", bbox_inches="tight")


def _gantt(ax: Any, events: Sequence[Event], span: float, width_px: float, height_px: float) -> None:
    """Draw ``events`` on ``ax``: one row per rank, bars coloured by kind, waits on top of their passes."""
    from matplotlib.patches import Patch

    origin = min(e.start for e in events)
    ranks = sorted({e.rank for e in events})
    row = {rank: i for i, rank in enumerate(ranks)}
    parsed = [("wait", "") if e.cat == "wait" else _kind_and_label(e.action) for e in events]
    bars: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for e, (kind, _) in zip(events, parsed):
        bars[row[e.rank], kind].append((e.start - origin, e.end - e.start))
    # The axes take roughly 0.8 of the figure; a 7 pt character is about 6 px wide, 10 px tall at 120 dpi.
    px_per_s = 0.8 * width_px / span
    # White separators help between wide bars but wash out bars only a few pixels wide.
    mean_px = sum(e.end - e.start for e in events) / len(events) * px_per_s
    edge = {"edgecolor": "white", "linewidth": 0.3} if mean_px >= 4 else {"linewidth": 0}
    # One call per row and kind (fast for big traces); waits last, so they show over the pass they are in.
    for (y, kind), spans in sorted(bars.items(), key=lambda item: item[0][1] == "wait"):
        ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=_COLOURS.get(kind, _OTHER_COLOUR), **edge)
    if 0.8 * height_px / len(ranks) >= 10:
        for e, (kind, label) in zip(events, parsed):
            if kind != "wait" and (e.end - e.start) * px_per_s >= 6 * len(label) + 4:
                x = (e.start + e.end) / 2 - origin
                ax.text(x, row[e.rank], label, ha="center", va="center", fontsize=7, color="white")
    shown = range(0, len(ranks), -(-len(ranks) // 32))  # at most 32 rank labels
    ax.set_yticks(list(shown), [f"rank {ranks[i]}" for i in shown])
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(0, span)
    present = {kind for _, kind in bars}
    kinds = [k for k in ("F", "B", "W", "wait", "") if k in present]
    ax.legend(
        handles=[Patch(color=_COLOURS.get(k, _OTHER_COLOUR), label=_LABELS.get(k, "other")) for k in kinds],
        loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(kinds), frameon=False, fontsize=8,
    )

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
