"""The plan, its baselines and its simulated schedule for ``smp inspect`` and ``smp demo``: the command line's options
handed to :func:`pipeline.plan_analysis.analyse`, which computes them.

``--measure`` times every stage for real on the target's example inputs; under ``--sdp`` the stages are cut without
the memory budget (:func:`partitioner.sdp.group.cut_options`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from smp.cli.errors import CLIError
from smp.cli.options import Options
from smp.cli.target import Target

__all__ = ["analyse"]


def analyse(graph: Any, opts: Options, *, target: Target | None = None,
            progress: Callable[[str], None] = lambda m: None) -> tuple[Any, Any]:
    """Partition ``graph``, score the baselines, simulate the schedule, and measure if asked
    (:func:`pipeline.plan_analysis.analyse` with ``opts``).

    Returns ``(plan, sim)``: the plan with ``extra["baselines"]``, ``extra["schedule"]``, ``extra["memory"]``
    (and ``extra["measured"]``, ``extra["target"]``) filled in, and the simulator's result for its schedule.
    """
    from pipeline.plan_analysis import analyse as analyse_plan

    measure_inputs = None
    if opts.measure_stages:
        if target is None:
            raise CLIError("--measure needs the model's example inputs")
        measure_inputs = (target.args, target.kwargs)
    return analyse_plan(graph, opts.partitions, opts.partition, pipeline=opts.pipeline, sdp=opts.sdp,
                        target=None if target is None else target.spec, measure_inputs=measure_inputs,
                        progress=progress)
