"""``smp demo``: partition the built-in GPT-2 into 2 stages, print the plan and the simulated schedule, then
train it pipelined over local processes.

The demo is the list of steps in ``DEMO_STEPS``, each a function of one :class:`DemoRun` that prints its part
and leaves results on the run for the steps after it; a step that returns a non-zero exit code stops the demo.
Training GPT-2 pipelined with the plan shown (``examples/train_gpt2.py --plan`` through ``smp launch``;
``--no-train`` skips it), profiled, comes next, and last the profile's report (:mod:`smp.profiling.report`) with
its rules; extend the demo by adding steps.
"""
from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from partitioner.units import format_seconds
from smp.cli.analysis import analyse
from smp.cli.commands.inspect import check_work
from smp.cli.commands.launch import launch
from smp.cli.errors import CLIError
from smp.cli.options import Options, positive_int
from smp.cli.plan_table import format_report, pipeline_title
from smp.cli.target import load_target, pricing_threads, trace_target
from smp.cli.text import Progress

__all__ = ["register", "run", "DemoRun", "DEMO_STEPS", "TRAIN_SCRIPT"]

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


def _demo_plan(run: DemoRun) -> int:
    o = run.opts
    print(f"smp demo: GPT-2 (built-in small config, random weights) in {o.partitions} pipeline stages, "
          f"{o.microbatches} microbatches, {pipeline_title(o.pipeline, o.schedule)}")
    target = load_target("zoo:gpt2", progress=run.progress)
    run.graph = trace_target(target, run.progress, o)
    run.plan, run.sim = analyse(run.graph, o, target=target, progress=run.progress)
    print()
    print(format_report(run.plan, run.graph))
    return 0


def _demo_schedule(run: DemoRun) -> int:
    from pipeline.timeline import to_text

    text = to_text(run.sim.events)
    if text:
        print()
        m = run.plan.extra["schedule"]["microbatches"]
        letters = "a" if m == 1 else f"a-{chr(ord('a') + min(m, 10) - 1)}"
        print(f"simulated schedule, {format_seconds(run.sim.step_s)} per step (digits: forward of microbatch k, "
              f"letters {letters}: its backward, '.': idle):")
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
    run.progress(f"training with {TRAIN_SCRIPT} on {o.partitions} processes with the plan above, profiled into "
                 f"{run.profile}")
    return launch(["-n", str(o.partitions), TRAIN_SCRIPT, "--partitions", str(o.partitions),
                   "--microbatches", str(o.microbatches), "--pipeline", o.pipeline, "--profile", run.profile,
                   "--plan", plan_file])


def _demo_report(run: DemoRun) -> int:
    """After training: the report of the profiled steps (:mod:`smp.profiling.report`) and its rules."""
    if run.profile is None:
        return 0
    from smp.profiling.report import write_report

    path, findings = write_report(run.profile)
    print()
    print(f"profile of the training run ({run.profile}), the rules' findings:")
    for finding in findings:
        print(finding)
    print(f"report: {path}; re-partition from it: smp replan {run.profile} -o plan.json")
    return 0


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
