"""Bad input gets a clear error that names the problem and the fix (DESIGN.md, "Failure behaviour")."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch import nn

import partitioner
from partitioner import MemoryBudgetError, OpGraph, PartitionPlan, TraceError
from partitioner.capture.graph import GraphError
from partitioner.capture.stage_modules import split
from partitioner.cut.objective import check_acyclic


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))


X = torch.randn(4, 8)


@pytest.fixture(scope="module")
def graph() -> OpGraph:
    return partitioner.trace(_mlp(), (X,))


# --- stage counts --------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, -1, 2.0, "2", None])
def test_num_stages_must_be_a_positive_integer(graph, k):
    with pytest.raises(ValueError, match=re.escape(f"num_stages must be a positive integer, got {k!r}")):
        partitioner.partition(graph, k)


def test_more_stages_than_ops(graph):
    ops = sum(kind != "output" for kind in graph.kinds)
    with pytest.raises(ValueError, match=rf"num_stages={ops + 1} but the model has only {ops} ops to place; "
                                         rf"use at most {ops} stages"):
        partitioner.partition(graph, ops + 1)
    plan = partitioner.partition(graph, ops)  # the limit itself is fine: one op per stage, none left idle
    assert plan.num_stages == ops
    real = [n for n, kind in zip(graph.names, graph.kinds) if kind != "output"]
    assert sorted(plan.assignment[n] for n in real) == list(range(ops))


def test_more_stages_than_ops_from_a_model():
    with pytest.raises(ValueError, match=r"num_stages=50 but the model has only \d+ ops"):
        partitioner.partition(_mlp(), 50, example_inputs=(X,))


# --- tracing -------------------------------------------------------------------------------------------


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: depends on tensor values, not shapes
            return self.proj(x)
        return -x


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Identity(), Gate()])
        self.post = nn.Linear(8, 2)

    def forward(self, x):
        x = self.pre(x)
        for b in self.blocks:
            x = b(x)
        return self.post(x)


def test_data_dependent_control_flow_names_the_module():
    with pytest.raises(TraceError) as info:
        partitioner.trace(Gated(), (X,))
    msg = str(info.value)
    assert "cannot trace Gated" in msg
    assert "in module blocks.1 (Gate," in msg  # the module path and class of the offending forward
    assert "data-dependent control flow" in msg
    assert "torch.cond" in msg  # ... and how to fix it
    assert isinstance(info.value, RuntimeError)


def test_data_dependent_control_flow_through_partition():
    with pytest.raises(TraceError, match=r"module blocks\.1 \(Gate"):
        partitioner.partition(Gated(), 2, example_inputs=(X,))


def test_trace_needs_a_module():
    with pytest.raises(TypeError, match="trace\\(\\) needs a torch.nn.Module, got function"):
        partitioner.trace(lambda x: x, (X,))


def test_partition_needs_a_graph_or_module():
    with pytest.raises(TypeError, match="partition\\(\\) takes an OpGraph or an nn.Module, got str"):
        partitioner.partition("gpt2", 2)


def test_partition_of_a_model_needs_example_inputs():
    with pytest.raises(ValueError, match="needs example_inputs"):
        partitioner.partition(_mlp(), 2)


# --- memory budget -------------------------------------------------------------------------------------


def test_memory_budget_too_small_gives_the_numbers(graph):
    with pytest.raises(MemoryBudgetError) as info:
        partitioner.partition(graph, 2, device_memory="1KiB")
    msg = str(info.value)
    assert msg.startswith("no 2-stage plan fits device_memory=1.000 KiB")
    needs = re.search(r"stage \d needs ([\d.]+) KiB", msg)
    whole = re.search(r"the whole model needs ([\d.]+) KiB", msg)
    assert needs and whole, msg
    assert 1.0 < float(needs.group(1)) <= float(whole.group(1))
    assert "adam state" in msg and isinstance(info.value, ValueError)
    # 1 KiB is less than one Linear needs: no stage count helps, and the message names that op (its weights,
    # gradients and Adam state; the input it keeps for backward is the ReLU's output, which the ReLU keeps).
    assert re.search(r"No number of stages can fit it: op \w+ \(\d\) alone needs 4\.250 KiB", msg), msg


def test_memory_budget_error_suggests_a_stage_count_that_fits(graph):
    with pytest.raises(MemoryBudgetError, match=r"Fix: use at least 3 stages"):
        partitioner.partition(graph, 2, device_memory="5KiB")
    plan = partitioner.partition(graph, 3, device_memory="5KiB")  # and the suggestion holds
    assert max(s.memory_bytes for s in plan.stages) <= 5 * 1024


def test_memory_budget_error_in_gib_for_big_numbers(graph):
    huge = OpGraph(names=["a", "b", "out"], kinds=["aten.mm", "aten.mm", "output"], modules=["", "", ""],
                   flops=np.array([1e9, 1e9, 0.0]), out_bytes=np.array([2**30, 2**30, 0]),
                   act_bytes=np.array([2**30, 2**30, 0]), move_bytes=np.array([2**30, 2**30, 0]),
                   src=np.array([0, 1]), dst=np.array([1, 2]), value=np.array([0, 1]),
                   value_bytes=np.array([2**30, 2**30]))
    with pytest.raises(MemoryBudgetError, match=r"device_memory=1\.000 GiB: .* needs 2\.000 GiB"):
        partitioner.partition(huge, 1, device_memory="1GiB")


def test_memory_budget_that_fits_is_fine(graph):
    plan = partitioner.partition(graph, 2, device_memory="1GiB")
    assert all(s.memory_bytes <= 2**30 for s in plan.stages)


@pytest.mark.parametrize("size", ["lots", "-1GiB", "16 parsecs", "0MB"])
def test_unreadable_memory_size(graph, size):
    with pytest.raises(ValueError, match=re.escape(f"cannot read memory size {size!r}")):
        partitioner.partition(graph, 2, device_memory=size)


def test_memory_sizes_parse():
    assert partitioner.parse_size("16GiB") == 16 * 2**30
    assert partitioner.parse_size("512MB") == 512e6
    assert partitioner.parse_size(2**20) == 2**20
    assert partitioner.parse_size(None) is None


# --- options -------------------------------------------------------------------------------------------


def test_bad_method_name(graph):
    with pytest.raises(ValueError, match=re.escape("method='kway' is not known; use one of ('auto', 'dp', 'metis')")):
        partitioner.partition(graph, 2, method="kway")


@pytest.mark.parametrize("w", [-0.1, 1.5])
def test_memory_weight_out_of_range(graph, w):
    with pytest.raises(ValueError, match=re.escape(f"memory_weight must be in [0, 1], got {w}")):
        partitioner.partition(graph, 2, memory_weight=w)


@pytest.mark.parametrize("m", [0, -2, 1.5])
def test_microbatches_must_be_positive(graph, m):
    with pytest.raises(ValueError, match=re.escape(f"microbatches must be a positive integer, got {m!r}")):
        partitioner.partition(graph, 2, microbatches=m)


def test_unknown_optimizer(graph):
    want = r"optimizer='lion' is not known; use one of \['adam', 'adamw', 'none', 'sgd'\]"
    with pytest.raises(ValueError, match=want):
        partitioner.partition(graph, 2, optimizer="lion")


def test_measure_needs_a_traced_graph():
    g = _chain_graph(4)
    with pytest.raises(ValueError, match="measure=True needs a traced model"):
        partitioner.partition(g, 2, measure=True)


# --- running a plan ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def staged(graph):
    return partitioner.partition(graph, 2).as_module()


def test_input_of_a_different_shape(staged):
    with pytest.raises(ValueError, match=re.escape("has shape (3, 8) but the model was traced with (4, 8); "
                                                   "stages are specialised to the traced shapes")):
        staged(torch.randn(3, 8))
    with pytest.raises(ValueError, match=re.escape("it was traced on 2 microbatches (the whole batch?): example inputs "
                                                   "are one microbatch, input_1[:2] here")):
        staged(torch.randn(2, 8))  # traced on 4 rows, run on microbatches of 2: the whole batch was traced


def test_input_of_a_different_dtype(staged):
    with pytest.raises(ValueError, match="has dtype torch.float64 but the model was traced with torch.float32"):
        staged(X.double())


def test_input_that_is_not_a_tensor(staged):
    with pytest.raises(TypeError, match="was traced as a tensor, got list"):
        staged([X])


@pytest.mark.parametrize("args,kwargs,got", [((X, X), {}, "got 2 positional and []"),
                                             ((), {}, "got 0 positional and []"),
                                             ((X,), {"mask": X}, "got 1 positional and ['mask']")])
def test_wrong_number_of_inputs(staged, args, kwargs, got):
    with pytest.raises(TypeError, match=re.escape("traced with 1 positional input(s) and keyword input(s) [], "
                                                  f"but {got}")):
        staged(*args, **kwargs)


def test_changed_constant_input():
    class WithFlag(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x, double=False):
            y = self.a(x)
            return self.b(y * 2 if double else y)

    model = WithFlag()
    staged = partitioner.partition(model, 2, example_inputs=(X,), example_kwargs={"double": True}).as_module()
    torch.testing.assert_close(staged(X, double=True), model(X, double=True))
    with pytest.raises(ValueError, match="input 'double' was traced as the constant True .* but got False"):
        staged(X, double=False)


def test_plan_from_json_needs_the_graph(graph):
    plan = PartitionPlan.from_json(partitioner.partition(graph, 2).to_json())
    with pytest.raises(ValueError, match="no traced graph attached .* pass graph=partitioner.trace"):
        plan.as_module()
    with pytest.raises(ValueError, match="no traced graph attached"):
        plan.stage_modules()
    plan.as_module(graph=graph)  # fine once given


def test_synthetic_graph_plan_cannot_run():
    plan = partitioner.partition(_chain_graph(6), 2)
    with pytest.raises(ValueError, match="synthetic graph"):
        plan.as_module()


def test_not_a_plan():
    want = r"not a partition plan: missing \['assignment', 'method', 'num_stages', 'stages'\]"
    with pytest.raises(ValueError, match=want):
        PartitionPlan.from_json('{"hello": 1}')


# --- broken graphs and assignments ---------------------------------------------------------------------


def _chain_graph(n: int) -> OpGraph:
    return OpGraph(names=[f"op{i}" for i in range(n)], kinds=["aten.mm"] * (n - 1) + ["output"],
                   modules=[""] * n, flops=np.full(n, 1e6), out_bytes=np.full(n, 1024),
                   act_bytes=np.full(n, 1024), move_bytes=np.full(n, 4096), src=np.arange(n - 1),
                   dst=np.arange(1, n), value=np.arange(n - 1), value_bytes=np.full(n - 1, 1024))


def test_graph_edges_must_point_forward():
    want = "edge 1 goes from node 2 to node 1: nodes must be numbered in topological order"
    with pytest.raises(GraphError, match=want):
        OpGraph(names=["a", "b", "c"], kinds=["x"] * 3, modules=[""] * 3, flops=np.ones(3),
                out_bytes=np.ones(3, np.int64), act_bytes=np.ones(3, np.int64), move_bytes=np.ones(3, np.int64),
                src=np.array([0, 2]), dst=np.array([1, 1]), value=np.array([0, 1]), value_bytes=np.ones(2, np.int64))


def test_graph_arrays_must_match():
    with pytest.raises(GraphError, match="OpGraph.flops has 2 entries for 3 nodes"):
        OpGraph(names=["a", "b", "c"], kinds=["x"] * 3, modules=[""] * 3, flops=np.ones(2),
                out_bytes=np.ones(3, np.int64), act_bytes=np.ones(3, np.int64), move_bytes=np.ones(3, np.int64),
                src=np.zeros(0, np.int64), dst=np.zeros(0, np.int64), value=np.zeros(0, np.int64),
                value_bytes=np.zeros(0, np.int64))


def test_cyclic_assignment_is_caught(graph):
    stage = np.zeros(graph.num_nodes, np.int64)
    stage[0] = 1  # the first op on a later stage than its consumers
    with pytest.raises(AssertionError, match="plan is cyclic"):
        check_acyclic(graph, stage)
    assignment = dict(zip(graph.names, stage.tolist()))
    with pytest.raises(ValueError, match="assignment is cyclic"):
        split(graph, assignment, 2)
