"""The ``smp`` entry point: the argument parser of all commands, and how failures reach the user.

A user error — anything derived from :class:`partitioner.errors.EngineError`, the engine's common base, the
command line's own :class:`~smp.cli.errors.CLIError` included — prints one line, ``smp: error: ...``, on stderr
and exits with 2 (a bad command line) or 1. A ValueError the libraries raise about a value is shown the same
way, a TypeError, OSError or ImportError with its kind; anything else is a bug and says so. ``SMP_TRACEBACK=1``
shows the traceback instead. Ctrl-C prints ``smp: interrupted`` and exits with 130. No class is matched by name.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from partitioner.errors import EngineError
from smp import __version__
from smp.cli.commands.calibrate import register as add_calibrate
from smp.cli.commands.demo import register as add_demo
from smp.cli.commands.inspect import register as add_inspect
from smp.cli.commands.launch import register as add_launch
from smp.cli.commands.plan import register as add_plan
from smp.cli.commands.replan import register as add_replan
from smp.cli.commands.report import register as add_report
from smp.cli.commands.simulate import register as add_simulate
from smp.cli.errors import CLIError
from smp.cli.options import Parser
from smp.cli.text import PROG

__all__ = ["main", "build_parser"]


def build_parser() -> Parser:
    """The parser of ``smp`` and its commands (each command module registers its own)."""
    parser = Parser(prog=PROG, description="Partition a PyTorch model into pipeline stages: inspect the plan, "
                    "simulate its schedule, launch training, explain a profiled run and re-partition from it.")
    parser.add_argument("--version", action="version", version=f"{PROG} (smp-engine) {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for add_command in (add_inspect, add_simulate, add_plan, add_demo, add_launch, add_report, add_replan,
                        add_calibrate):
        add_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``smp ARGV`` (``sys.argv[1:]`` by default) and return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser()
        ns, unknown = parser.parse_known_args(argv)
        if unknown:
            hint = parser.commands[ns.command].suggest(unknown[0])
            raise CLIError(f"unrecognized arguments: {' '.join(unknown)}{hint} (see '{PROG} {ns.command} --help')")
        return int(ns.func(ns) or 0)
    except CLIError as exc:
        return _fail(str(exc), 2)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # every failure becomes one line; SMP_TRACEBACK=1 shows where
        if os.environ.get("SMP_TRACEBACK"):
            raise
        return _fail(_describe(exc), 1)


def _describe(exc: Exception) -> str:
    """The engine's user errors and ValueErrors are shown as their message; a bad type, a file or a missing
    package with its kind; anything else is a bug."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, (EngineError, ValueError)):
        return text
    if isinstance(exc, (TypeError, OSError, ImportError)):
        return f"{type(exc).__name__}: {text}"
    return f"internal error, {type(exc).__name__}: {text} (set SMP_TRACEBACK=1 to see where)"


def _fail(message: str, code: int) -> int:
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    return code
