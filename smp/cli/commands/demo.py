"""``smp demo``: partition the built-in GPT-2 into 2 stages, print the plan and the simulated schedule, then
train it pipelined over local processes.

The demo is the list of steps in ``DEMO_STEPS``, each a function of one :class:`DemoRun` that prints its part
and leaves results on the run for the steps after it; a step that returns a non-zero exit code stops the demo.
Training GPT-2 pipelined with the plan shown (``examples/train_gpt2.py --plan`` through ``smp launch``;
``--no-train`` skips it), profiled, comes next, and last the run against its prediction and the profile's rules
(:mod:`smp.profiling.report`); extend the demo by adding steps.

It is written for someone who has not met pipelines: the terms of the plan (stage, microbatch, cut, memory_weight,
bubble) are said in plain words under the table, the measured step leaves out what is not training (the first
step traces the model; the last profiled one writes the profile), the demo says when other processes took the
machine's cores while it trained (on two cores that alone doubles a step), and every rule that fired is followed by
what it means (:data:`smp.profiling.findings.PLAIN_TERMS`).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from partitioner.units import format_bytes, format_seconds
from smp.cli.analysis import analyse
from smp.cli.commands.inspect import check_work
from smp.cli.commands.launch import launch
from smp.cli.errors import CLIError
from smp.cli.options import Options, positive_int
from smp.cli.plan_table import format_report, pipeline_title
from smp.cli.target import load_target, pricing_threads, trace_target
from smp.cli.text import Progress
from smp.profiling.findings import PLAIN_TERMS, Thresholds

__all__ = ["register", "run", "DemoRun", "DEMO_STEPS", "TRAIN_SCRIPT", "TRAIN_STEPS"]

TRAIN_STEPS = 8  # the training run's steps; the profile records steps 2 .. TRAIN_STEPS (the first traces the model)
_BUSY_OTHERS = 0.25  # cores other processes kept busy while the ranks trained, from which the demo says so
_SLOWED_BY_OTHERS = ("StepDrift", "StepOutlier", "CommBound", "Bubble")  # rules a busy host fires on its own

# The checkout's examples/ (this file is smp/cli/commands/demo.py).
TRAIN_SCRIPT = os.path.join(os.path.abspath(__file__).rsplit(os.sep, 4)[0], "examples", "train_gpt2.py")


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``smp demo`` to the command's subparsers."""
    p = sub.add_parser("demo", help="partition a built-in GPT-2, show the plan and its schedule, train it pipelined",
                       description="The quickest look: zoo:gpt2 in 2 stages, its plan and simulated schedule, "
                                   "then a few training steps pipelined over 2 local processes.")
    p.add_argument("--partitions", "-p", type=positive_int, default=2)
    p.add_argument("--microbatches", "-m", type=positive_int, default=4)
    p.add_argument("--pipeline", dest="smp_pipeline", metavar="NAME", default="interleaved",
                   help="interleaved or 1f1b = 1F1B (default), simple or gpipe = GPipe")
    p.add_argument("--no-train", dest="train", action="store_false",
                   help="stop after the plan and schedule (skip training examples/train_gpt2.py pipelined)")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="keep the checkpoint the training run saves at its end in DIR (default: saved to a "
                        "temporary folder and removed)")
    p.add_argument("--quiet", "-q", action="store_true")
    p.set_defaults(func=run)


@dataclass
class DemoRun:
    """What the demo's steps share: the arguments, the options, and what earlier steps computed."""

    args: argparse.Namespace
    opts: Options
    progress: Progress
    graph: Any = None
    plan: Any = None
    sim: Any = None
    profile: str | None = None  # where the training run was profiled
    host: dict[str, float] = field(default_factory=dict)  # while it trained: the cores others kept busy, of how many


def _demo_plan(run: DemoRun) -> int:
    o = run.opts
    print(f"smp demo: GPT-2 (built-in small config, random weights) in {o.partitions} pipeline stages, "
          f"{o.microbatches} microbatches, {pipeline_title(o.pipeline, o.schedule)}")
    target = load_target("zoo:gpt2", progress=run.progress)
    run.graph = trace_target(target, run.progress, o)
    run.plan, run.sim = analyse(run.graph, o, target=target, progress=run.progress)
    print()
    print(format_report(run.plan, run.graph))
    print()
    print("in plain terms:")
    for term, meaning in _terms(run):
        print(f"  {term:<13}  {meaning}")
    return 0


def _terms(run: DemoRun) -> list[tuple[str, str]]:
    """The plan's words, each in one plain line with this plan's number."""
    plan, o = run.plan, run.opts
    bubble = run.plan.extra["schedule"]["bubble"]
    return [
        ("stage", f"a run of consecutive layers of the model that one process computes; {plan.num_stages} stages "
                  f"here, one per process, each handing its output to the next"),
        ("microbatch", f"a slice of the batch: the {o.microbatches} microbatches go through the stages one after "
                       "another, so that the processes work at the same time"),
        ("cut", f"where one stage ends and the next begins; what crosses it ({format_bytes(plan.cut_bytes)} per "
                "microbatch) is sent from process to process"),
        ("memory_weight", f"how much the partitioner also evens out memory when it places the cuts: 0 time alone, "
                          f"1 memory alone ({plan.options.get('memory_weight', 0.2):g} here)"),
        ("bubble", f"the share of a step the processes sit idle, waiting for each other while the pipeline fills "
                   f"and drains ({100 * bubble:.1f}% predicted here)"),
    ]


def _demo_schedule(run: DemoRun) -> int:
    from pipeline.timeline import to_text

    text = to_text(run.sim.events)
    if text:
        print()
        m = run.plan.extra["schedule"]["microbatches"]
        letters = "a" if m == 1 else f"a-{chr(ord('a') + min(m, 10) - 1)}"
        print(f"simulated schedule, {format_seconds(run.sim.step_s)} per step (digits: forward of microbatch k, "
              f"letters {letters}: its backward, '.': idle, the bubble):")
        print(text)
    return 0


def _demo_train(run: DemoRun) -> int:
    """Unless ``--no-train``: run ``examples/train_gpt2.py`` pipelined on ``--partitions`` processes."""
    if not run.args.train:
        print()
        print("next: smp inspect zoo:gpt2 --partitions 4 --microbatches 8 --graph plan.png --timeline steps.png")
        return 0
    if not os.path.exists(TRAIN_SCRIPT):
        raise CLIError(f"pipelined training is not available yet ({TRAIN_SCRIPT} is missing)")
    o = run.opts
    run.profile = tempfile.mkdtemp(prefix="smp-demo-profile-")
    # The run trains the plan shown above, so the report's prediction is the one printed here (a run that partitioned
    # on its own would time the ops again, on a host whose speed has moved since, and could cut elsewhere).
    plan_file = os.path.join(run.profile, "plan.json")
    run.plan.to_json(plan_file)
    print()
    print(f"training it for {TRAIN_STEPS} steps on {o.partitions} processes with the plan above "
          f"(examples/train_gpt2.py through smp launch), profiled into {run.profile}:")
    out = ["--out", run.args.out] if run.args.out else []
    with _others_on_cpu(run.host):
        return launch(["-n", str(o.partitions), TRAIN_SCRIPT, "--partitions", str(o.partitions),
                       "--microbatches", str(o.microbatches), "--pipeline", o.pipeline, "--profile", run.profile,
                       "--plan", plan_file, "--steps", str(TRAIN_STEPS), *out])


@contextlib.contextmanager
def _others_on_cpu(seen: dict[str, float]) -> Iterator[None]:
    """Meanwhile, how many of this machine's cores processes other than this one and its children (the ranks) kept
    busy on average: ``seen["others"]`` of ``seen["cores"]``, filled in on the way out."""
    import psutil

    def busy() -> float:  # guest time is counted in user time already
        t = psutil.cpu_times()
        return sum(t) - t.idle - sum(getattr(t, k, 0.0) for k in ("iowait", "guest", "guest_nice"))

    def ours() -> float:  # the ranks are this process's children, reaped by the time launch() returns
        t = psutil.Process().cpu_times()
        return t.user + t.system + getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)

    start, host, own = time.monotonic(), busy(), ours()
    try:
        yield
    finally:
        wall = time.monotonic() - start
        if wall > 0:
            seen.update(others=max(busy() - host - (ours() - own), 0.0) / wall, cores=float(psutil.cpu_count() or 1))


def _demo_report(run: DemoRun) -> int:
    """After training: the report of the profiled steps (:mod:`smp.profiling.report`) and its rules."""
    if run.profile is None:
        return 0
    from smp.profiling.report import write_report

    path, findings = write_report(run.profile)
    print()
    for line in _against_prediction(run, findings):
        print(line)
    print()
    print("the profile's rules, as `smp report` prints them (docs/profiling.md lists them):")
    for finding in findings:
        print(finding)
        if finding.fired and finding.rule in PLAIN_TERMS:
            print(f"  in plain terms: {PLAIN_TERMS[finding.rule]}")
    print(f"report: {path}; re-partition from it: smp replan {run.profile} -o plan.json")
    return 0


def _against_prediction(run: DemoRun, findings: list[Any]) -> list[str]:
    """The measured step against the predicted one (the StepDrift finding's numbers): which steps count, the ratio,
    and whether other processes took the machine's cores meanwhile."""
    drift = next((f for f in findings if f.rule == "StepDrift"), None)
    if drift is None or "ratio" not in drift.numbers:
        return ["the run against its prediction: no step to compare (see the rules below)"]
    n = drift.numbers
    verdict = "within" if not drift.fired else "beyond"
    lines = [f"the run against its prediction: the median step took {format_seconds(n['measured_s'])}, "
             f"{n['ratio']:.2f}x the {format_seconds(n['predicted_s'])} the plan predicted ({verdict} the "
             f"±{Thresholds().step_drift:.0%} StepDrift allows)",
             f"  measured: steps 2-{TRAIN_STEPS} as the profile recorded them; not step 1, which traces the model "
             f"and builds its stages, nor the writing of the profile at the end of step {TRAIN_STEPS}"]
    others, cores = run.host.get("others", 0.0), run.host.get("cores", 0.0)
    if others >= _BUSY_OTHERS:
        slowed = [f.rule for f in findings if f.fired and f.rule in _SLOWED_BY_OTHERS]
        follow = f" ({', '.join(slowed)} below follow from that)" if slowed else ""
        lines.append(f"  other processes kept {others:.2f} of this machine's {cores:.0f} cores busy while it trained: "
                     f"the {run.opts.partitions} processes had less of the CPU than when the ops were timed, so the "
                     f"steps are slower than predicted{follow}; run it again on a quiet machine to compare")
    return lines


DEMO_STEPS: list[Callable[[DemoRun], int]] = [_demo_plan, _demo_schedule, _demo_train, _demo_report]


def run(ns: argparse.Namespace) -> int:
    """Run ``smp demo`` on parsed arguments."""
    # The ops are timed on this machine, one thread as each rank runs (what the ranks will pay).
    opts = Options(ns.partitions, ns.smp_pipeline, microbatches=ns.microbatches, measure=True)
    check_work(opts)
    demo = DemoRun(ns, opts, Progress(ns.quiet))
    with pricing_threads(opts.partition.device, opts.partitions):
        for step in DEMO_STEPS:
            code = step(demo)
            if code:
                return code
    return 0
