"""Collective prices: NCCL's rings on a GPU's links; gloo on this host, where gathers cost an all-reduce."""
from __future__ import annotations

import dataclasses

import pytest

from partitioner import DeviceRates
from partitioner.cost.collectives import all_gather_s, all_reduce_s
from partitioner.cost.devices import profile

MB = 8 * 2 ** 20


def test_a_ring_all_gather_moves_half_an_all_reduces_bytes_on_a_gpu() -> None:
    h100 = profile("h100-80gb")
    assert not h100.collectives_on_host
    free = dataclasses.replace(h100, link_latency_s=0.0)
    assert all_gather_s(MB, 8, free) == pytest.approx(all_reduce_s(MB, 8, free) / 2)


def test_through_gloo_an_all_gather_costs_the_all_reduce_of_its_output() -> None:
    cpu = DeviceRates(name="cpu", collective_overhead_s=3e-3)
    assert cpu.collectives_on_host
    assert all_gather_s(MB, 2, cpu) == all_reduce_s(MB, 2, cpu) > 3e-3
    assert all_gather_s(MB, 1, cpu) == 0.0
