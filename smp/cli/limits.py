"""Bounding a command's work before it starts: the schedule actions it would simulate.

The simulator holds every action of a schedule (a forward, backward or weight-gradient pass of one microbatch
on one stage) with its start and end, so its time and memory grow with stages x microbatches x passes;
``smp inspect --microbatches 100000000000`` or ``smp simulate`` at 10^5 x 10^5 would run for days and exhaust
memory long before. Each command adds up what it would simulate from its arguments alone, before it builds
the model, and refuses with the numbers when the total is over ``--max-actions``.
"""
from __future__ import annotations

from collections.abc import Mapping

from partitioner.units import format_bytes
from smp.cli.errors import CLIError

__all__ = ["DEFAULT_MAX_ACTIONS", "BYTES_PER_ACTION", "schedule_actions", "check_actions"]

# About a minute of simulation and a few GB on a laptop: the full comparison of `smp simulate` at 1024 stages x
# 2048 microbatches (2.3e7 actions in four schedules) fits.
DEFAULT_MAX_ACTIONS = 30_000_000
# Memory per simulated action in CPython: the action, its start and end, and the per-rank lists (measured).
BYTES_PER_ACTION = 250


def schedule_actions(stages: int, microbatches: int, split_backward: bool = False) -> int:
    """Actions in one step of a schedule: F and B (and W when the backward is split) per stage and microbatch."""
    return stages * microbatches * (3 if split_backward else 2)


def check_actions(work: Mapping[str, int], limit: int) -> None:
    """Refuse to simulate more than ``limit`` actions in all; ``work`` names each simulated schedule's actions."""
    total = sum(work.values())
    if total <= limit:
        return
    parts = ", ".join(f"{name} {n:.3g}" for name, n in work.items())
    raise CLIError(f"this would simulate {total:.3g} schedule actions (stages x microbatches x passes: {parts}), "
                   f"more than --max-actions {limit:.3g} allows; the largest schedule alone would need about "
                   f"{format_bytes(max(work.values()) * BYTES_PER_ACTION)} of memory. Use fewer stages, "
                   "microbatches or schedules, or raise --max-actions")
