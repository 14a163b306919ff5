"""``smp.cli.analysis``: the plan with its baselines and schedule, in process."""
from __future__ import annotations

from partitioner import trace
from partitioner.cut.plan import PartitionPlan
from smp import zoo
from smp.cli.analysis import analyse
from smp.cli.options import Options
from smp.cli.target import Target


def test_plan_round_trips_in_process() -> None:
    z = zoo.build("mlp")
    graph = trace(z.model, z.args, z.kwargs)
    target = Target("zoo:mlp", z.model, z.args, z.kwargs)
    plan, sim = analyse(graph, Options(partitions=3, microbatches=6), target=target)
    assert plan.extra["schedule"]["predicted_step_s"] == sim.step_s
    back = PartitionPlan.from_json(plan.to_json())
    assert back == plan and back.to_json() == plan.to_json()
    # Same inputs, same plan, byte for byte (calibration is cached within a process).
    again, _ = analyse(graph, Options(partitions=3, microbatches=6), target=target)
    assert again.to_json() == plan.to_json()
