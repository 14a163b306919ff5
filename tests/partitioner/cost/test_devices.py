"""Device profiles and links: the datasheet figures, how options resolve them, and that a plan's JSON gives
back exactly the rates it was priced with."""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

import partitioner
from partitioner import DeviceRates, MemoryBudgetError, PartitionOptions, PartitionPlan, UnknownDeviceError
from partitioner.cost.devices import LINKS, PROFILES, profile
from partitioner.cut.portfolio import fixed_plan
from tests.partitioner.cut.test_properties import synthetic_graph

GRAPH = synthetic_graph(40, np.random.default_rng(0))


def test_profiles_carry_the_datasheet_figures():
    h100 = profile("h100-80gb")
    assert (h100.flops_per_s, h100.tf32_flops_per_s, h100.bf16_flops_per_s) == (67e12, 494.5e12, 989.5e12)
    assert (h100.bytes_per_s, h100.memory_bytes, h100.link, h100.link_bytes_per_s) == (3.35e12, 80e9, "nvlink4", 450e9)
    assert profile("h200-141gb").bytes_per_s == 4.8e12 and profile("h200-141gb").memory_bytes == 141e9
    a40, a80 = profile("a100-40gb"), profile("a100-80gb")
    assert (a40.bytes_per_s, a80.bytes_per_s) == (1555e9, 2039e9)
    assert (a40.bf16_flops_per_s, a40.tf32_flops_per_s) == (312e12, 156e12)
    assert a40.matmul_flops_per_s("fp32") == 19.5e12 and a40.matmul_flops_per_s("fp16") == 312e12
    assert set(partitioner.DEVICES) == {"cpu", "a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb"}


@pytest.mark.parametrize("device", partitioner.DEVICES)
def test_every_profile_round_trips_through_the_plan_json(device, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # "cpu": a fresh calibration, cached there
    options = PartitionOptions(device=device, dtype="bf16", microbatches=4)
    plan = partitioner.partition(GRAPH, 3, options)
    back = PartitionPlan.from_json(plan.to_json())
    rates = DeviceRates.from_dict(back.rates)
    assert rates == options.resolve_rates() and DeviceRates(**back.rates) == rates
    if device != "cpu":
        assert rates == PROFILES[device]
    # The recorded options, with the recorded rates, make the same plan byte for byte.
    again = PartitionOptions.from_dict(back.options, rates=rates)
    assert partitioner.partition(GRAPH, 3, again).to_json() == plan.to_json()
    assert back.options["device"] == device and back.options["dtype"] == "bf16"


def test_named_links_replace_the_devices_own():
    options = PartitionOptions(device="h100-80gb", link="pcie5", inter_node_link="efa-p5")
    rates = options.resolve_rates()
    assert (rates.link, rates.link_bytes_per_s, rates.link_latency_s) == ("pcie5", LINKS["pcie5"].bytes_per_s,
                                                                           LINKS["pcie5"].latency_s)
    assert (rates.inter_node_link, rates.inter_node_bytes_per_s) == ("efa-p5", 50e9)
    assert rates.bf16_flops_per_s == profile("h100-80gb").bf16_flops_per_s
    # A slower link makes every crossing dearer: the same cut costs more communication.
    stage = np.repeat([0, 1], [20, 20])
    fast = fixed_plan(GRAPH, 2, stage, device="h100-80gb")
    slow = fixed_plan(GRAPH, 2, stage, device="h100-80gb", link="ethernet-10g")
    assert slow.stages[0].comm_s > 10 * fast.stages[0].comm_s


def test_hand_made_rates_win_over_the_device_and_need_passing_back():
    rates = DeviceRates(flops_per_s=1e12, name="my-npu", memory_bytes=1e12)
    plan = partitioner.partition(GRAPH, 2, rates=rates)
    assert DeviceRates.from_dict(plan.rates) == rates and plan.options["device"] == "my-npu"
    assert plan.options["device_memory"] == 1e12  # the device's memory is the default budget
    with pytest.raises(ValueError, match=re.escape("pass rates=DeviceRates.from_dict(plan.rates)")):
        PartitionOptions.from_dict(plan.options)


def test_device_memory_defaults_to_the_devices_size():
    h100 = profile("h100-80gb")
    assert PartitionOptions(device="h100-80gb").budget(h100) == 80e9
    assert PartitionOptions(device="h100-80gb", device_memory="unlimited").budget(h100) is None
    assert PartitionOptions(device="h100-80gb", device_memory="40GB").budget(h100) == 40e9
    assert PartitionOptions().budget(DeviceRates()) is None  # the CPU: no limit unless asked


def test_device_memory_default_is_enforced():
    big = dataclasses.replace(GRAPH, param_bytes=GRAPH.param_bytes * 10**5)  # ~ 2 TB of Adam state in all
    with pytest.raises(MemoryBudgetError, match="no 2-stage plan fits device_memory=74.5"):
        partitioner.partition(big, 2, device="a100-80gb")
    assert partitioner.partition(big, 2, device="a100-80gb", device_memory="unlimited").options["device_memory"] is None


@pytest.mark.parametrize("change, message", [
    (dict(device="tpu-v9"), "device='tpu-v9' is not known; use one of ['cpu', 'a100-40gb'"),
    (dict(link="carrier-pigeon"), "link='carrier-pigeon' is not a known link; use one of ['efa-p4d'"),
    (dict(inter_node_link="nvlink9"), "inter_node_link='nvlink9' is not a known link"),
    (dict(dtype="fp8"), "dtype='fp8' is not known; use one of ['fp32', 'tf32', 'bf16', 'fp16']"),
    (dict(device="h100-80gb", measure=True), "measure=True times every op on this machine's CPU in fp32"),
])
def test_unknown_names_are_errors_that_list_the_known_ones(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PartitionOptions(**change)


def test_device_errors_are_engine_errors():
    with pytest.raises(partitioner.EngineError):
        PartitionOptions(device="tpu-v9")
    with pytest.raises(UnknownDeviceError, match="'cpu' is measured"):
        profile("cpu")


@pytest.mark.parametrize("field, value", [("bytes_per_s", 0.0), ("flops_per_s", -1.0), ("link_latency_s", -1e-6),
                                          ("compute_efficiency", 1.5), ("memory_bytes", float("nan"))])
def test_bad_rates_are_rejected(field, value):
    with pytest.raises(ValueError, match=f"DeviceRates.{field}"):
        DeviceRates(**{field: value})


def test_unknown_rate_names_are_rejected():
    with pytest.raises(ValueError, match=re.escape("unknown device rate(s) ['flops']")):
        DeviceRates.from_dict({"flops": 1.0})
