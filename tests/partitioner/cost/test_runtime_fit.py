"""``partitioner.cost.runtime_fit``: the per-pass and per-step costs that made a set of steps are found again, and
the per-step cost is never negative."""
from __future__ import annotations

import pytest

from partitioner.cost.runtime_fit import PASS_GRID_S, fit_runtime_costs


def _rows(base: list[float], passes: list[int]) -> list[list[float]]:
    """Predicted steps per grid cost of runs whose ops take ``base`` and whose critical paths have ``passes``."""
    return [[b + n * o for o in PASS_GRID_S] for b, n in zip(base, passes)]


def test_the_fit_recovers_the_costs_that_made_the_steps() -> None:
    base, passes = [3e-3, 5e-3, 9e-3], [6, 10, 18]
    measured = [b + n * 8.4e-4 + 2.5e-3 for b, n in zip(base, passes)]
    o, s, worst = fit_runtime_costs(measured, _rows(base, passes))
    assert o == pytest.approx(8.4e-4, abs=1e-9) and s == pytest.approx(2.5e-3, rel=1e-6) and worst < 1e-9


def test_the_fit_never_gives_a_negative_step_cost() -> None:
    base, passes = [3e-3, 5e-3, 9e-3], [6, 10, 18]
    measured = [b + n * 5e-4 - 1e-3 for b, n in zip(base, passes)]  # steps shorter than a cost-free pass model
    o, s, _ = fit_runtime_costs(measured, _rows(base, passes))
    assert s == 0.0 and 0 < o < 5e-4
    with pytest.raises(ValueError, match="one row of predictions per measured step is needed, got 2 steps and 1"):
        fit_runtime_costs([1.0, 2.0], _rows([1.0], [2]))
