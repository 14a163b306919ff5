"""The report of a profiled run (``smp report DIR``): Markdown with PNG plots, and the rules' verdicts.

It shows, from :class:`smp.profiling.measurements.Measurements`: the time of every profiled step and what it was
made of; per rank (stage) the split of its step into compute, communication and idle; the measured bubble
beside the simulator's; the measured stage costs beside the planned ones; one measured step beside the
simulator's prediction of it; peak memory; what profiling cost; what the system monitor saw (a heatmap of every
core's busy percentage over time per rank, ``cpu_heatmap.png``; the devices' utilisation and memory, ``gpu.png``,
when GPUs were sampled; a table of the host's and the data-loader workers' CPU, memory and I/O); and every rule of
:mod:`smp.profiling.rules` with its numbers and recommendation.
"""
from __future__ import annotations

import os
import statistics
from typing import Any

import numpy as np

from pipeline.profile_description import write_gantt
from smp.profiling.measurements import Measurements, load_profile
from smp.profiling.rules import Finding, Thresholds, evaluate

__all__ = ["write_report", "REPORT_FILE"]

REPORT_FILE = "report.md"


def _figure(width: float, height: float) -> tuple[Any, Any]:
    # matplotlib is optional (the "viz" extra); Figure + Agg canvas: no pyplot global state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _legend(ax: Any) -> None:
    ax.legend(fontsize=8, frameon=False, ncol=3, loc="lower right", bbox_to_anchor=(1.0, 1.0))


def _worst(m: Measurements, step: int, name: str) -> float:
    return max(getattr(m.phases[step, r], name) for r in m.ranks if (step, r) in m.phases)


def _plot_steps(m: Measurements, path: str) -> None:
    """Per step (the slowest rank's numbers): the step, the optimizer, and the gap before the step."""
    fig, ax = _figure(8, 3.2)
    x = list(range(len(m.steps)))
    bottom = [0.0] * len(x)
    for name, label, colour in (("step_s", "step", "#4C72B0"), ("optimizer_s", "optimizer", "#55A868"),
                                ("data_s", "between steps (data, your code)", "#C44E52")):
        values = [_worst(m, s, name) * 1e3 for s in m.steps]
        ax.bar(x, values, bottom=bottom, label=label, color=colour)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(x, [str(s) for s in m.steps])
    ax.set_xlabel("step")
    ax.set_ylabel("ms (slowest rank)")
    _legend(ax)
    fig.savefig(path, bbox_inches="tight")


def _plot_ranks(m: Measurements, path: str) -> None:
    """Per rank: the median step split into compute, communication and idle."""
    fig, ax = _figure(8, 0.6 + 0.45 * len(m.ranks))
    y = list(range(len(m.ranks)))
    left = [0.0] * len(y)
    for name, label, colour in (("compute_s", "compute", "#4C72B0"), ("comm_s", "communication", "#C44E52"),
                                ("idle_s", "idle", "#BBBBBB")):
        values = [m.median_phase(r, name) * 1e3 for r in m.ranks]
        ax.barh(y, values, left=left, label=label, color=colour)
        left = [a + v for a, v in zip(left, values)]
    ax.set_yticks(y, [f"rank {r} (stage {', '.join(map(str, m.stages_of(r)))})" for r in m.ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (median)")
    _legend(ax)
    fig.savefig(path, bbox_inches="tight")


def _plot_costs(m: Measurements, path: str) -> None:
    """Per stage: planned and measured compute per microbatch."""
    fig, ax = _figure(8, 3.2)
    x = list(range(len(m.stage_cost_s)))
    ax.bar([i - 0.2 for i in x], [c * 1e3 for c in m.planned_cost_s], 0.4, label="planned", color="#8C8C8C")
    ax.bar([i + 0.2 for i in x], [c * 1e3 for c in m.stage_cost_s], 0.4, label="measured", color="#4C72B0")
    ax.set_xticks(x, [str(i) for i in x])
    ax.set_xlabel("stage")
    ax.set_ylabel("ms per microbatch")
    _legend(ax)
    fig.savefig(path, bbox_inches="tight")


def _plot_cpu_heatmap(m: Measurements, path: str) -> None:
    """Per rank with CPU samples, the host's cores (rows) x time (columns), coloured by busy percentage; the
    rank's time between steps is marked under it in red."""
    ranks = [r for r in m.ranks if r in m.system and "cpu" in m.system[r]]
    fig, _ = _figure(8, 0.8 + 1.6 * len(ranks))
    fig.clear()
    start = min(float(m.system[r].series["cpu"].times[0]) for r in ranks)
    axes = fig.subplots(len(ranks), 1, squeeze=False, sharex=True)[:, 0]
    for ax, r in zip(axes, ranks):
        s = m.system[r]
        busy, times = s.core_busy, s.series["cpu"].times - start
        left = times[0] - s.interval_s if s.interval_s else times[0]
        image = ax.imshow(busy.T, aspect="auto", vmin=0, vmax=100, cmap="inferno", interpolation="nearest",
                          extent=(left, times[-1], busy.shape[1] - 0.5, -0.5))
        for e in m.events:
            if e.rank == r and e.cat == "between":
                ax.plot([e.start - start, e.end - start], [busy.shape[1] - 0.5] * 2, color="#C44E52", lw=4,
                        solid_capstyle="butt", clip_on=False)
        ax.set_ylabel(f"rank {r}\ncore")
        ax.set_yticks(range(busy.shape[1]))
    axes[-1].set_xlabel("seconds since the window's first sample (red: the rank's time between steps)")
    fig.colorbar(image, ax=list(axes), label="busy %")
    fig.savefig(path, bbox_inches="tight")


def _plot_gpu(m: Measurements, path: str) -> None:
    """Per rank with GPU samples, its device's utilisation over time, and its memory used on a second axis."""
    ranks = [r for r in m.ranks if r in m.system and "gpu" in m.system[r]]
    fig, ax = _figure(8, 3.2)
    memory = ax.twinx()
    start = min(float(m.system[r].series["gpu"].times[0]) for r in ranks)
    for r in ranks:
        gpu = m.system[r].series["gpu"]
        line = ax.plot(gpu.times - start, gpu["util_percent"], label=f"rank {r} utilisation")[0]
        memory.plot(gpu.times - start, gpu["memory_used_bytes"] / 2**30, ls="--", color=line.get_color(),
                    label=f"rank {r} memory")
    ax.set_ylim(0, 105)
    ax.set_xlabel("seconds since the window's first sample")
    ax.set_ylabel("device utilisation %")
    memory.set_ylabel("device memory used, GiB (dashed)")
    _legend(ax)
    fig.savefig(path, bbox_inches="tight")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def write_report(directory: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
                 thresholds: Thresholds | None = None) -> tuple[str, list[Finding]]:
    """Write ``report.md`` and its PNGs for the profile in ``directory`` into ``out`` (default:
    ``directory/report``); returns the report's path and the rules' findings."""
    m = load_profile(directory)
    out = os.fspath(out) if out is not None else os.path.join(directory, "report")
    os.makedirs(out, exist_ok=True)
    findings = evaluate(m, thresholds)
    for name, draw in (("steps.png", _plot_steps), ("ranks.png", _plot_ranks), ("costs.png", _plot_costs)):
        draw(m, os.path.join(out, name))
    if any("cpu" in s for s in m.system.values()):
        _plot_cpu_heatmap(m, os.path.join(out, "cpu_heatmap.png"))
    if any("gpu" in s for s in m.system.values()):
        _plot_gpu(m, os.path.join(out, "gpu.png"))
    write_gantt(m.events, m.info, os.path.join(out, "timeline.png"))
    path = os.path.join(out, REPORT_FILE)
    with open(path, "w") as f:
        f.write("\n".join(_markdown(m, findings, os.fspath(directory))) + "\n")
    return path, findings


def _markdown(m: Measurements, findings: list[Finding], directory: str) -> list[str]:
    s = m.schedule
    fired = [f for f in findings if f.fired]
    lines = [f"# Profile of {directory}", "",
             f"{len(m.ranks)} ranks in {len(m.info['pipelines'])} pipeline(s) of {s.num_ranks} ranks, {s.num_stages} "
             f"stages, schedule {s.name}, {s.microbatches} microbatches; steps {m.steps[0]} .. {m.steps[-1]} profiled. "
             f"Median step {_ms(statistics.median(p.step_s for p in m.phases.values()))} ms; the plan's simulator "
             f"predicted {_ms(m.predicted.step_s)} ms.", "",
             "## Rules", ""]
    lines += [f"- **{f.rule}**: {'**fired**' if f.fired else 'ok'}. {f.summary}" +
              (f"  \n  *Recommendation*: {f.recommendation}" if f.fired else "") for f in findings]
    if not fired:
        lines += ["", "No rule fired."]
    lines += ["", "## Step time", "", "![steps](steps.png)", ""]
    lines += _table(["step", "step ms", "forward ms", "backward ms", "wait ms", "optimizer ms", "between ms"],
                    [[str(st)] + [_ms(_worst(m, st, a)) for a in ("step_s", "forward_s", "backward_s", "wait_s",
                                                                  "optimizer_s", "data_s")] for st in m.steps])
    lines += ["", "Each column is the slowest rank's. *between*: time outside `@smp.step` before the step (data "
              "loading and your code), the optimizer step left out.", "",
              "## Where each rank's step goes", "", "![ranks](ranks.png)", ""]
    lines += _table(["rank", "stages", "step ms", "compute ms", "communication ms", "idle ms"],
                    [[str(r), ", ".join(map(str, m.stages_of(r)))] +
                     [_ms(m.median_phase(r, a)) for a in ("step_s", "compute_s", "comm_s", "idle_s")] for r in m.ranks])
    measured_bubble = statistics.median(m.bubble.values()) if m.bubble else 0.0
    lines += ["", "Medians over the steps. *communication*: transfers after the peer had sent, and posting sends and "
              "receives; *idle*: waiting for a peer still computing, and the engine's own work around the passes.", "",
              f"Bubble: measured {measured_bubble:.1%}; simulated {m.predicted.bubble:.1%} from the plan's stage "
              f"times and {m.replayed.bubble:.1%} from the measured ones.", "",
              "## Stage costs: measured and planned", "", "![costs](costs.png)", ""]
    lines += _table(["stage", "modules", "planned fwd ms", "planned bwd ms", "measured fwd ms", "measured bwd ms",
                     "measured / planned"],
                    [[str(st.index), f"{st.modules[0]} .. {st.modules[-1]}" if st.modules else "", _ms(st.forward_s),
                      _ms(st.backward_s), _ms(m.stage_forward_s[st.index]), _ms(m.stage_backward_s[st.index]),
                      f"{m.stage_cost_s[st.index] / p:.2f}x" if (p := m.planned_cost_s[st.index]) else "-"]
                     for st in m.plan.stages])
    lines += ["", "Per microbatch, compute only (the time a pass waited for its inputs left out).", "",
              "## One step, measured and predicted", "", "![timeline](timeline.png)", "",
              "The trace of every profiled step: `trace.json` (open it in https://ui.perfetto.dev).", "",
              "## Memory and profiling cost", ""]
    lines += _table(["rank", "peak host RSS", "peak CUDA allocated", "profiling overhead"],
                    [[str(r), _mib(m.memory.get(r, {}).get("rss_bytes", 0.0)),
                      _mib(m.memory[r]["cuda_peak_bytes"]) if "cuda_peak_bytes" in m.memory.get(r, {}) else "-",
                      f"{m.info['ranks'][str(r)]['overhead']['fraction']:.2%}"] for r in m.ranks])
    lines += ["", "Overhead: the rank's recorded spans and memory samples, each timed on that rank after the window, "
              "and its system monitor's samples, as a share of the profiled time."]
    return lines + _throughput_markdown(m) + _system_markdown(m)


def _throughput_markdown(m: Measurements) -> list[str]:
    """The throughput section: the median step's rates (the step of median time), then every step's
    (partitioner.cost.throughput's figures)."""
    figures = m.throughput
    if not figures:
        return ["", "## Throughput", "", "No throughput recorded (a profile written before throughput was)."]
    median = sorted(figures, key=lambda t: t.seconds)[(len(figures) - 1) // 2]
    lines = ["", "## Throughput", "", f"Median step: {median}.", ""]
    steps = m.steps if len(m.steps) == len(figures) else list(range(len(figures)))
    lines += _table(["step", "step ms", "samples/s", "tokens/s", "model GFLOP/s per device", "MFU"],
                    [[str(s), _ms(t.seconds), f"{t.samples_per_s:.1f}",
                      f"{t.tokens_per_s:.1f}" if t.tokens_per_s is not None else "-",
                      f"{t.flops_per_s_per_device / 1e9:.2f}", f"{t.mfu:.2%}" if t.mfu is not None else "-"]
                     for s, t in zip(steps, figures)])
    peak = figures[0].peak_flops_per_s
    mfu = (f"MFU against the peak of the plan's device profile ({peak / 1e12:.3g} TFLOP/s)" if peak else
           "no MFU: the plan's device has no peak here (a profile measured on this machine, such as cpu, or none "
           "recorded)")
    return lines + ["", f"Model FLOPs: the plan's forward FLOPs x 3 for a training step (x 1 forward only), over the "
                    f"step's wall time (the slowest rank) and the pipeline's {figures[0].devices} device(s); {mfu}. "
                    "See partitioner.cost.throughput."]


def _median_of(m: Measurements, rank: int, name: str, key: str, scale: float = 1.0) -> str:
    s = m.system[rank]
    return f"{float(np.median(s.series[name][key])) * scale:.2f}" if name in s else "-"


def _system_markdown(m: Measurements) -> list[str]:
    """The system monitor's section: its pictures and a table of medians per rank."""
    ranks = [r for r in m.ranks if r in m.system]
    if not ranks:
        return ["", "## System", "", "No system monitor samples (the profile's \"monitor_s\" was 0)."]
    lines = ["", "## System", "", "![cpu](cpu_heatmap.png)", ""]
    if any("gpu" in m.system[r] for r in ranks):
        lines += ["![gpu](gpu.png)", ""]
    lines += _table(["rank", "host", "cores", "busy %", "rank cores", "workers", "workers' cores", "workers' RSS MiB",
                     "disk read MiB/s", "net recv MiB/s", "GPU %"],
                    [[str(r), m.system[r].host or "-", str(m.system[r].cores),
                      f"{float(m.system[r].core_busy.mean()):.0f}" if m.system[r].core_busy.size else "-",
                      _median_of(m, r, "process", "cpu_cores"), _median_of(m, r, "process", "children"),
                      _median_of(m, r, "process", "children_cpu_cores"),
                      _median_of(m, r, "process", "children_rss_bytes", 2**-20),
                      _median_of(m, r, "io", "disk_read_bytes_s", 2**-20),
                      _median_of(m, r, "io", "net_recv_bytes_s", 2**-20), _median_of(m, r, "gpu", "util_percent")]
                     for r in ranks])
    interval = max(m.system[r].interval_s for r in ranks)
    return lines + ["", f"Sampled every {interval:g} s on every rank (pipeline.system_monitor). *busy*: the mean over "
                    "the host's cores and the window; the rest are medians over the samples. *rank cores*: CPU the "
                    "rank's process used, in cores; *workers*: its child processes (data-loader workers)."]
