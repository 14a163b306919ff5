"""The ``smp`` command's own error: a bad command line or target.

It derives from :class:`partitioner.errors.EngineError`, the base of every user error of the engine, so the
entry point (:mod:`smp.cli.entry`) prints all of them the same way: one line, ``smp: error: ...``.
"""
from __future__ import annotations

from partitioner.errors import EngineError

__all__ = ["CLIError"]


class CLIError(EngineError, ValueError):
    """A user error of the command line (an option, a TARGET, an output file): printed as one line."""
