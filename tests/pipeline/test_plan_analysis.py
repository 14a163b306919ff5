"""``pipeline.plan_analysis``: the plan with its baselines, its simulated schedule and what each stage holds; the
stages timed for real on example inputs; under sharding the stages are cut without the memory budget."""
from __future__ import annotations

import pytest

from partitioner import MemoryBudgetError, PartitionOptions, trace
from pipeline.plan_analysis import analyse
from smp import zoo

OPTIONS = PartitionOptions(device="h100-80gb", microbatches=6)


def test_the_plan_records_its_baselines_schedule_and_memory() -> None:
    z = zoo.build("mlp")
    graph = trace(z.model, z.args, z.kwargs)
    plan, sim = analyse(graph, 3, OPTIONS, pipeline="interleaved", target="zoo:mlp")
    assert set(plan.extra["baselines"]) == {"uniform", "params", "layers"}
    assert plan.extra["schedule"] == {"microbatches": 6, "pipeline": "interleaved", "schedule": "1f1b",
                                      "predicted_step_s": sim.step_s, "bubble": sim.bubble,
                                      "throughput_microbatches_per_s": 6 / sim.step_s}
    assert len(plan.extra["memory"]) == 3 and plan.extra["target"] == "zoo:mlp" and "measured" not in plan.extra
    again, _ = analyse(graph, 3, OPTIONS, pipeline="interleaved", target="zoo:mlp")
    assert again.to_json() == plan.to_json()  # same inputs, same plan, byte for byte


def test_the_stages_are_timed_on_the_example_inputs() -> None:
    z = zoo.build("mlp")
    graph = trace(z.model, z.args, z.kwargs)
    plan, _ = analyse(graph, 2, PartitionOptions(microbatches=2), measure_inputs=(z.args, z.kwargs))
    measured = plan.extra["measured"]
    assert len(measured["forward_s"]) == 2 and measured["predicted_step_s"] > 0
    assert all(s.measured_s is not None and s.measured_s > 0 for s in plan.stages)
    assert plan.extra["schedule"]["pipeline"] == "1f1b"  # the schedule's name when none is given


def test_sharded_stages_are_cut_without_the_budget() -> None:
    z = zoo.build("mlp")
    graph = trace(z.model, z.args, z.kwargs)
    tight = PartitionOptions.of(OPTIONS, device_memory=1000)
    with pytest.raises(MemoryBudgetError):
        analyse(graph, 2, tight)
    plan, _ = analyse(graph, 2, tight, sdp=2)
    assert plan.num_stages == 2
