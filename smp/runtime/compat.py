"""SMP v1 options this engine accepts but that change nothing here, and the warning they give.

A script written for SageMaker's model-parallel library passes config keys and arguments that tune that
library's own kernels and runtime (``fast_mode``, ``skip_tracing``, loss-scaling hysteresis of tensor
parallel modules, ...). Refusing them would break scripts that run correctly without them; ignoring them
silently would hide that they do nothing. So they are accepted with a :class:`NoEffectWarning` that names
the option and says why. Python's warning registry shows each distinct warning once per call site, so a
loop that passes the same option does not repeat it.
"""
from __future__ import annotations

import warnings

__all__ = ["NoEffectWarning", "warn_no_effect", "accept_no_effect"]


class NoEffectWarning(UserWarning):
    """An SMP v1 option was accepted but has no effect in this engine; the message says why."""


def warn_no_effect(option: str, why: str, stacklevel: int = 2) -> None:
    """Warn (once per call site) that ``option`` has no effect here, because ``why``.

    ``stacklevel`` counts as :func:`warnings.warn` does, from the function calling this one: 1 is that
    function's line, the default 2 its caller (the user's code that passed the option)."""
    warnings.warn(f"{option} has no effect in this engine: {why}", NoEffectWarning, stacklevel=stacklevel + 1)


def accept_no_effect(kwargs: dict, accepted: set[str], call: str, why: str, stacklevel: int = 2) -> None:
    """Raise ``TypeError`` naming the keyword arguments of ``call`` outside ``accepted``; warn (:func:`warn_no_effect`)
    that the others have no effect here, because ``why``. ``stacklevel`` counts from the function calling this one."""
    unknown = set(kwargs) - accepted
    if unknown:
        raise TypeError(f"{call} got unknown argument(s) {sorted(unknown)}")
    if kwargs:
        warn_no_effect(f"{call}({', '.join(sorted(kwargs))}=...)", why, stacklevel + 1)
