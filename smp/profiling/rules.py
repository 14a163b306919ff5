"""Rules that explain a profiled run, each with its numbers and a recommendation (``smp report``).

As SageMaker Debugger's profiler rules do for SMP jobs (LoadBalancing, StepOutlier, CPUBottleneck /
IOBottleneck, LowGPUUtilization), each rule reads :class:`smp.profiling.measurements.Measurements` and returns a
:class:`Finding`: whether it fired, one line of numbers, and what to do about it.

* **StageImbalance**: the measured stage costs (compute per microbatch) have max/mean > 1.10.
* **PlanDrift**: a stage's measured cost differs from its planned cost by more than 25%, after both are
  scaled to the same total (a device uniformly faster or slower than the cost model thought moves no
  boundary; an op the model misjudges does).
* **StepDrift**: the median step differs from the plan's predicted step (:mod:`pipeline.step_model`) by more than
  25%: the prediction every command printed for this run was off, whatever the stages' shares.
* **Straggler**: with data parallelism, one rank's compute for the same stage is > 1.2x its replicas'.
* **StepOutlier**: an iteration (the gap before the step, the optimizer, the step) > 1.5x the median;
  it says which phase grew: forward, backward, wait, data, the optimizer or the time outside the passes (the
  engine's own work: the run's first step traces and partitions the model).
* **DataBound**: the time between steps, without the optimizer step, > 10% of the step time.
* **CommBound**: a rank's communication (transfers after the peer sent, posting sends and receives)
  > 20% of its step time.
* **Bubble**: the measured bubble exceeds the simulator's prediction by more than 10 points.

After them come the rules on the system monitor's samples (:mod:`smp.profiling.system_rules`: CPUBottleneck,
IOBottleneck, LowGPUUtilization, MemoryGrowth). The thresholds of all: :class:`Thresholds`.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable

from smp.profiling.findings import Finding, Thresholds
from smp.profiling.measurements import Measurements
from smp.profiling.system_rules import SYSTEM_RULES

__all__ = ["Finding", "Thresholds", "evaluate", "RULES"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _stage(m: Measurements, s: int) -> str:
    mods = m.plan.stages[s].modules or [""]
    span = mods[0] if len(mods) == 1 else f"{mods[0]} .. {mods[-1]}"
    return f"stage {s} ({span or 'the root module'})"


def _stage_imbalance(m: Measurements, t: Thresholds) -> Finding:
    costs = m.stage_cost_s
    if len(costs) < 2 or not any(costs):
        return Finding("StageImbalance", False, "one stage: nothing to balance")
    mean = statistics.fmean(costs)
    slow, fast = max(range(len(costs)), key=costs.__getitem__), min(range(len(costs)), key=costs.__getitem__)
    ratio = costs[slow] / mean
    summary = (f"{_stage(m, slow)} costs {_ms(costs[slow])} per microbatch, {ratio:.2f}x the mean "
               f"{_ms(mean)}; the cheapest, {_stage(m, fast)}, {_ms(costs[fast])} (max/mean threshold {t.imbalance:g})")
    return Finding("StageImbalance", ratio > t.imbalance, summary,
                   f"move work from stage {slow} towards stage {fast}: re-partition from these measurements with "
                   "`smp replan DIR -o plan.json` and run with the config key \"partition_file\": \"plan.json\" "
                   "(or let the run do it: \"auto_repartition\": {\"after_steps\": 10}); with a manual split "
                   "(auto_partition False) move modules out of stage " f"{slow}",
                   {"max_over_mean": ratio, "slowest": slow, "fastest": fast, "stage_cost_s": costs})


def _plan_drift(m: Measurements, t: Thresholds) -> Finding:
    measured, planned = m.stage_cost_s, m.planned_cost_s
    if not sum(planned) or not sum(measured):
        return Finding("PlanDrift", False, "no planned or measured stage costs to compare")
    overall = sum(measured) / sum(planned)
    drift = [(c / (p * overall) - 1.0) if p > 0 else 0.0 for c, p in zip(measured, planned)]
    worst = max(range(len(drift)), key=lambda s: abs(drift[s]))
    off = [s for s, d in enumerate(drift) if abs(d) > t.drift]
    summary = (f"{_stage(m, worst)}: measured {_ms(measured[worst])} per microbatch vs {_ms(planned[worst])} "
               f"planned, {drift[worst]:+.0%} after scaling the plan by the run's overall measured/planned ratio "
               f"{overall:.2f}x (threshold ±{t.drift:.0%})")
    names = ", ".join(str(s) for s in off)
    return Finding("PlanDrift", bool(off), summary,
                   f"the cost model misjudges the ops of stage(s) {names}: re-plan from the measurements "
                   "(`smp replan DIR -o plan.json`, or \"auto_repartition\"), or time the ops when partitioning "
                   "(smp.DistributedModel(model, trace_execution_times=True))",
                   {"drift": drift, "overall_ratio": overall, "stages": off})


def _step_drift(m: Measurements, t: Thresholds) -> Finding:
    measured = statistics.median(p.step_s for p in m.phases.values()) if m.phases else 0.0
    predicted, replayed = m.predicted.step_s, m.replayed.step_s
    if measured <= 0 or predicted <= 0:
        return Finding("StepDrift", False, "no measured or predicted step to compare")
    ratio = measured / predicted
    summary = (f"the median step took {_ms(measured)}, {ratio:.2f}x the {_ms(predicted)} the plan predicted "
               f"(threshold ±{t.step_drift:.0%}); the step model with the measured stage costs gives {_ms(replayed)}")
    explained = abs(replayed / measured - 1) <= t.step_drift  # the measured stage costs account for the step
    if explained and m.plan.options.get("measured"):
        advice = ("the stages cost what the run measured, not what their ops cost when rank 0 timed them: the host "
                  "ran at another speed then (SMP_RECALIBRATE=1 times them again) or other jobs share its cores; "
                  "re-plan from these measurements (`smp replan DIR -o plan.json`), whose predictions start from them")
    elif explained:
        advice = ("the stages cost what the run measured, not what the plan priced them at: time the ops when "
                  "partitioning (smp.DistributedModel(model, trace_execution_times=True); on a CPU the cost model "
                  "misjudges small ops by up to 2x), or re-plan from these measurements (`smp replan DIR -o "
                  "plan.json`), whose predictions start from them")
    else:
        advice = ("the step spends time the passes do not account for: see the CommBound, DataBound and Bubble "
                  "findings and the trace (trace.json); another job on the host slows every rank alike")
    return Finding("StepDrift", abs(ratio - 1) > t.step_drift, summary, advice,
                   {"measured_s": measured, "predicted_s": predicted, "replayed_s": replayed, "ratio": ratio})


def _straggler(m: Measurements, t: Thresholds) -> Finding:
    if len(m.info["pipelines"]) < 2:
        return Finding("Straggler", False, "one pipeline: no replica to compare a rank with")
    worst: tuple[float, int, int] = (0.0, -1, -1)
    slow: list[int] = []
    for s in range(m.schedule.num_stages):
        own = {r: v[s] for r, v in m.rank_stage_s.items() if s in v}
        for r, value in own.items():
            peers = [v for q, v in own.items() if q != r]
            if peers and statistics.median(peers) > 0:
                ratio = value / statistics.median(peers)
                worst = max(worst, (ratio, r, s))
                if ratio > t.straggler:
                    slow.append(r)
    ratio, r, s = worst
    if r < 0:
        return Finding("Straggler", False, "no stage ran on more than one rank")
    summary = (f"rank {r} runs {_stage(m, s)} in {_ms(m.rank_stage_s[r][s])} per microbatch, {ratio:.2f}x the "
               f"median of its replicas (threshold {t.straggler:g}x)")
    return Finding("Straggler", bool(slow), summary,
                   f"rank(s) {sorted(set(slow))} do the same work slower than their peers: look at that host and "
                   "device (other processes, CPU frequency or thermal throttling, a busy core, nvidia-smi); every "
                   "data-parallel step waits for the slowest replica", {"ratio": ratio, "ranks": sorted(set(slow))})


_PHASES = {"forward": "forward_s", "backward": "backward_s", "wait": "wait_s", "data": "data_s",
           "optimizer": "optimizer_s", "the time outside the passes": "outside_s"}


def _step_outlier(m: Measurements, t: Thresholds) -> Finding:
    def worst(step: int, name: str) -> float:
        return max(getattr(m.phases[step, r], name) for r in m.ranks if (step, r) in m.phases)

    if len(m.steps) < 3:
        return Finding("StepOutlier", False, f"{len(m.steps)} step(s) profiled: too few to tell outliers")
    total = {s: worst(s, "iteration_s") for s in m.steps}
    median = statistics.median(total.values())
    slow = [s for s in m.steps if total[s] > t.outlier * median]
    if not slow:
        return Finding("StepOutlier", False, f"the slowest iteration took {max(total.values()) / median:.2f}x the "
                       f"median {_ms(median)} (threshold {t.outlier:g}x)")
    typical = {p: statistics.median(worst(s, a) for s in m.steps) for p, a in _PHASES.items()}
    lines, grew = [], {}
    for s in slow:
        phase, extra = max(((p, worst(s, a) - typical[p]) for p, a in _PHASES.items()), key=lambda x: x[1])
        grew[s] = phase
        first = " (the run's first step, which traces and partitions the model)" if s == 0 else ""
        lines.append(f"step {s}{first} took {_ms(total[s])} ({total[s] / median:.1f}x the median {_ms(median)}): "
                     f"{phase} grew by {_ms(extra)}")
    return Finding("StepOutlier", True, "; ".join(lines),
                   "see what the run did in those steps (garbage collection, checkpointing, evaluation, a data "
                   "loader worker starting, another job on the host); annotate suspects with smp.annotate(name) "
                   "to see them in the trace", {"steps": slow, "phase": grew, "median_s": median})


def _data_bound(m: Measurements, t: Thresholds) -> Finding:
    ratios = m.data_ratios()
    if not ratios:
        return Finding("DataBound", False, "one step profiled: no time between steps to measure")
    r = max(ratios, key=ratios.__getitem__)
    summary = (f"rank {r} spends {_ms(m.median_phase(r, 'data_s'))} between steps (data loading, your loop's code; "
               f"the optimizer step left out), {ratios[r]:.0%} of its step time (threshold {t.data:.0%})")
    slow = sorted(q for q, v in ratios.items() if v > t.data)
    return Finding("DataBound", bool(slow), summary,
                   f"rank(s) {slow} keep the pipeline waiting between steps: load batches ahead (DataLoader with "
                   "num_workers > 0, pin_memory, prefetch_factor), move preprocessing out of the loop, and log "
                   "less often; smp.annotate(\"load\") shows where the time goes", {"ratio": ratios, "ranks": slow})


def _comm_bound(m: Measurements, t: Thresholds) -> Finding:
    ratios = {}
    for r in m.ranks:
        step = m.median_phase(r, "step_s")
        if step > 0:
            ratios[r] = m.median_phase(r, "comm_s") / step
    if not ratios:
        return Finding("CommBound", False, "no steps profiled")
    r = max(ratios, key=ratios.__getitem__)
    stages = ", ".join(_stage(m, s) for s in m.stages_of(r))
    summary = (f"rank {r} ({stages}) spends {_ms(m.median_phase(r, 'comm_s'))} of its "
               f"{_ms(m.median_phase(r, 'step_s'))} step communicating, {ratios[r]:.0%} (threshold {t.comm:.0%})")
    slow = sorted(q for q, v in ratios.items() if v > t.comm)
    return Finding("CommBound", bool(slow), summary,
                   f"rank(s) {slow} wait on transfers: cut where fewer bytes cross (a higher memory_weight, or "
                   "`smp replan`), use fewer, larger microbatches, or a faster link (NCCL over NVLink/InfiniBand)",
                   {"ratio": ratios, "ranks": slow})


def _bubble(m: Measurements, t: Thresholds) -> Finding:
    if not m.bubble:
        return Finding("Bubble", False, "no pipelined passes recorded")
    measured = statistics.median(m.bubble.values())
    predicted = m.predicted.bubble
    summary = (f"the pipeline idles {measured:.0%} of the step (passes over ranks x makespan), the simulator "
               f"predicted {predicted:.0%} from the plan and {m.replayed.bubble:.0%} from the measured stage times "
               f"(threshold +{t.bubble * 100:.0f} points)")
    p, mb = m.schedule.num_ranks, m.schedule.microbatches
    return Finding("Bubble", measured > predicted + t.bubble, summary,
                   f"more microbatches shrink the bubble ((p - 1) / (m + p - 1) = {(p - 1) / (mb + p - 1):.0%} at "
                   f"p={p}, m={mb}); fix imbalanced stages and stragglers first (they idle the others); with "
                   "little compute per pass the engine's own per-pass work counts: larger microbatches",
                   {"measured": measured, "predicted": predicted, "replayed": m.replayed.bubble})


RULES: tuple[Callable[[Measurements, Thresholds], Finding], ...] = (
    _stage_imbalance, _plan_drift, _step_drift, _straggler, _step_outlier, _data_bound, _comm_bound, _bubble,
    *SYSTEM_RULES)


def evaluate(m: Measurements, thresholds: Thresholds | None = None) -> list[Finding]:
    """Every rule's finding on ``m``, in the order of :data:`RULES`."""
    t = thresholds or Thresholds()
    return [rule(m, t) for rule in RULES]
