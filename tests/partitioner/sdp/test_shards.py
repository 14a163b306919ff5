"""``partitioner.sdp.shards``: with D-way sharding a rank holds 1/D of the weights, resting gradients, optimizer state
and master weights of every parameter over the threshold (tied ones stay whole), the whole gradients during the step,
the gathered layers of its largest first-to-last-read window, and pays the ring collectives' formula."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import partitioner
from partitioner import DeviceRates, stage_memory
from partitioner.sdp.shards import PERSISTENCE_THRESHOLD, sharded_dp
from partitioner.sdp.units import fsdp_unit
from smp import zoo

LINK = DeviceRates(link_bytes_per_s=1e9, link_latency_s=1e-6)
PARAM_STATE = ("weights_bytes", "gradient_bytes", "optimizer_bytes", "master_bytes")


@pytest.fixture(scope="module")
def gpt2() -> tuple[nn.Module, partitioner.OpGraph]:
    z = zoo.build("gpt2")
    return z.model, partitioner.trace(z.model, z.args, z.kwargs)


def _plan(graph: partitioner.OpGraph, stages: int, **options) -> partitioner.PartitionPlan:
    return partitioner.partition(graph, stages, rates=LINK, microbatches=4, **options)


@pytest.mark.parametrize("dtype, weight, state", [("fp32", 4, 8), ("bf16", 2, 12)])
def test_parameters_over_the_threshold_are_divided_by_d(gpt2, dtype, weight, state) -> None:
    model, graph = gpt2
    plan = _plan(graph, 2, dtype=dtype)
    assert "transformer.wte.weight" in plan.shared_params  # tied: used by the first and the last stage
    numel = {n: p.numel() for n, p in model.named_parameters()}
    for r in sharded_dp(plan, graph, 2, threshold=10_000):
        held = plan.stage_tensors([r.rank], graph) & set(numel)
        shard = {n for n in held if numel[n] >= 10_000 and n not in plan.shared_params}
        whole = sum(numel[n] for n in held - shard) + sum(numel[n] for n in shard) / 2
        assert r.sharded == len(shard) > 0 and r.params == len(held)  # a block's 4 matmuls
        assert r.weights_bytes == r.gradient_bytes == pytest.approx(weight * whole, abs=1)
        assert r.optimizer_bytes + r.master_bytes == pytest.approx(state * whole, abs=2)  # Adam's moments (+ fp32)
        units = _units(shard, numel)
        # whole during the step, one unit laid out again for its reduce-scatter, and the reduced shards
        assert r.gradient_peak_bytes == pytest.approx(weight * (sum(numel[n] for n in held) + max(units)
                                                                + sum(units) / 2), abs=1)
        # GPT-2 reads each weight once: one unit whole beside its own all-gather buffers or a neighbour's, and
        # beside the stage's last unit, whole from its first gather to the step's end
        near = [max(units[max(i - 1, 0):i + 2]) for i in range(len(units))]
        kept = [units[-1] if i < len(units) - 1 else 0 for i in range(len(units))]
        assert r.gathered_bytes == pytest.approx(weight * max(u + 1.5 * b + k for u, b, k in zip(units, near, kept)),
                                                 abs=1)
        assert r.peak_bytes == (r.weights_bytes + r.gradient_peak_bytes + r.optimizer_bytes + r.master_bytes
                                + r.gathered_bytes + r.activation_bytes)


def _units(shard: set[str], numel: dict[str, int]) -> list[int]:
    """Elements of each unit of the sharded parameters ``shard`` (a GPT-2 block each; the position embedding alone),
    in the order GPT-2 reads them."""
    sizes: dict[str, int] = {}
    for n in sorted(shard, key=lambda n: (fsdp_unit(n) != "", int(fsdp_unit(n).split(".")[-1] or 0))):
        sizes[fsdp_unit(n)] = sizes.get(fsdp_unit(n), 0) + numel[n]
    return list(sizes.values())


def test_one_microbatch_holds_the_shards_and_the_reduce_scatters_in_flight(gpt2) -> None:
    model, graph = gpt2
    numel = {n: p.numel() for n, p in model.named_parameters()}
    plan = partitioner.partition(graph, 2, rates=LINK, microbatches=1)
    for r in sharded_dp(plan, graph, 2, threshold=10_000):  # each gradient reduced in the one backward as it comes
        held = plan.stage_tensors([r.rank], graph) & set(numel)
        shard = {n for n in held if numel[n] >= 10_000 and n not in plan.shared_params}
        units = _units(shard, numel)  # the unit launched, whole and laid out, and the one in flight after it
        launched = max(2 * u + (units[i + 1] if i + 1 < len(units) else 0) for i, u in enumerate(units))
        expected = sum(numel[n] for n in held - shard) + sum(numel[n] for n in shard) / 2 + launched
        assert r.gradient_peak_bytes == pytest.approx(4 * expected, abs=1)


def test_degree_1_or_a_threshold_above_every_parameter_changes_nothing(gpt2) -> None:
    _, graph = gpt2
    plan = _plan(graph, 2)
    plain = stage_memory(plan, graph)
    one = sharded_dp(plan, graph, 1, threshold=1)
    high = sharded_dp(plan, graph, 4, threshold=int(graph.param_bytes.max()))  # in elements: above every one
    for m, a, b in zip(plain, one, high):
        for key in PARAM_STATE:
            assert getattr(m, key) == getattr(a, key) == getattr(b, key), key
        assert m.gradient_bytes == a.gradient_peak_bytes == b.gradient_peak_bytes
        assert m.activation_bytes == a.activation_bytes == b.activation_bytes
        assert a.sharded == b.sharded == a.gathered_bytes == b.gathered_bytes == 0
        assert a.all_gather_s == b.all_gather_s == b.reduce_scatter_s == a.all_reduce_s == 0.0
        assert b.all_reduce_s > 0  # 4 replicas still average their gradients


class Reuse(nn.Module):
    """``a`` is read by the first and the third matmul, ``b`` in between, ``c`` last: a and b are alive together."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(32, 32))
        self.b = nn.Parameter(torch.randn(32, 32))
        self.c = nn.Parameter(torch.randn(32, 48))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(x @ self.a)
        x = torch.tanh(x @ self.b)
        return (x @ self.a) @ self.c


def test_gathered_bytes_are_a_unit_whole_from_its_first_read_with_its_buffers() -> None:
    graph = partitioner.trace(Reuse(), (torch.randn(4, 32),))
    plan = _plan(graph, 1)
    (r,) = sharded_dp(plan, graph, 2, threshold=1)
    # no block: one unit, gathered whole at its first read beside its all-gather's output and input
    assert r.gathered_bytes == 4 * (32 * 32 * 2 + 32 * 48) * (1 + 1 + 1 / 2)
    assert set(r.gathered) == {"a", "b", "c"}
    assert r.weights_bytes == 4 * (32 * 32 * 2 + 32 * 48) / 2
    (whole,) = sharded_dp(plan, graph, 2, threshold=32 * 48 + 1)  # only c is big enough: none is
    assert whole.gathered_bytes == 0 and whole.weights_bytes == 4 * (32 * 32 * 2 + 32 * 48)


class Frozen(nn.Module):
    """A frozen parameter (sharded, as the engine shards every parameter) and a buffer (not a parameter: whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 32), requires_grad=False)
        self.scale: torch.Tensor
        self.register_buffer("scale", torch.randn(32, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w) * self.scale


def test_frozen_parameters_are_sharded_and_buffers_are_not() -> None:
    graph = partitioner.trace(Frozen(), (torch.randn(32, 32),))
    (r,) = sharded_dp(_plan(graph, 1), graph, 2, threshold=1, link=LINK)
    assert r.sharded == 1 and r.gathered == ("w",) and r.weights_bytes == 4 * (32 * 32 / 2 + 32 * 32)
    assert r.gradient_peak_bytes == r.optimizer_bytes == 0 and r.gather_forward_s > 0 and r.end_of_step_s == 0


def test_collectives_are_ring_all_gathers_reduce_scatters_and_all_reduces() -> None:
    graph = partitioner.trace(nn.Linear(1000, 1000, bias=False), (torch.randn(2, 1000),))
    plan = _plan(graph, 1)
    S, ring = 4e6, 3 / 4 * 4e6 / 1e9 + 3 * 1e-6  # a million fp32 elements over 4 ranks
    (r,) = sharded_dp(plan, graph, 4, link=LINK)
    assert r.sharded == 1 and PERSISTENCE_THRESHOLD == 1_000_000  # "fewer than" the threshold stays whole
    assert r.gather_forward_s == r.gather_backward_s == r.reduce_scatter_s == pytest.approx(ring)
    assert r.all_gather_s == pytest.approx(4 * 2 * ring) and r.end_of_step_s == pytest.approx(ring)
    assert r.gathered_bytes == S * (1 + 1 + 1 / 4) and r.weights_bytes == S / 4  # whole, and its all-gather's buffers
    assert r.gradient_peak_bytes == S * (1 + 1 + 1 / 4)  # whole, laid out for the reduce-scatter, and the shard
    (hybrid,) = sharded_dp(plan, graph, 4, replicas=8, link=LINK)  # then each shard over the 2 groups
    assert hybrid.all_reduce_s == pytest.approx(2 * 1 / 2 * (S / 4) / 1e9 + 2 * 1e-6)
    (whole,) = sharded_dp(plan, graph, 4, threshold=1_000_001, link=LINK)  # replicated: all-reduced over 4,
    device = DeviceRates.from_dict(plan.rates)
    copies = S / device.grad_bytes_per_s + 5 * S / (device.bytes_per_s * device.memory_efficiency)
    assert whole.sharded == 0 and whole.all_reduce_s == pytest.approx(2 * ring + copies)  # flattened and copied back


def test_stages_on_one_rank_add_up_and_gather_one_at_a_time(gpt2) -> None:
    _, graph = gpt2
    plan = _plan(graph, 4)
    per_stage = sharded_dp(plan, graph, 2, threshold=10_000)
    (rank0, rank1) = sharded_dp(plan, graph, 2, threshold=10_000, stage_rank=[0, 1, 0, 1])
    assert rank0.stages == (0, 2) and rank1.stages == (1, 3)
    for key in (*PARAM_STATE, "gradient_peak_bytes", "activation_bytes"):
        assert getattr(rank0, key) == getattr(per_stage[0], key) + getattr(per_stage[2], key), key
    assert rank0.reduce_scatter_s == pytest.approx(per_stage[0].reduce_scatter_s + per_stage[2].reduce_scatter_s)
    assert rank0.gathered_bytes == max(per_stage[0].gathered_bytes, per_stage[2].gathered_bytes)
    # two stages of two or more units on one rank: each keeps its last unit whole all step, beside the other's gathers
    plan = _plan(graph, 2)
    apart = sharded_dp(plan, graph, 2, threshold=10_000)
    (both,) = sharded_dp(plan, graph, 2, threshold=10_000, stage_rank=[0, 0])
    assert max(r.gathered_bytes for r in apart) < both.gathered_bytes < sum(r.gathered_bytes for r in apart)


def test_bad_degrees_and_mappings_are_refused(gpt2) -> None:
    _, graph = gpt2
    plan = _plan(graph, 2)
    with pytest.raises(ValueError, match="positive integer"):
        sharded_dp(plan, graph, 0)
    with pytest.raises(ValueError, match="degree 4 must divide the data-parallel degree 6"):
        sharded_dp(plan, graph, 4, replicas=6)
    with pytest.raises(ValueError, match="stage_rank has 3 entries for 2 stages"):
        sharded_dp(plan, graph, 2, stage_rank=[0, 1, 2])
    assert np.all([r.sharded == 0 for r in sharded_dp(plan, graph, 2)])  # tiny GPT-2: all under a million


def test_what_a_degree_shards_and_the_warning_when_it_shards_nothing(gpt2) -> None:
    import warnings

    from partitioner.sdp.shards import ShardsNothingWarning, shardable, warn_if_nothing_sharded

    _, graph = gpt2
    plan = _plan(graph, 2)
    found = shardable(graph)  # gpt2's largest parameter, the tied embedding, has 65,536 elements
    assert (found.params, found.over, found.sharded) == (52, 0, 0)
    assert found.why_none() == ("none of the model's 52 parameters has 1,000,000 elements or more (the largest, "
                                "transformer.wte.weight, has 65,536)")
    # At 60,000 the tied embedding and a block's 8 matmuls are over it; two stages use the embedding: it stays whole.
    tied = shardable(graph, 60_000, plan.stage_of_ops(graph), 2)
    assert (tied.over, tied.shared, tied.sharded) == (9, 1, 8) and shardable(graph, 60_000).sharded == 9
    # Only a tied embedding over the threshold, on both stages: nothing sharded, and it says why.
    tiny = nn.Sequential(nn.Embedding(100, 64), nn.Linear(64, 64), nn.Linear(64, 100, bias=False))
    tiny[2].weight = tiny[0].weight
    small = partitioner.trace(tiny, (torch.randint(0, 100, (2, 8)),))
    only = shardable(small, 5000, _plan(small, 2).stage_of_ops(small), 2)
    assert (only.over, only.shared, only.sharded) == (1, 1, 0)
    assert only.why_none() == ("the 1 of the model's 3 parameters with 5,000 elements or more (0.weight) are used by "
                               "several stages, which keep them whole (the largest of the others, 1.weight, has 4,096)")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warn_if_nothing_sharded(plan, 2, PERSISTENCE_THRESHOLD)
        warn_if_nothing_sharded(plan, 2, 10_000)  # shards the layers: no warning
        warn_if_nothing_sharded(plan, 1, PERSISTENCE_THRESHOLD)  # no sharding asked for: none
    (w,) = seen
    assert w.category is ShardsNothingWarning
    assert str(w.message).startswith("sharded_data_parallel_degree=2 shards nothing at sdp_param_persistence_threshold"
                                      "=1,000,000: none of the model's 52 parameters has 1,000,000 elements or more")
    assert "Fix: set sdp_param_persistence_threshold to 65,536 or less in the smp config" in str(w.message)
