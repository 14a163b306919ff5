"""``PartitionPlan.from_json`` / ``from_dict``: a malformed plan is a PlanError that names the key and the value,
never an IndexError, KeyError or TypeError, and nothing is silently rounded."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import partitioner
from partitioner.capture.graph import OpGraph
from partitioner.cut.plan import PartitionPlan, PlanError
from partitioner.errors import EngineError


@pytest.fixture(scope="module")
def plan_data() -> dict[str, Any]:
    n = 6
    graph = OpGraph(names=[f"op{i}" for i in range(n)], kinds=["aten.mm"] * (n - 1) + ["output"],
                    modules=[""] * n, flops=np.full(n, 1e6), out_bytes=np.full(n, 1024),
                    act_bytes=np.full(n, 1024), move_bytes=np.full(n, 4096), src=np.arange(n - 1),
                    dst=np.arange(1, n), value=np.arange(n - 1), value_bytes=np.full(n - 1, 1024))
    return json.loads(partitioner.partition(graph, 2).to_json())


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def change(data: dict) -> None:
        *parents, last = path.split(".")
        target: Any = data
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        if value is _DELETE:
            del target[last]
        else:
            target[int(last) if isinstance(target, list) else last] = value
    return change


_DELETE = object()


@pytest.mark.parametrize("change, message", [
    (_set("assignment.op1", 1.7), r"assignment\['op1'\]: expected an integer, got 1.7"),
    (_set("assignment.op1", 2), r"assignment\['op1'\]: 2 is out of range, expected an integer in \[0, 2\)"),
    (_set("assignment.op1", -1), r"assignment\['op1'\]: -1 is out of range"),
    (_set("assignment.op1", True), r"assignment\['op1'\]: expected an integer, got True"),
    (_set("assignment", [0, 1]), r"plan key assignment: expected a JSON object, got \[0, 1\]"),
    (_set("num_stages", 3), r"stages: 2 stage\(s\) listed but num_stages is 3"),
    (_set("num_stages", "2"), r"num_stages: expected an integer, got '2'"),
    (_set("num_stages", 0), r"num_stages: 0 is out of range"),
    (_set("stages", {"0": {}}), r"plan key stages: expected a JSON list"),
    (_set("stages.1", "stage"), r"plan key stages\[1\]: expected a JSON object, got 'stage'"),
    (_set("stages.1.cost_s", _DELETE), r"plan key stages\[1\]: missing \['cost_s'\]; a stage has \["),
    (_set("stages.1.colour", "red"), r"plan key stages\[1\]: unknown key\(s\) \['colour'\]"),
    (_set("stages.1.index", 0), r"stages\[1\].index: 0 is out of range, expected an integer in \[1, 2\)"),
    (_set("stages.0.nodes", 2.5), r"stages\[0\].nodes: expected an integer, got 2.5"),
    (_set("stages.0.cost_s", "fast"), r"stages\[0\].cost_s: expected a finite number >= 0, got 'fast'"),
    (_set("stages.0.cost_s", float("nan")), r"stages\[0\].cost_s: expected a finite number >= 0, got nan"),
    (_set("stages.0.modules", "layer"), r"stages\[0\].modules: expected a JSON list, got 'layer'"),
    (_set("stages.0.outputs_to", [5]), r"stages\[0\].outputs_to\[0\]: 5 is out of range"),
    (_set("balance", float("inf")), r"plan key balance: expected a finite number >= 0, got inf"),
    (_set("lower_bound_s", None), r"plan key lower_bound_s: expected a finite number >= 0, got None"),
    (_set("cut_bytes", _DELETE), r"the partition plan is missing \['cut_bytes'\]"),
    (_set("shared_params", {"w": [0, 7]}), r"shared_params\['w'\]\[1\]: 7 is out of range"),
    (_set("rates", {"flops_per_s": -1.0}), r"rates\['flops_per_s'\]: expected a finite number >= 0, got -1.0"),
    (_set("method", 3), r"plan key method: expected a JSON str, got 3"),
    (_set("tensor_parallel", [8]), r"plan key tensor_parallel: expected a JSON object, got \[8\]"),
    (_set("tensor_parallel", {"degree": 0}), r"tensor_parallel.degree: 0 is out of range, expected an integer >= 1"),
    (_set("tensor_parallel", {"comm_s": []}), r"tensor_parallel.degree: expected an integer, got None"),
])
def test_a_malformed_plan_names_the_key_and_value(plan_data, change, message) -> None:
    data = json.loads(json.dumps(plan_data))
    change(data)
    with pytest.raises(PlanError, match=message) as info:
        PartitionPlan.from_dict(data)
    assert isinstance(info.value, EngineError) and isinstance(info.value, ValueError)
    with pytest.raises(PlanError, match=message):
        PartitionPlan.from_json(json.dumps(data))


def test_a_good_plan_still_round_trips(plan_data, tmp_path: Path) -> None:
    text = json.dumps(plan_data, indent=1, sort_keys=True)
    plan = PartitionPlan.from_json(text)
    assert plan.to_json() == text
    (tmp_path / "plan.json").write_text(text + "\n")
    assert PartitionPlan.from_json(tmp_path / "plan.json") == plan  # a Path, too


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", r"expected a JSON object, got list"),
    ('{"num_stages": 2,', r"invalid JSON at line 1 column \d+"),
])
def test_text_that_is_not_a_plan(text, message) -> None:
    with pytest.raises(PlanError, match=message):
        PartitionPlan.from_json(text)


def test_a_file_that_is_not_json_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text("stages: 2\n")
    with pytest.raises(PlanError, match=f"invalid JSON in {path} at line 1 column 1"):
        PartitionPlan.from_json(str(path))
