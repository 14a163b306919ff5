"""``smp.utils``: helpers SMP v1 scripts import from ``smdistributed.modelparallel.torch.utils``.

``rmsg`` tags a log line with the rank that wrote it, as SMP's does (``[<rank>] message``), so the
interleaved output of many processes can be told apart.
"""
from __future__ import annotations

from typing import Any

from smp.runtime import state

__all__ = ["rmsg"]


def rmsg(msg: Any) -> str:
    """``msg`` prefixed with this process's global rank: ``rmsg("loss 0.5")`` -> ``"[3] loss 0.5"``."""
    return f"[{state.get().rank}] {msg}"
