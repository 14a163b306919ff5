"""What the ``smp`` commands print: progress lines on stderr, aligned tables, FLOP counts and milliseconds.

Bytes and durations are written by :mod:`partitioner.units`, so the command, the plans and the errors print
the same numbers the same way.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Sequence

__all__ = ["PROG", "Progress", "table", "format_flops", "ms"]

PROG = "smp"


class Progress:
    """Progress lines on stderr (``smp: [  1.2s] tracing ...``); silent with --quiet."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.t0 = time.perf_counter()

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(f"{PROG}: [{time.perf_counter() - self.t0:6.1f}s] {message}", file=sys.stderr, flush=True)


def format_flops(x: float) -> str:
    """``53300000.0`` -> ``53.3M``."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def ms(seconds: float) -> str:
    """Seconds as milliseconds with two decimals, the unit of the per-stage columns."""
    return f"{seconds * 1e3:.2f}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[int] = ()) -> list[str]:
    """Lines of a table under a rule: right-aligned columns, except those in ``left``; the last column is
    never padded."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        cells = []
        for i, cell in enumerate(row):
            if i == len(row) - 1 and i in left:
                cells.append(str(cell))
            else:
                cells.append(str(cell).ljust(widths[i]) if i in left else str(cell).rjust(widths[i]))
        return "  ".join(cells).rstrip()

    lines = [fmt(header)]
    lines.append("-" * len(lines[0]))
    lines.extend(fmt(r) for r in rows)
    return lines
