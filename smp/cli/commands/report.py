"""``smp report DIR``: explain a profiled run (a directory written by the config key ``"profile"``,
``with smp.profile(DIR):`` or ``PipelineRunner(record=DIR)``): a Markdown report with PNGs
(:mod:`smp.profiling.report`), and every rule's verdict on the terminal."""
from __future__ import annotations

import argparse

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``smp report`` to the command's subparsers."""
    p = sub.add_parser("report", help="explain a profiled run: step times, stages, bubble, rules",
                       description="Write a report (Markdown and PNGs) of the profile in DIR and print the rules' "
                                   "findings with their recommendations.")
    p.add_argument("directory", metavar="DIR", help="the profile directory")
    p.add_argument("-o", "--out", metavar="FOLDER", help="where to write report.md and its PNGs (default DIR/report)")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    """Run ``smp report`` on parsed arguments."""
    from smp.profiling.report import write_report

    path, findings = write_report(ns.directory, ns.out)
    for finding in findings:
        print(finding)
    print(f"report: {path}")
    return 0
