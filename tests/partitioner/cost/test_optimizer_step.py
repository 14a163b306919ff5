"""The optimizer step's price: the bytes torch's foreach implementations stream, over the memory rate."""
from __future__ import annotations

import dataclasses

import pytest

from partitioner import DeviceRates
from partitioner.cost.optimizer_step import optimizer_step_s

RATES = DeviceRates(bytes_per_s=1e10, memory_efficiency=0.5)


def test_adam_streams_19_fp32_accesses_per_element_adamw_21_and_sgd_8() -> None:
    elements = 1_000_000
    assert optimizer_step_s(8 * elements, 0, "adam", RATES) == pytest.approx(19 * 4 * elements / 5e9)
    assert optimizer_step_s(8 * elements, 0, "adamw", RATES) == pytest.approx(21 * 4 * elements / 5e9)
    assert optimizer_step_s(4 * elements, 0, "sgd", RATES) == pytest.approx(8 * 4 * elements / 5e9)
    assert optimizer_step_s(0, 0, "none", RATES) == 0.0


def test_mixed_precision_copies_the_master_weights_and_a_faster_memory_is_faster() -> None:
    elements = 1_000_000
    plain = optimizer_step_s(8 * elements, 0, "adam", RATES)
    assert optimizer_step_s(8 * elements, 4 * elements, "adam", RATES) == pytest.approx(plain + 6 * elements / 5e9)
    faster = dataclasses.replace(RATES, bytes_per_s=2e10)
    assert optimizer_step_s(8 * elements, 0, "adam", faster) == pytest.approx(plain / 2)

