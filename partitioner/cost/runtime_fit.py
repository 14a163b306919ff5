"""The runtime's per-pass and per-step costs fitted to measured steps.

:func:`pipeline.step_model.predict_step` prices a step as its ops plus :attr:`partitioner.DeviceRates.pass_overhead_s`
per pass and :attr:`~partitioner.DeviceRates.step_overhead_s` per step. Given real steps (each at some microbatch
count) and their predictions at every per-pass cost of :data:`PASS_GRID_S` with no per-step cost, the per-pass cost is
the one whose predictions, each with the best per-step cost, fit the measured steps best: least squares on the relative
error, the per-step cost in closed form (:func:`fit_runtime_costs`). ``smp calibrate`` measures the steps
(:mod:`smp.cli.runtime_costs`) and keeps the fit (:func:`partitioner.cost.calibration.record_runtime_costs`).
"""
from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PASS_GRID_S", "fit_runtime_costs"]

PASS_GRID_S = tuple(i * 2e-5 for i in range(151))  # per-pass costs tried: 0 to 3 ms in 20 us steps


def fit_runtime_costs(measured_s: Sequence[float],
                      predicted_s: Sequence[Sequence[float]]) -> tuple[float, float, float]:
    """The per-pass cost (one of :data:`PASS_GRID_S`) and per-step cost (>= 0) that fit ``measured_s`` best, and the
    largest relative error left. ``predicted_s[k][i]``: run ``k``'s step predicted with per-pass cost
    ``PASS_GRID_S[i]`` and no per-step cost; the per-step cost for each is the least-squares one in closed form."""
    if not measured_s or len(measured_s) != len(predicted_s):
        raise ValueError(f"one row of predictions per measured step is needed, got {len(measured_s)} steps and "
                         f"{len(predicted_s)} rows")
    best = (float("inf"), 0.0, 0.0)
    for i, o in enumerate(PASS_GRID_S):
        pred = [row[i] for row in predicted_s]
        # Minimising sum(((p + s) / t - 1) ** 2) over s: s = sum((t - p) / t**2) / sum(1 / t**2).
        s = max(0.0, sum((t - p) / t ** 2 for p, t in zip(pred, measured_s)) / sum(1 / t ** 2 for t in measured_s))
        loss = sum(((p + s) / t - 1) ** 2 for p, t in zip(pred, measured_s))
        if loss < best[0]:
            best = (loss, o, s)
    _, o, s = best
    worst = max(abs((row[PASS_GRID_S.index(o)] + s) / t - 1) for row, t in zip(predicted_s, measured_s))
    return o, s, worst
