"""The step model: the simulator's step plus the runtime's per-pass and per-step costs, and nothing else."""
from __future__ import annotations

import dataclasses

import pytest

from partitioner import DeviceRates, calibrate
from pipeline.schedule import make_schedule
from pipeline.simulate import simulate
from pipeline.step_model import predict_step


def test_without_overheads_the_prediction_is_the_simulators_step() -> None:
    schedule = make_schedule("1f1b", 2, 4)
    plain = simulate(schedule, [1e-3, 2e-3], [2e-3, 3e-3], comm_s=1e-4)
    assert predict_step(schedule, [1e-3, 2e-3], [2e-3, 3e-3], DeviceRates(), comm_s=1e-4).step_s == plain.step_s


@pytest.mark.parametrize("name,p,m", [("1f1b", 2, 4), ("gpipe", 3, 2), ("1f1b", 1, 3)])
def test_every_pass_pays_the_pass_cost_and_the_step_its_fixed_cost(name: str, p: int, m: int) -> None:
    """Equal stages: the per-pass cost lengthens every pass on the critical path of (m + p - 1) forwards and as many
    backwards, and the per-step cost is added once."""
    rates = DeviceRates(pass_overhead_s=1e-3, step_overhead_s=5e-3)
    schedule = make_schedule(name, p, m)
    sim = predict_step(schedule, 2e-3, 4e-3, rates)
    assert sim.step_s == pytest.approx((m + p - 1) * (2e-3 + 4e-3 + 2 * 1e-3) + 5e-3)
    assert sim.idle_s == pytest.approx([sim.step_s - b for b in sim.busy_s])


def test_zero_bubble_splits_pay_the_pass_cost_per_action() -> None:
    rates = DeviceRates(pass_overhead_s=1e-3)
    schedule = make_schedule("zb-h1", 2, 4)
    with_cost = predict_step(schedule, [1e-3] * 2, [1e-3] * 2, rates, weight_s=[1e-3] * 2)
    without = predict_step(schedule, [1e-3] * 2, [1e-3] * 2, DeviceRates(), weight_s=[1e-3] * 2)
    # each rank runs 3 actions per microbatch (F, B, W), each 1 ms longer
    assert max(with_cost.busy_s) == pytest.approx(max(without.busy_s) + 3 * 4 * 1e-3)


def test_the_cpu_profile_carries_the_runtimes_costs_and_gpu_profiles_none(monkeypatch) -> None:
    from partitioner import profile
    from partitioner.cost import calibration
    from partitioner.cost.calibration import CPU_PASS_OVERHEAD_S, CPU_STEP_OVERHEAD_S, recorded_runtime_costs

    # Read the profile and the recorded costs afresh: another process (smp calibrate, a first multi-rank command run
    # by an earlier test) may have recorded them since this process first calibrated.
    monkeypatch.setattr(calibration, "_LOADED", {})
    cpu = calibrate()
    costs = recorded_runtime_costs()  # this machine's, once measured; until then the defaults
    expected = (costs["pass_overhead_s"], costs["step_overhead_s"]) if costs else (CPU_PASS_OVERHEAD_S,
                                                                                   CPU_STEP_OVERHEAD_S)
    assert (cpu.pass_overhead_s, cpu.step_overhead_s) == expected
    h100 = profile("h100-80gb")
    assert (h100.pass_overhead_s, h100.step_overhead_s) == (0.0, 0.0)
    with pytest.raises(ValueError, match="pass_overhead_s must be a non-negative"):
        dataclasses.replace(h100, pass_overhead_s=-1.0)
