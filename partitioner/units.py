"""Reading and writing quantities the way people type and read them: memory sizes and durations.

One place for the units every report and option of the engine uses (``16GiB``, ``512MB``, ``100us``), so
that a plan's table, an error message and the ``smp`` command print the same numbers the same way.
"""
from __future__ import annotations

import math
import re

__all__ = ["UNLIMITED", "parse_size", "format_bytes", "parse_duration", "format_seconds"]

UNLIMITED = "unlimited"  # a memory budget of no limit (PartitionOptions.device_memory, smp --device-memory)

_SIZE_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_DURATION_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, None: 1.0}


def parse_size(size: str | int | float | None) -> float | None:
    """``"16GiB"``, ``"512MB"``, ``2**30`` -> bytes (None stays None); anything else that is not a positive,
    finite size is an error naming the value."""
    if size is None:
        return None
    if isinstance(size, (int, float)) and not isinstance(size, bool):
        value, unit = float(size), ""
    else:
        text = str(size).strip()
        num = text.rstrip("bBiIkKmMgGtT ")
        unit = text[len(num):].strip().lower()
        try:
            value = float(num)
        except ValueError:
            value = math.nan
    if unit not in _SIZE_UNITS or not math.isfinite(value) or value <= 0:
        raise ValueError(f"cannot read memory size {size!r}: it must be a positive, finite number of bytes, "
                         "written with a unit such as 16GiB or 512MB")
    return value * _SIZE_UNITS[unit]


def format_bytes(n: float, digits: int = 1) -> str:
    """Bytes in the largest binary unit that keeps them >= 1: ``1.5 MiB``, ``12 B``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_duration(text: str | float) -> float:
    """``"100us"``, ``"0.1ms"``, ``"2e-5"`` (seconds) -> seconds; negative or unreadable values are errors."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(s|ms|us|ns)?\s*", str(text))
    try:
        value = float(m.group(1)) if m else math.nan
    except ValueError:
        value = math.nan
    if not m or not math.isfinite(value) or value < 0:
        raise ValueError(f"cannot read duration {text!r}: write a non-negative number with a unit, e.g. 100us, 0.1ms")
    return value * _DURATION_UNITS[m.group(2)]


def format_seconds(seconds: float) -> str:
    """A duration with a unit that keeps 3-4 significant digits: ``120 s``, ``1.25 s``, ``3.40 ms``, ``12.5 us``."""
    if seconds >= 100:
        return f"{seconds:.0f} s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"
