"""Partitioning the model zoo: every model, 2/4/8 stages, complete, acyclic and exact.

Each zoo model is traced once per module (a fixture) and the graph is reused for every stage count. Exact
means: the staged module (``plan.as_module()``) gives the same outputs, loss, gradient of every parameter
and, in train mode, the same BatchNorm running statistics as the original model; and so does running the
stages the way a pipeline does (every tensor received from another stage a fresh autograd leaf).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import partitioner
from partitioner import PartitionPlan
from partitioner.capture.stage_modules import split
from partitioner.cut.baselines import all_baselines
from partitioner.cut.objective import NEAR, check_acyclic, dominates, evaluate
from partitioner.cut.portfolio import fixed_plan, make_problem
from smp import zoo
from tests.conftest import (
    assert_complete_and_acyclic,
    assert_same_step,
    pipeline_step,
    restore_buffers,
    snapshot_buffers,
    stage_array,
    train_step,
)
from tests.partitioner.cut.test_objective import FAST_LINK, embedding_first

STAGES = (2, 4, 8)


class Traced:
    """A zoo model, its graph, the buffers before any step and the reference training step."""

    def __init__(self, name: str):
        torch.manual_seed(0)
        self.zm = zoo.build(name, batch=2)
        self.graph = partitioner.trace(self.zm.model, self.zm.args, self.zm.kwargs)
        self.initial_buffers = snapshot_buffers(self.zm.model)
        self.want = self.step(self.zm.model)

    def step(self, forward):
        restore_buffers(self.zm.model, self.initial_buffers)
        zm = self.zm
        return train_step(zm.model, forward, zm.args, zm.kwargs, zm.loss_fn, zm.target)

    def pipeline_step(self, split_model):
        restore_buffers(self.zm.model, self.initial_buffers)
        zm = self.zm
        return pipeline_step(zm.model, split_model, zm.args, zm.kwargs, zm.loss_fn, zm.target)


@pytest.fixture(scope="module", params=zoo.NAMES)
def traced(request) -> Traced:
    return Traced(request.param)


@pytest.fixture(scope="module")
def gpt2() -> Traced:
    return Traced("gpt2")


@pytest.mark.parametrize("k", STAGES)
def test_zoo_plan_is_complete_acyclic_and_exact(traced, k):
    g = traced.graph
    plan = partitioner.partition(g, k)
    stage = assert_complete_and_acyclic(plan, g)
    check_acyclic(g, stage)
    assert plan.num_stages == k and len(plan.stages) == k
    assert sum(s.nodes for s in plan.stages) == g.num_nodes
    assert all(s.nodes > 0 for s in plan.stages), [s.nodes for s in plan.stages]
    assert plan.lower_bound > 0 and plan.bottleneck >= plan.lower_bound * (1 - 1e-12)
    assert plan.balance == pytest.approx(plan.bottleneck / plan.lower_bound)
    # Every stage reads only from earlier stages (or the model inputs).
    assert all(src < s.index for s in plan.stages for src in s.inputs_from)

    staged = plan.as_module()
    assert staged.training
    got = traced.step(staged)
    assert_same_step(got, traced.want)


def test_zoo_train_mode_updates_buffers(traced):
    """The exactness test compares buffers; make sure they really move for the BatchNorm models."""
    model = traced.zm.model
    moved = [n for n, b in model.named_buffers() if not torch.equal(traced.want.buffers[n], traced.initial_buffers[n])]
    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert bool(moved) == has_bn, moved
    if has_bn:
        assert any(n.endswith("running_mean") for n in moved) and any(n.endswith("num_batches_tracked") for n in moved)


def test_zoo_stages_run_as_pipeline_exactly(traced):
    """Stage inputs as fresh leaves (what a pipeline rank gets): in-place ops on received tensors must not
    break autograd (HF ResNet's ``hidden += residual``), and per-stage backward gives the same gradients."""
    g = traced.graph
    plan = partitioner.partition(g, 8)
    got = traced.pipeline_step(split(g, plan.assignment, 8))
    assert_same_step(got, traced.want)


def test_staged_module_trains_the_models_own_parameters(traced):
    plan = partitioner.partition(traced.graph, 2)
    model_params = {id(p) for p in traced.zm.model.parameters()}
    staged_params = {id(p) for p in plan.as_module().parameters()}
    assert staged_params <= model_params


def test_stage_modules_wiring(traced):
    g = traced.graph
    plan = partitioner.partition(g, 4)
    stages = plan.stage_modules()
    assert [s.index for s in stages] == [0, 1, 2, 3]
    for s in stages:
        for value, src in s.sources.items():
            assert src < s.index, (s.index, value, src)  # MODEL_INPUT is -1
        for readers in s.consumers.values():
            assert readers and all(r > s.index for r in readers)
    assert stages[-1].consumers == {}


@pytest.mark.parametrize("weight", [0.0, 0.2])
def test_no_baseline_dominates_on_zoo(traced, weight):
    """No baseline is as good in bottleneck, cut bytes and largest-stage memory and better in one."""
    g = traced.graph
    for k in STAGES:
        ours = partitioner.partition(g, k, memory_weight=weight)
        for name, b in all_baselines(make_problem(g, k, memory_weight=weight)).items():
            assert not dominates(b.axes, ours.axes), (traced.zm.name, k, name, b.axes, ours.axes)


def _llama_meta(layers: int = 8, hidden: int = 1024) -> tuple[torch.nn.Module, tuple]:
    import transformers

    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden * 7 // 2,
                                   num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                                   max_position_embeddings=512, use_cache=False)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg), (torch.zeros(1, 512, dtype=torch.long),)


@pytest.fixture(scope="module")
def llama():
    model, args = _llama_meta()
    return partitioner.trace(model, args)


@pytest.mark.parametrize("weight", [0.0, 0.2])
def test_llama_on_h100_in_bf16_is_never_dominated(llama, weight):
    """A meta-built Llama shape (8 layers, hidden 1024) planned for H100s in bf16: for 2, 4 and 8 stages no
    baseline is as good on every axis and better on one (the 70B shape lost to ``params`` on all three)."""
    options = partitioner.PartitionOptions(device="h100-80gb", dtype="bf16", microbatches=8, memory_weight=weight)
    for k in (2, 4, 8):
        ours = partitioner.partition(llama, k, options)
        assert ours.rates["name"] == "h100-80gb" and ours.options["dtype"] == "bf16"
        for name, b in all_baselines(make_problem(llama, k, options)).items():
            assert not dominates(b.axes, ours.axes), (k, name, b.axes, ours.axes)


@pytest.mark.parametrize("method", ["dp", "metis"])
def test_each_method_is_exact(gpt2, method):
    for k in (2, 4):
        plan = partitioner.partition(gpt2.graph, k, method=method)
        assert plan.method == method
        assert_complete_and_acyclic(plan, gpt2.graph)
        assert_same_step(gpt2.step(plan.as_module()), gpt2.want)


def test_one_stage_is_the_whole_model(gpt2):
    for method in ("auto", "dp", "metis"):
        plan = partitioner.partition(gpt2.graph, 1, method=method)
        assert set(plan.assignment.values()) == {0}
        assert plan.balance == pytest.approx(1.0) and plan.cut_bytes == 0
        assert_same_step(gpt2.step(plan.as_module()), gpt2.want)


# --- tied parameters -----------------------------------------------------------------------------------


def test_gpt2_tied_embedding_is_listed_as_shared(gpt2):
    g = gpt2.graph
    model = gpt2.zm.model
    assert model.lm_head.weight is model.transformer.wte.weight
    assert "transformer.wte.weight" in g.param_names and "lm_head.weight" not in g.param_names
    wte = g.param_names.index("transformer.wte.weight")
    users = sorted(set(g.use_node[g.use_param == wte].tolist()))
    assert {g.modules[u] for u in users} == {"transformer.wte", "lm_head"}
    for k in STAGES:
        plan = partitioner.partition(g, k)
        stage = stage_array(plan, g)
        holders = sorted({int(stage[u]) for u in users})
        assert len(holders) == 2, "embedding and lm_head should land on different stages"
        assert plan.shared_params["transformer.wte.weight"] == holders
        assert "shared parameters" in plan.summary() and "transformer.wte.weight" in plan.summary()
        # Each holder stage refers to the one tensor, under its canonical name.
        stages = plan.stage_modules()
        for s in holders:
            assert "transformer.wte.weight" in stages[s].param_names.values()
        # Memory: both holders pay for the replica.
        assert all(plan.stages[s].param_bytes >= g.param_bytes[wte] for s in holders)


def test_gpt2_tied_gradient_sums_both_uses(gpt2):
    """The staged run's gradient of the tied weight equals the model's (embedding + lm_head contributions)."""
    plan = partitioner.partition(gpt2.graph, 4)
    got = gpt2.step(plan.as_module())
    torch.testing.assert_close(got.grads["transformer.wte.weight"], gpt2.want.grads["transformer.wte.weight"],
                               rtol=1e-5, atol=1e-7)


def test_parameters_not_shared_are_on_one_stage(traced):
    g = traced.graph
    plan = partitioner.partition(g, 4)
    stage = stage_array(plan, g)
    for q, name in enumerate(g.param_names):
        holders = set(stage[g.use_node[g.use_param == q]].tolist())
        assert (len(holders) > 1) == (name in plan.shared_params), name


# --- determinism and JSON ------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["auto", "dp", "metis"])
def test_same_graph_same_options_same_json(gpt2, method):
    a = partitioner.partition(gpt2.graph, 4, method=method, microbatches=4)
    b = partitioner.partition(gpt2.graph, 4, method=method, microbatches=4)
    assert a.to_json() == b.to_json()


def test_same_model_traced_twice_gives_byte_identical_plans():
    zm = zoo.build("bert", batch=2)
    plans = [partitioner.partition(zm.model, 4, example_inputs=zm.args, example_kwargs=zm.kwargs,
                                   device_memory="4GiB", memory_weight=0.3).to_json() for _ in range(2)]
    assert plans[0] == plans[1]


def test_json_round_trip(gpt2, tmp_path):
    plan = partitioner.partition(gpt2.graph, 4)
    text = plan.to_json()
    back = PartitionPlan.from_json(text)
    assert back == plan
    assert back.to_json() == text
    path = tmp_path / "plan.json"
    plan.to_json(str(path))
    assert PartitionPlan.from_json(str(path)).to_json() == text
    data = json.loads(text)
    assert data["num_stages"] == 4 and "lower_bound_s" in data and "bottleneck_s" in data
    assert data["shared_params"] == {"transformer.wte.weight": plan.shared_params["transformer.wte.weight"]}
    # A plan read back from JSON runs once it is given the traced graph.
    assert_same_step(gpt2.step(back.as_module(graph=gpt2.graph)), gpt2.want)


def test_plans_are_identical_across_processes_with_fixed_rates():
    """With the device rates pinned (no calibration), a fresh interpreter makes the same bytes."""
    code = textwrap.dedent("""
        import sys, torch
        import partitioner
        from smp import zoo
        zm = zoo.build("mlp", batch=2)
        plan = partitioner.partition(zm.model, 3, example_inputs=zm.args, rates=partitioner.DeviceRates())
        sys.stdout.write(plan.to_json())
    """)
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    zm = zoo.build("mlp", batch=2)
    here = partitioner.partition(zm.model, 3, example_inputs=zm.args, rates=partitioner.DeviceRates()).to_json()
    assert there == here


# --- plan numbers ----------------------------------------------------------------------------------------


def test_plan_numbers_agree_with_the_objective(traced):
    g = traced.graph
    p = make_problem(g, 4, rates=partitioner.calibrate())
    plan = partitioner.partition(g, 4)
    ev = evaluate(p, stage_array(plan, g))
    assert plan.bottleneck == pytest.approx(ev.bottleneck)
    assert plan.cut_bytes == ev.cut_bytes
    assert plan.lower_bound == pytest.approx(max(p.time.sum() / 4, p.time.max()))
    assert [s.cost_s for s in plan.stages] == pytest.approx(ev.cost_s.tolist())
    assert sum(s.bytes_in for s in plan.stages) == plan.cut_bytes


def test_memory_budget_is_respected(gpt2):
    p1 = partitioner.partition(gpt2.graph, 4)
    budget = int(max(s.memory_bytes for s in p1.stages) * 1.01)
    plan = partitioner.partition(gpt2.graph, 4, device_memory=budget)
    assert all(s.memory_bytes <= budget for s in plan.stages)


@pytest.mark.parametrize("weight", [0.0, 0.2])
def test_a_tight_budget_balances_memory_and_no_budget_keeps_the_fastest_cut(weight):
    """An embedding-heavy first op: the time-balanced cut puts 680 MiB on stage 0; under a 700 MiB budget
    (2.9% to spare) the plan moves a layer off it (600 MiB, 14% to spare); without a budget, or with room,
    the cut is the time-balanced one, as before. Either way the plan's numbers are the objective's own."""
    g = embedding_first()
    plans = {budget: partitioner.partition(g, 2, rates=FAST_LINK, memory_weight=weight, device_memory=budget)
             for budget in ("unlimited", "2GiB", "700MiB")}
    assert stage_array(plans["unlimited"], g).tolist() == stage_array(plans["2GiB"], g).tolist() == [0, 0, 1, 1, 1]
    tight = plans["700MiB"]
    assert stage_array(tight, g).tolist() == [0, 1, 1, 1, 1]
    assert tight.max_memory_bytes <= 0.9 * (700 << 20) < plans["unlimited"].max_memory_bytes
    assert tight.bottleneck > plans["unlimited"].bottleneck
    p = make_problem(g, 2, rates=FAST_LINK, memory_weight=weight, device_memory="700MiB")
    ev = evaluate(p, stage_array(tight, g))
    assert tight.bottleneck == pytest.approx(ev.bottleneck) and tight.max_memory_bytes == pytest.approx(ev.memory.max())
    assert tight.lower_bound == pytest.approx(max(p.time.sum() / 2, p.time.max()))
    again = partitioner.partition(g, 2, rates=FAST_LINK, memory_weight=weight, device_memory="700MiB")
    assert again.to_json() == tight.to_json()


def test_gpipe_holds_more_activations_than_1f1b(gpt2):
    a = partitioner.partition(gpt2.graph, 4, microbatches=8, pipeline="gpipe", memory_weight=0.0, method="dp")
    b = fixed_plan(gpt2.graph, 4, stage_array(a, gpt2.graph), microbatches=8, pipeline="1f1b", memory_weight=0.0)
    assert a.stages[-1].memory_bytes > b.stages[-1].memory_bytes



def test_transformer_balance_goal():
    """Predicted balance <= 1.05 for a transformer with >= 2 blocks per stage (GPT-2 base: 12 blocks)."""
    zm = zoo.build("gpt2", batch=4, size="base")
    g = partitioner.trace(zm.model, zm.args, zm.kwargs)
    rates = partitioner.DeviceRates()  # pinned, so the check does not depend on this machine's load
    for k in (2, 4):
        plan = partitioner.partition(g, k, memory_weight=0.0, rates=rates)
        assert plan.balance <= 1.05, (k, plan.balance)
        best = min(b.balance for b in all_baselines(make_problem(g, k, memory_weight=0.0, rates=rates)).values())
        assert plan.balance <= best * (1 + NEAR)  # within 1% of it, and then with fewer bytes cut



def test_partition_cuts_by_the_costs_it_is_given():
    """Per-op costs from a profile replace the cost model's: a block measured slow gets a stage of its own."""
    import numpy as np

    from partitioner import DeviceRates, NodeCosts, estimate, partition, trace

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])
    graph = trace(model, (torch.randn(2, 16),), {})
    est = estimate(graph, DeviceRates())
    slow = np.array([m == "5" for m in graph.modules])
    costs = NodeCosts(np.where(slow, 100.0, 1.0) * est.forward_s, np.where(slow, 100.0, 1.0) * est.backward_s,
                      est.needs_grad)
    plan = partition(graph, 2, rates=DeviceRates(), memory_weight=0.0, costs=costs)
    assert {plan.assignment[n] for n, m in zip(graph.names, graph.modules) if m == "5"} == {1}
    assert all(plan.assignment[n] == 0 for n, m in zip(graph.names, graph.modules) if m in "01234" and m)
    with pytest.raises(ValueError, match="costs has 3 ops but the graph has"):
        partition(graph, 2, costs=NodeCosts(np.ones(3), np.ones(3), np.ones(3, bool)))


def test_time_prices_keeps_the_cost_models_cut_and_prices_it_as_timed(tmp_path, monkeypatch):
    """SMP's trace_execution_times=False on a CPU: the stages are cut by the cost model (deterministic), and the plan's
    stage seconds, from which every prediction of the run comes, are the ops timed on this machine; a model without
    weights, which cannot run here, keeps the estimate."""
    import numpy as np

    from partitioner import partition, trace
    from partitioner.cost import op_times
    from partitioner.cost.op_times import timed_costs

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(op_times, "probe_s", lambda: 1.0)  # the machine's speed held still: the entry is read back
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(6)])
    x = torch.randn(16, 64)
    graph = trace(model, (x,))
    estimated = partition(graph, 3, microbatches=4)
    timed = partition(graph, 3, microbatches=4, time_prices=True, example_inputs=(x,))
    assert timed.assignment == estimated.assignment
    assert timed.options["measured"] and not estimated.options["measured"]
    costs = timed_costs(graph, (x,), {}, partitioner.calibrate())  # the entry the plan read
    stage = timed.stage_of_ops(graph)
    for s in timed.stages:
        assert s.forward_s == pytest.approx(float(np.sum(costs.forward_s[stage == s.index])))
        assert s.backward_s == pytest.approx(float(np.sum(costs.backward_s[stage == s.index])))
    with torch.device("meta"):
        empty = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    meta = trace(empty, (torch.randn(16, 64, device="meta"),))
    assert not partition(meta, 3, time_prices=True, example_inputs=(x,)).options["measured"]
