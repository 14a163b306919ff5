"""What a profile measured: per step and rank where the time went, per stage what a microbatch cost, and
what the plan and the simulator had predicted for the same run.

A profile (:mod:`pipeline.profiler`) is a list of spans on one time axis. Each span is assigned to the step
whose span contains it, on its rank. A pass's compute time is its span minus the receive wait nested in
it. A receive wait is split in two. The part before the peer started sending is a *dependency* wait: the
peer was still busy (pipeline fill and drain, an imbalance). The part after is the transfer. A rank's
*communication* time is its transfers plus the time it spent posting sends and receives and waiting for
its sends to complete. ``idle`` is the rest of the step: dependency waits, the engine's own work around
the passes, and the broadcast of the step's results.

A stage's *cost* per microbatch is the median of its passes on the recorder's cost clock: the thread's CPU
time on a CPU with one intra-op thread (what :func:`partitioner.measure` times ops with, unmoved by other
processes on the cores), else the wall-clock compute. Straggling is wall-clock: the same work taking longer.

The measured bubble is the simulator's definition applied to the real run: ``1 - sum(compute) /
(ranks * makespan)`` over one pipeline's passes. The simulator (:func:`pipeline.simulate.simulate`) replays
the same schedule twice: once with the plan's stage times (the *prediction*) and once with the measured
ones (what the schedule alone explains).

Throughput is what every step counted (the pipeline's ``throughput`` counter: seconds, samples, tokens, model
FLOPs, devices) turned into rates by :func:`partitioner.cost.throughput.from_counts`, the definition the run's own
figures use, against the peak of the device profile the plan was priced for.
"""
from __future__ import annotations

import bisect
import json
import os
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from partitioner import PartitionPlan
from partitioner.cost.throughput import Throughput, from_counts, peak_flops_per_s
from partitioner.errors import EngineError
from pipeline.profile_description import PROFILE_FILE, TRACE_FILE, predict, schedule_of
from pipeline.schedule import Action, Schedule
from pipeline.simulate import SimResult
from pipeline.timeline import Counter, Event, load_trace
from smp.profiling.system_samples import SystemSamples, step_memory, system_samples

__all__ = ["Phases", "Measurements", "load_profile", "measure", "recorded_throughput", "ProfileError"]


class ProfileError(EngineError, FileNotFoundError):
    """A directory that holds no profile, or one this version cannot read."""


@dataclass
class Phases:
    """Where one rank's time went in one step (seconds). ``data_s`` is the time between the previous step
    and this one, without the optimizer step (0 for the first step of a window)."""

    step_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    comm_s: float = 0.0        # transfers (receive waits after the peer had sent), posting sends and receives
    wait_s: float = 0.0        # all receive waits (dependency and transfer) and the final wait for sends
    data_s: float = 0.0
    optimizer_s: float = 0.0

    @property
    def compute_s(self) -> float:
        """Forward plus backward compute."""
        return self.forward_s + self.backward_s

    @property
    def idle_s(self) -> float:
        """The step's time neither computing nor communicating."""
        return max(self.step_s - self.compute_s - self.comm_s, 0.0)

    @property
    def outside_s(self) -> float:
        """The step's time outside its passes and receive waits: the engine's own work (on the run's first step,
        tracing and partitioning the model), sharing the step's arguments and results, posting sends."""
        return max(self.step_s - self.compute_s - self.wait_s, 0.0)

    @property
    def iteration_s(self) -> float:
        """The whole training iteration: the gap before the step, the optimizer and the step."""
        return self.data_s + self.optimizer_s + self.step_s


@dataclass
class Measurements:
    """Everything the report and the re-planner read from one profile."""

    info: dict[str, Any]
    plan: PartitionPlan
    schedule: Schedule
    events: list[Event]
    steps: list[int]
    ranks: list[int]
    phases: dict[tuple[int, int], Phases]          # (step, rank) -> phases
    stage_forward_s: list[float]                    # per stage, median forward cost per microbatch
    stage_backward_s: list[float]                   # per stage, median backward (B + W) cost per microbatch
    rank_stage_s: dict[int, dict[int, float]]       # rank -> stage -> its median wall compute per microbatch
    bubble: dict[int, float]                        # step -> measured bubble (median over pipelines)
    predicted: SimResult                            # the schedule under the plan's stage times
    replayed: SimResult                             # the schedule under the measured stage times
    memory: dict[int, dict[str, float]] = field(default_factory=dict)  # rank -> peak per counter value
    step_memory: dict[int, dict[str, list[float]]] = field(default_factory=dict)  # rank -> value -> per step
    system: dict[int, SystemSamples] = field(default_factory=dict)  # rank -> its system monitor's samples
    throughput: list[Throughput] = field(default_factory=list)  # per profiled step, in order (the same on every rank)

    @property
    def stage_cost_s(self) -> list[float]:
        """Measured compute per microbatch of each stage (forward + backward)."""
        return [f + b for f, b in zip(self.stage_forward_s, self.stage_backward_s)]

    @property
    def planned_cost_s(self) -> list[float]:
        """The plan's predicted compute per microbatch of each stage (forward + backward)."""
        return [s.forward_s + s.backward_s for s in self.plan.stages]

    def pipeline_of(self, rank: int) -> int:
        """Index of the pipeline (data-parallel replica) ``rank`` belongs to."""
        return next(i for i, p in enumerate(self.info["pipelines"]) if rank in p)

    def position(self, rank: int) -> int:
        """``rank``'s position in its pipeline (its pipeline rank)."""
        return self.info["pipelines"][self.pipeline_of(rank)].index(rank)

    def stages_of(self, rank: int) -> list[int]:
        """The stages ``rank`` runs."""
        return self.schedule.stages_of(self.position(rank))

    def median_phase(self, rank: int, name: str) -> float:
        """The median over steps of one phase (an attribute of :class:`Phases`) on ``rank``."""
        values = [getattr(self.phases[s, rank], name) for s in self.steps if (s, rank) in self.phases]
        return statistics.median(values) if values else 0.0

    def data_ratios(self) -> dict[int, float]:
        """Per rank, the time between steps (data loading, the loop's code; the optimizer step left out) as a
        share of its step time, over the steps after the window's first (which has no gap before it)."""
        first = min(self.steps, default=0)
        ratios = {}
        for r in self.ranks:
            steps = [s for s in self.steps if s != first and (s, r) in self.phases]
            busy = sum(self.phases[s, r].step_s for s in steps)
            if steps and busy > 0:
                ratios[r] = sum(self.phases[s, r].data_s for s in steps) / busy
        return ratios

    @property
    def overhead(self) -> float:
        """The largest fraction of its profiled time any rank spent recording (measured after the window)."""
        return max((r["overhead"]["fraction"] for r in self.info.get("ranks", {}).values()), default=0.0)


def load_profile(directory: str | os.PathLike[str]) -> Measurements:
    """Read a profile directory written by :mod:`pipeline.profiler` and :func:`measure` it."""
    trace, meta = os.path.join(directory, TRACE_FILE), os.path.join(directory, PROFILE_FILE)
    if not (os.path.exists(trace) and os.path.exists(meta)):
        raise ProfileError(f"{os.fspath(directory)} holds no profile ({TRACE_FILE} and {PROFILE_FILE}): profile a "
                           "run first, with the smp config key \"profile\": {\"dir\": ...}, `with smp.profile(dir):` "
                           "or PipelineRunner(record=dir)")
    with open(meta) as f:
        info = json.load(f)
    if info.get("version") != 1:
        raise ProfileError(f"{meta} has version {info.get('version')!r}; this smp reads version 1")
    events, counters, _ = load_trace(trace)
    return measure(events, counters, info)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def measure(events: list[Event], counters: list[Counter], info: dict[str, Any]) -> Measurements:
    """The measurements of a run's ``events`` (on one time axis), ``counters`` and ``info`` (profile.json)."""
    plan = PartitionPlan.from_dict(info["plan"])
    schedule = schedule_of(info)
    n = schedule.num_stages
    by_rank: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        by_rank[e.rank].append(e)
    # When each message left its sender, to split the receive waits in two.
    pipelines = info["pipelines"]
    pipeline_of = {r: i for i, p in enumerate(pipelines) for r in p}
    placed = {rank: _by_step(evs) for rank, evs in by_rank.items()}
    sent: dict[tuple[int, int, str, int, int], float] = {}  # (step, pipeline, kind, microbatch, to stage)
    for rank, evs in placed.items():
        for step, e in evs:
            if e.cat == "comm" and e.action.startswith("SEND"):
                a = Action.parse(e.action)
                key = (step, pipeline_of[rank], a.kind[-1], a.microbatch, a.peer)
                sent[key] = max(sent.get(key, e.start), e.start)
    phases: dict[tuple[int, int], Phases] = {}
    samples: dict[tuple[str, int], list[float]] = defaultdict(list)        # (kind, stage) -> compute seconds
    per_rank: dict[tuple[int, str, int], list[float]] = defaultdict(list)  # (rank, kind, stage) -> seconds
    spans: dict[tuple[int, int, int], list[tuple[float, float, float]]] = defaultdict(list)  # (step, pipe, rank)
    for rank, evs in placed.items():
        waits = {(step, e.action[5:]): e for step, e in evs if e.cat == "wait" and e.thread == 0}
        for step, e in evs:
            ph = phases.setdefault((step, rank), Phases())
            if e.cat == "step":
                ph.step_s = e.duration
            elif e.cat == "between":
                ph.data_s += e.duration
            elif e.cat == "optimizer":
                ph.optimizer_s += e.duration
            elif e.cat == "comm":
                ph.comm_s += e.duration
            elif e.cat == "wait":
                ph.wait_s += e.duration
                if e.action == "wait sends":
                    ph.comm_s += e.duration
                else:
                    a = Action.parse(e.action[5:])
                    sent_at = sent.get((step, pipeline_of[rank], a.kind, a.microbatch, a.stage))
                    if sent_at is not None:
                        ph.comm_s += max(e.end - max(e.start, sent_at), 0.0)
            elif not e.cat:
                a = Action.parse(e.action)
                wait = waits.get((step, e.action))
                compute = e.duration - (wait.duration if wait is not None else 0.0)
                if a.kind == "F":
                    ph.forward_s += compute
                else:
                    ph.backward_s += compute
                samples[a.kind, a.stage].append(e.cost if e.cost is not None else compute)
                per_rank[rank, a.kind, a.stage].append(compute)
                spans[step, pipeline_of[rank], rank].append((e.start, e.end, compute))
    for ph in phases.values():  # the optimizer ran in the gap before the step: the rest is data and user code
        ph.data_s = max(ph.data_s - ph.optimizer_s, 0.0)
    fwd = [_median(samples["F", s]) for s in range(n)]
    bwd = [_median(samples["B", s]) + _median(samples["W", s]) for s in range(n)]
    rank_stage: dict[int, dict[int, float]] = defaultdict(dict)
    for (r, _, s), values in sorted(per_rank.items()):
        rank_stage[r][s] = rank_stage[r].get(s, 0.0) + _median(values)
    bubble = _bubbles(spans, schedule.num_ranks)
    predicted, replayed = predict(info), predict(info, fwd, bwd)
    per_step = step_memory(counters)
    memory = {r: {k: max(v) for k, v in values.items()} for r, values in per_step.items()}
    return Measurements(info=info, plan=plan, schedule=schedule, events=events, steps=sorted({s for s, _ in phases}),
                        ranks=sorted(by_rank), phases=phases, stage_forward_s=fwd, stage_backward_s=bwd,
                        rank_stage_s=dict(rank_stage), bubble=bubble, predicted=predicted, replayed=replayed,
                        memory=memory, step_memory=per_step, system=system_samples(counters, info),
                        throughput=recorded_throughput(counters, plan))


def recorded_throughput(counters: list[Counter], plan: PartitionPlan) -> list[Throughput]:
    """The figures of every step that recorded a ``throughput`` counter, in step order, from one rank (the lowest:
    every rank of a pipeline records the same counts); empty for a profile without them."""
    mine = sorted((c for c in counters if c.name == "throughput"), key=lambda c: (c.rank, c.time))
    peak = peak_flops_per_s(plan)
    return [from_counts(c.values["seconds"], int(c.values["samples"]),
                        int(c.values["tokens"]) if "tokens" in c.values else None, c.values["model_flops"],
                        int(c.values["devices"]), peak) for c in mine if c.rank == mine[0].rank]


def _by_step(events: list[Event]) -> list[tuple[int, Event]]:
    """One rank's events with the step each belongs to: the step whose span holds it; what happened
    between two steps (the gap itself, the optimizer step, annotations) belongs to the step after it.
    Events after the last step are left out."""
    steps = sorted((e.start, e.end, int(e.action.split()[1])) for e in events if e.cat == "step")
    starts = [s for s, _, _ in steps]
    out = []
    for e in events:
        i = bisect.bisect_right(starts, e.start + 1e-9) - 1
        if e.cat == "between" or i < 0 or e.start > steps[i][1] - 1e-9:
            i = bisect.bisect_left(starts, e.end - 1e-9)  # in the gap before step i
        if 0 <= i < len(steps):
            out.append((steps[i][2], e))
    return out


def _bubbles(spans: dict[tuple[int, int, int], list[tuple[float, float, float]]], ranks: int) -> dict[int, float]:
    """Per step, the median over pipelines of ``1 - compute / (ranks * makespan)`` of the passes."""
    per_step: dict[int, dict[int, list[tuple[float, float, float]]]] = defaultdict(lambda: defaultdict(list))
    for (step, pipe, _), values in spans.items():
        per_step[step][pipe].extend(values)
    out = {}
    for step, pipes in per_step.items():
        fractions = []
        for values in pipes.values():
            makespan = max(e for _, e, _ in values) - min(s for s, _, _ in values)
            if makespan > 0:
                fractions.append(1.0 - sum(c for _, _, c in values) / (ranks * makespan))
        if fractions:
            out[step] = statistics.median(fractions)
    return out
