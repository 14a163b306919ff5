"""The engine's error hierarchy: one base class for every error a user can cause or meet.

Each package raises its own subclass (a trace the exporter rejects, a plan that cannot fit a memory
budget, a malformed schedule, a batch that does not split, a peer rank that failed, a bad config, a bad
command line). All of them derive from :class:`EngineError`, so a caller — the ``smp`` command above all —
tells a user error from a bug with one ``except EngineError`` instead of matching class names, and each
keeps the built-in base (``ValueError``, ``RuntimeError``) that code written against earlier versions
catches. The base lives in the lowest package so that every package can derive from it without an import
going against the smp → pipeline → partitioner direction.
"""
from __future__ import annotations

__all__ = ["EngineError"]


class EngineError(Exception):
    """A user-facing error of the engine: its message names what is wrong and how to fix it."""
