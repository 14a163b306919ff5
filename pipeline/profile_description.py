"""A profiled run described and predicted: what ``profile.json`` holds, and the simulator's view of it.

The profile directory (:mod:`pipeline.profiler`) describes the run beside its trace: the pipelines, the
compute schedule every rank walked (its action names), the plan, and the predicted transfer seconds per
stage edge. From that description the schedule is rebuilt and replayed by :func:`pipeline.step_model.predict_step`
with the plan's stage times (the prediction) or with measured ones; :func:`write_gantt` draws a measured
step above the prediction of the same step.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from partitioner import DeviceRates
from pipeline.schedule import Action, Schedule
from pipeline.simulate import SimResult, compute_only
from pipeline.step_model import plan_edges, predict_step
from pipeline.timeline import Counter, Event, to_png_panels

__all__ = ["run_description", "merge", "schedule_of", "predict", "write_gantt", "TRACE_FILE",
           "PROFILE_FILE", "GRAPH_FILE", "TIMELINE_FILE"]

TRACE_FILE = "trace.json"
PROFILE_FILE = "profile.json"
GRAPH_FILE = "graph.npz"
TIMELINE_FILE = "timeline.png"


def run_description(runner: Any) -> dict[str, Any]:
    """What ``profile.json`` says about a :class:`pipeline.PipelineRunner`'s run: its pipelines, the compute
    schedule every rank walks (action names per rank), the plan, the predicted transfer seconds per stage
    edge (the plan's link rates), and, under ``"graph"``, the op graph (written as ``graph.npz``)."""
    plan, schedule = runner.plan, compute_only(runner.schedule)
    return {
        "pipelines": [list(p) for p in runner.pipelines],
        "schedule": {"name": schedule.name, "num_ranks": schedule.num_ranks, "num_stages": schedule.num_stages,
                     "microbatches": schedule.microbatches, "stage_to_rank": list(schedule.stage_to_rank),
                     "split_backward": schedule.split_backward,
                     "actions": [[str(a) for a in order] for order in schedule.actions]},
        "plan": plan.to_dict(),
        "edges": plan_edges(plan, plan.graph),
        "graph": plan.graph,
    }


def merge(parts: list[dict[str, Any]]) -> tuple[list[Event], list[Counter]]:
    """The events and counters of every rank's part (:meth:`Profiler.gather`), on rank 0's time axis."""
    events = [Event(p["rank"], *span) for p in parts for span in p["events"]]
    counters = [Counter(p["rank"], name, t, values) for p in parts for name, t, values in p["counters"]]
    return events, counters


def schedule_of(info: dict[str, Any]) -> Schedule:
    """The compute schedule a description holds (the lists every rank walked, without sends and receives)."""
    s = info["schedule"]
    return Schedule(s["name"], s["num_ranks"], s["num_stages"], s["microbatches"], list(s["stage_to_rank"]),
                    [[Action.parse(a) for a in order] for order in s["actions"]], s["split_backward"])


def predict(info: dict[str, Any], forward_s: Sequence[float] | None = None,
            backward_s: Sequence[float] | None = None) -> SimResult:
    """The described step predicted by :func:`pipeline.step_model.predict_step` from the plan's stage times (or
    the ones given, per stage), its transfer times and its rates."""
    stages = info["plan"]["stages"]
    edges = info["edges"]
    return predict_step(schedule_of(info), forward_s if forward_s is not None else [s["forward_s"] for s in stages],
                        backward_s if backward_s is not None else [s["backward_s"] for s in stages],
                        DeviceRates.from_dict(info["plan"].get("rates")), comm_s={(s, t): c for s, t, c in edges},
                        stage_deps=[(s, t) for s, t, _ in edges] or None)


def write_gantt(events: Sequence[Event], info: dict[str, Any], path: str) -> None:
    """A PNG of one measured step (the median one on rank 0: the passes and receive waits of every rank of
    the first pipeline) above the simulator's prediction of the same step."""
    steps = sorted((e.duration, e.action) for e in events if e.cat == "step" and e.rank == 0)
    if not steps:
        raise ValueError("no step was recorded: nothing to draw")
    duration, name = steps[len(steps) // 2]
    window = {e.rank: (e.start, e.end) for e in events if e.cat == "step" and e.action == name}
    ranks = set(info["pipelines"][0])
    shown = [e for e in events if e.rank in ranks and e.rank in window and e.thread == 0 and e.cat in ("", "wait")
             and e.action != "wait sends" and window[e.rank][0] <= e.start and e.end <= window[e.rank][1]]
    sim = predict(info)
    more = " (the first pipeline)" if len(info["pipelines"]) > 1 else ""
    to_png_panels([(f"measured: {name}{more}, {duration * 1e3:.1f} ms; receive waits in red", shown),
                   (f"predicted by the simulator from the plan: {sim.step_s * 1e3:.1f} ms, bubble {sim.bubble:.0%}",
                    sim.events)], path)
