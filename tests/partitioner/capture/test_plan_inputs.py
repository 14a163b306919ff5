"""Example inputs are one microbatch: a plan records the shapes and dtypes it was traced with, and binding it to
example inputs of other shapes (``bind(..., microbatches=m)``, as ``PipelineRunner.from_plan_file`` does) is a
``PlanMismatchError`` that names the expected and the given shapes, before any step runs."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner import DeviceRates, PartitionPlan, partition, trace
from partitioner.capture.plan_inputs import input_record, inputs_mismatch
from partitioner.cut.plan import PlanError, PlanMismatchError


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.head(self.emb(ids) * scale)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _mlp() -> Mlp:
    torch.manual_seed(0)
    return Mlp()


def _plan(x: torch.Tensor) -> PartitionPlan:
    """A plan of the MLP traced on ``x``, read back from its JSON (as a plan file is)."""
    return PartitionPlan.from_json(partition(trace(_mlp(), (x,), {}), 2, rates=DeviceRates()).to_json())


def test_a_plan_records_its_traced_tensor_inputs_and_round_trips_them():
    graph = trace(Embed(), (torch.zeros(2, 8, dtype=torch.long),), {"scale": 0.5})
    plan = partition(graph, 2, rates=DeviceRates())
    assert plan.inputs == {"ids": {"shape": [2, 8], "dtype": "int64"}} == input_record(graph)  # constants: not
    text = plan.to_json()
    back = PartitionPlan.from_json(text)
    assert '"inputs"' in text and back == plan and back.to_json() == text


def test_the_plans_own_example_shapes_bind():
    plan = _plan(torch.randn(2, 16))
    assert plan.bind(trace(_mlp(), (torch.randn(2, 16),), {}), microbatches=4).graph is not None


def test_the_whole_batch_as_example_inputs_is_refused_naming_both_shapes():
    plan = _plan(torch.randn(2, 16))
    whole = trace(_mlp(), (torch.randn(8, 16),), {})
    with pytest.raises(PlanMismatchError) as err:
        plan.bind(whole, "plan file p.json", microbatches=4)
    assert str(err.value) == (
        "plan file p.json was made for example inputs of other shapes: input 'x' is float32 (8, 16) here but "
        "float32 (2, 16) in the plan. These look like the whole batch of 8 (4 microbatches of 2): example inputs are "
        "one microbatch, x[:2] here; or make a plan from these inputs (partitioner.partition, smp inspect --json)")
    assert plan.bind(whole).graph is not None  # without microbatches (the smp API's partition_file): shapes are free


def test_other_shapes_and_dtypes_are_refused_with_what_to_do():
    plan = _plan(torch.randn(2, 16))
    with pytest.raises(PlanMismatchError, match=r"input 'x' is float32 \(3, 16\) here but float32 \(2, 16\) in "
                                                r"the plan\. Example inputs are one microbatch, of the shapes the plan "
                                                r"was made from; or make a plan from these inputs"):
        plan.bind(trace(_mlp(), (torch.randn(3, 16),), {}), microbatches=4)
    double = _mlp().double()
    with pytest.raises(PlanMismatchError, match=r"input 'x' is float64 \(2, 16\) here but float32 \(2, 16\)"):
        plan.bind(trace(double, (torch.randn(2, 16, dtype=torch.float64),), {}), microbatches=1)


def test_another_model_is_still_named_as_such_and_a_plan_without_the_record_is_not_checked():
    plan = _plan(torch.randn(2, 16))
    other = trace(Embed(), (torch.zeros(2, 8, dtype=torch.long),), {})  # other input names: the ops tell
    with pytest.raises(PlanMismatchError, match="does not fit this model"):
        plan.bind(other, microbatches=2)
    old = PartitionPlan.from_dict({k: v for k, v in plan.to_dict().items() if k != "inputs"})
    assert old.inputs == {} and old.bind(trace(_mlp(), (torch.randn(8, 16),), {}), microbatches=4).graph is not None


def test_a_dynamic_dimension_matches_any_size_and_a_malformed_record_names_the_value():
    graph = trace(_mlp(), (torch.randn(8, 16),), {})
    assert inputs_mismatch({"x": {"shape": [None, 16], "dtype": "float32"}}, graph, 4) is None
    assert inputs_mismatch({"x": {"shape": [2, 16], "dtype": "float32"}}, graph, None) is None
    malformed = PartitionPlan.from_dict({**_plan(torch.randn(2, 16)).to_dict(), "inputs": {"x": {"shape": "2x16"}}})
    with pytest.raises(PlanError, match=r"p.json has a malformed record of its example inputs: plan key inputs\['x'\]: "
                                        r"expected .* got \{'shape': '2x16'\}"):
        malformed.bind(graph, "p.json", microbatches=4)
    with pytest.raises(PlanError, match=r"plan key inputs: expected a JSON object, got \[1\]"):
        PartitionPlan.from_dict({**_plan(torch.randn(2, 16)).to_dict(), "inputs": [1]})


def test_a_plan_priced_at_another_microbatch_size_records_that_size_and_binds_there():
    from partitioner.capture.plan_inputs import record_at_batch

    record = {"ids": {"shape": [4, 32], "dtype": "int64"}, "mask": {"shape": [4, 32], "dtype": "bool"},
              "table": {"shape": [7, 4], "dtype": "float32"}}
    assert record_at_batch(record, 8) == {"ids": {"shape": [8, 32], "dtype": "int64"},
                                          "mask": {"shape": [8, 32], "dtype": "bool"},
                                          "table": {"shape": [7, 4], "dtype": "float32"}}
    assert record_at_batch({"n": {"shape": [], "dtype": "int64"}}, 8) == {"n": {"shape": [], "dtype": "int64"}}
    # A plan of a trace at 4 samples, rescaled to 8: a trace at 8 binds it, one at 4 no longer does.
    plan = _plan(torch.randn(4, 16))
    plan.inputs = record_at_batch(plan.inputs, 8)
    assert plan.bind(trace(_mlp(), (torch.randn(8, 16),), {}), microbatches=2).graph is not None
    with pytest.raises(PlanMismatchError, match=r"'x' is float32 \(4, 16\) here but float32 \(8, 16\) in the plan"):
        plan.bind(trace(_mlp(), (torch.randn(4, 16),), {}), microbatches=2)
