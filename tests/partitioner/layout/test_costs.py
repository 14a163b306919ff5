"""``partitioner.layout.costs``: two traces price every microbatch size exactly (the line through them is the
trace at that size), tensor-parallel degrees included (with sequence parallelism, as the runtime runs them); inputs
are rescaled on their batch dimension only."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from partitioner.capture.tracing import trace
from partitioner.cost.devices import profile
from partitioner.cost.precision import activation_bytes
from partitioner.cost.roofline import estimate
from partitioner.cut.options import PartitionOptions
from partitioner.layout.costs import BatchLine, example_batch, head_counts, layout_costs, trace_sizes, with_batch
from partitioner.layout.layout import Layout
from partitioner.layout.score import LayoutScorer, Pricing
from partitioner.tp.sequence import SequenceParallelWarning
from partitioner.tp.shard_program import tensor_parallel_graph
from pipeline.stage_simulation import pipeline_simulator
from smp import zoo

RATES = profile("h100-80gb")
FIELDS = ("flops", "out_bytes", "act_bytes", "move_bytes", "act_float_bytes", "move_float_bytes", "value_bytes",
          "value_float_bytes")


@pytest.fixture(scope="module")
def gpt2():
    z = zoo.build("gpt2", batch=2)
    return z.model, z.args, z.kwargs


@pytest.fixture(scope="module")
def costs(gpt2):
    model, args, kwargs = gpt2
    return layout_costs(model, args, kwargs, sizes=[1, 2, 3, 6], tp_degrees=[1, 2, 4, 1 << 20], rates=RATES,
                        dtype="bf16")


def test_inputs_are_rescaled_on_their_batch_dimension_only() -> None:
    ids, scale = torch.zeros(4, 16, dtype=torch.long), torch.ones(16)
    args, kwargs = with_batch((ids,), {"scale": scale, "n": 3}, 4, 6)
    assert args[0].shape == (6, 16) and args[0].dtype == torch.long and args[0].is_meta
    assert kwargs["scale"] is scale and kwargs["n"] == 3  # not a batch: dimension 0 is not 4
    assert example_batch((ids,), {}) == 4
    with pytest.raises(ValueError, match="batch dimension"):
        example_batch((torch.tensor(1.0),), {"k": 2})


def test_two_sizes_are_traced_whatever_the_sizes_searched() -> None:
    assert trace_sizes(4, [8]) == (8,)  # one size: its own trace
    assert trace_sizes(4, [1, 2, 4, 8, 16]) == (4, 8)
    assert trace_sizes(1, [1, 2, 4]) == (2, 4)  # batch 1 traces to other ops (torch elides copies)
    # Timed ops are interpolated, never drawn beyond the larger timing (which would multiply the timings' noise).
    assert trace_sizes(4, [1, 2, 4, 8, 16], timed=True) == (4, 16)
    assert trace_sizes(4, [1, 2, 4], timed=True) == (4, 8)


def test_the_line_through_two_traces_is_the_trace_at_any_size(gpt2, costs) -> None:
    model, args, kwargs = gpt2
    assert costs.whole.line == (2, 4) and sorted(costs.whole.traced) == [2, 4]
    for size in (3, 6):
        direct = trace(model, *with_batch(args, kwargs, 2, size))
        line = costs.graph(1, size)
        assert line.names == direct.names
        for name in FIELDS:
            np.testing.assert_array_equal(getattr(line, name), getattr(direct, name), err_msg=name)
        want, got = estimate(direct, RATES, "bf16"), costs.costs(1, size)
        np.testing.assert_allclose(got.forward_s, want.forward_s, rtol=1e-12)
        np.testing.assert_allclose(got.backward_s, want.backward_s, rtol=1e-12)
    assert costs.model_flops(6) == pytest.approx(float(trace(model, *with_batch(args, kwargs, 2, 6)).flops.sum()))


def test_tensor_parallel_costs_interpolate_with_their_collectives(gpt2, costs) -> None:
    model, args, kwargs = gpt2
    with warnings.catch_warnings():  # where sequence parallelism does not apply: the planner prices it quietly
        warnings.simplefilter("ignore", SequenceParallelWarning)
        direct = tensor_parallel_graph(trace(model, *with_batch(args, kwargs, 2, 6)), 2, 0, sequence=True)
    want, got = estimate(direct, RATES, "bf16"), costs.costs(2, 6)
    assert got.tp_forward_s is not None and want.tp_forward_s is not None and want.tp_forward_s.sum() > 0
    np.testing.assert_allclose(got.tp_forward_s, want.tp_forward_s, rtol=1e-9)
    np.testing.assert_allclose(got.total_s, want.total_s, rtol=1e-9)
    np.testing.assert_array_equal(costs.graph(2, 6).param_bytes, direct.param_bytes)
    # A traced size is priced from its own trace, exactly as `smp inspect` prices it.
    assert costs.graph(2, 2) is costs.lines[2].traced[2]


def test_degrees_that_cannot_split_the_model_are_left_out_with_the_reason(costs) -> None:
    assert costs.tp_degrees == [1, 2, 4]
    assert list(costs.skipped) == [1 << 20] and costs.skipped[1 << 20]
    assert costs.tokens_per_sample == 32.0  # zoo gpt2: 32 token ids a sample


def test_traces_with_other_ops_are_not_interpolated() -> None:
    g1 = trace(torch.nn.Linear(4, 4), (torch.zeros(2, 4),))
    g2 = trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.zeros(4, 4),))
    line = BatchLine({2: g1, 4: g2})
    assert line.graph(2) is g1
    with pytest.raises(ValueError, match="differ in their ops"):
        line.graph(3)


def test_head_counts_come_from_the_config(gpt2) -> None:
    assert head_counts(gpt2[0]) == (4,)
    assert head_counts(torch.nn.Linear(2, 2)) == ()


def test_tensor_parallel_degrees_are_priced_with_sequence_parallelism_as_the_runtime_runs_them(gpt2, costs) -> None:
    model, args, kwargs = gpt2
    plain = layout_costs(model, args, kwargs, sizes=[2], tp_degrees=[1, 2], rates=RATES, dtype="bf16",
                         sequence_parallel=False)
    sp, whole = costs.graph(2, 2), plain.graph(2, 2)
    assert sp.fx.sharding.sequence and not whole.fx.sharding.sequence
    # The layer norms between tp regions keep half their activations: they run on half the sequence.
    acts_sp, acts = (dict(zip(g.names, activation_bytes(g, "bf16"))) for g in (sp, whole))
    norms = [n for n, k in zip(whole.names, whole.kinds) if k == "aten.layer_norm"]
    assert len(norms) == 9 and all(acts_sp[n] == acts[n] / 2 for n in norms)
    layout = Layout(pp=1, tp=2, dp=1, microbatch_size=2, microbatches=1)
    scored = [LayoutScorer(c, Pricing(PartitionOptions(device="h100-80gb", dtype="bf16"), 8),
                           pipeline_simulator).score(layout) for c in (costs, plain)]
    assert scored[0].activation_bytes < scored[1].activation_bytes
    # Each all-reduce becomes a reduce-scatter and an all-gather of the same bytes: latency more, never less.
    assert scored[0].tp_comm_s >= scored[1].tp_comm_s > 0
