"""``smp replan DIR -o plan.json``: re-partition the profiled model with the stage costs its profile
measured in place of the cost model's estimates (:mod:`smp.profiling.replan`), print the predicted gain and write the
plan, for the config key ``"partition_file"`` or ``PipelineRunner.from_plan_file``."""
from __future__ import annotations

import argparse

from smp.cli.options import check_output

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``smp replan`` to the command's subparsers."""
    p = sub.add_parser("replan", help="re-partition from a profile's measured stage costs",
                       description="Cut the profiled model again with the per-stage times its profile measured, "
                                   "print the predicted gain and write the plan to FILE.")
    p.add_argument("directory", metavar="DIR", help="the profile directory")
    p.add_argument("-o", "--out", metavar="FILE", required=True, help="where to write the plan (.json)")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    """Run ``smp replan`` on parsed arguments."""
    from smp.profiling.replan import replan_to_file

    check_output(ns.out, "--out", (".json",))
    print(replan_to_file(ns.directory, ns.out))
    return 0
