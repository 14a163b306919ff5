"""Timelines: recording spans, Chrome-trace round trip, PNG Gantt charts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.schedule import Action, make_schedule, zero_bubble_h1
from pipeline.simulate import simulate
from pipeline.timeline import Event, Recorder, load_events, to_chrome_trace, to_png, to_text


@pytest.fixture(scope="module")
def events() -> list[Event]:
    return simulate(zero_bubble_h1(4, 8), 1e-3, 2e-3).events


def test_recorder_records_spans_in_order() -> None:
    recorder = Recorder(rank=3)
    with recorder.span(Action("F", 1, 0)):
        pass
    with pytest.raises(RuntimeError), recorder.span("B0@s1"):
        raise RuntimeError("a failed pass still shows up in the trace")
    first, second = recorder.events
    assert (first.rank, first.action, second.action) == (3, "F0@s1", "B0@s1")
    assert first.start <= first.end <= second.start <= second.end


def test_chrome_trace_round_trip(events: list[Event], tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    doc = to_chrome_trace(events, path)
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(events)
    assert {e["tid"] for e in spans} == {0, 1, 2, 3}
    assert {e["cat"] for e in spans} == {"F", "B", "W"}
    assert spans[0]["name"] == events[0].action and spans[0]["pid"] == 0
    assert json.loads(path.read_text()) == doc
    loaded = load_events(path)
    assert [(e.rank, e.action) for e in loaded] == [(e.rank, e.action) for e in events]
    assert [t for e in loaded for t in (e.start, e.end)] == pytest.approx([t for e in events for t in (e.start, e.end)])


def test_load_events_rejects_other_json(tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="is not a Chrome trace"):
        load_events(path)


def test_png_is_a_real_image(events: list[Event], tmp_path: Path) -> None:
    path = tmp_path / "timeline.png"
    to_png(events, path, title="ZB-H1, p=4, m=8")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5_000


def test_png_accepts_non_action_spans(tmp_path: Path) -> None:
    path = tmp_path / "mixed.png"
    to_png([Event(0, "F0@s0", 0.0, 1.0), Event(0, "optimizer", 1.0, 2.0)], path)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_png_needs_events(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one event"):
        to_png([], tmp_path / "empty.png")


def test_recorder_keeps_categories_threads_counters_and_costs() -> None:
    import threading

    ticks = iter(range(100))
    recorder = Recorder(rank=1, clock=lambda: float(next(ticks)), cost_clock=lambda: 0.5)
    with recorder.span("F0@s0"):
        with recorder.span("wait F0@s0", "wait"):
            pass
    worker = threading.Thread(target=lambda: recorder.add("loss", 7.0, 8.0, "user"))
    worker.start()
    worker.join()
    recorder.counter("memory", {"rss_bytes": 5.0})
    wait, span, loss = recorder.events
    assert (wait.cat, wait.start, wait.end, wait.cost) == ("wait", 1.0, 2.0, None)  # nested, ends first
    assert (span.cat, span.duration, span.cost, span.thread) == ("", 3.0, 0.0, 0)  # passes also get a cost
    assert (loss.thread, loss.cat) == (1, "user")  # another thread: the rank's second track
    assert recorder.counters[0].values == {"rss_bytes": 5.0}


def test_chrome_trace_round_trip_with_counters_threads_and_metadata(tmp_path: Path) -> None:
    from pipeline.timeline import THREAD_TID, Counter, load_trace

    events = [Event(2, "F0@s1", 0.0, 1.0, cost=0.5), Event(2, "wait F0@s1", 0.0, 0.5, "wait"),
              Event(2, "loss", 0.2, 0.3, "user", thread=1)]
    counters = [Counter(2, "memory", 1.0, {"rss_bytes": 3.0})]
    doc = to_chrome_trace(events, tmp_path / "t.json", counters=counters, metadata={"note": 1})
    assert {e["tid"] for e in doc["traceEvents"] if e["ph"] == "X"} == {2, 2 + THREAD_TID}
    assert doc["otherData"] == {"note": 1}
    got, got_counters, meta = load_trace(tmp_path / "t.json")
    assert got == events and got_counters == counters and meta == {"note": 1}


def test_png_panels_share_one_time_scale(events: list[Event], tmp_path: Path) -> None:
    from pipeline.timeline import to_png_panels

    path = tmp_path / "panels.png"
    waits = [Event(0, "wait F0@s0", 0.0, 5e-4, "wait")]
    to_png_panels([("measured", events[:20] + waits), ("predicted", events)], path)
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="at least one event"):
        to_png_panels([("empty", [])], path)


def test_text_timeline_draws_each_pass_where_it_runs() -> None:
    """1F1B on 2 ranks, backward twice the forward: rank 1 starts one forward late, and each rank's row holds
    every microbatch's forward (digit) before its backward (letter)."""
    text = to_text(simulate(make_schedule("1f1b", 2, 4), 1e-3, 2e-3).events, width=48)
    rows = text.splitlines()
    assert [r[:9] for r in rows] == ["rank  0 |", "rank  1 |"] and all(len(r) == 9 + 48 + 1 for r in rows)
    zero, one = rows[0][9:-1], rows[1][9:-1]
    assert zero.startswith("000111") and one.startswith("...000")
    for row in (zero, one):
        for k, letter in zip("0123", "abcd"):
            assert row.index(k) < row.index(letter)
    assert set(zero + one) == set("0123abcd.")


def test_text_timeline_marks_weight_grads_and_other_spans(events: list[Event]) -> None:
    assert "w" in to_text(events)  # ZB-H1 splits out the weight gradients
    spans = [Event(0, "optimizer", 0.0, 1.0), Event(1, "F12@s1", 0.5, 1.0)]
    assert to_text(spans, width=10) == "rank  0 |##########|\nrank  1 |.....22222|"
    assert to_text([]) == ""
