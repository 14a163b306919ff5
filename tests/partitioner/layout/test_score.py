"""``partitioner.layout.score``: a fixed layout is priced exactly as ``smp inspect`` and ``smp simulate`` price it;
what they do not price (checkpointing, data parallelism, ZeRO-1) moves the numbers the way the runtime would; the
bounds are bounds."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
import torch

from partitioner.cut.options import PartitionOptions
from partitioner.layout.costs import layout_costs
from partitioner.layout.layout import Layout
from partitioner.layout.score import LayoutScorer, Pricing, chain_bottleneck, global_rank
from pipeline.stage_simulation import pipeline_simulator
from smp import zoo

OPTIONS = PartitionOptions(device="h100-80gb", dtype="bf16")


@pytest.fixture(scope="module")
def costs():
    z = zoo.build("gpt2", batch=2)
    return layout_costs(z.model, z.args, z.kwargs, sizes=[2], tp_degrees=[1, 2], rates=OPTIONS.resolve_rates(),
                        dtype="bf16")


def scorer(costs, ranks_per_node: int = 8, **options) -> LayoutScorer:
    return LayoutScorer(costs, Pricing(PartitionOptions.of(OPTIONS, **options), ranks_per_node), pipeline_simulator)


def lay(**kw) -> Layout:
    return Layout(**{"pp": 2, "tp": 1, "dp": 1, "microbatch_size": 2, "microbatches": 4, **kw})


def test_fixed_degrees_are_priced_as_smp_inspect_prices_them(costs) -> None:
    from pipeline.plan_analysis import analyse

    for tp, pipeline in ((1, "simple"), (2, "interleaved")):
        plan, sim = analyse(costs.graph(tp, 2), 2, PartitionOptions.of(OPTIONS, microbatches=4, pipeline=pipeline))
        score = scorer(costs).score(lay(tp=tp, schedule="gpipe" if pipeline == "simple" else "1f1b"))
        assert score.pipeline_s == plan.extra["schedule"]["predicted_step_s"]  # smp inspect's step: no optimizer
        assert score.step_s == pytest.approx(score.pipeline_s + score.optimizer_s, rel=1e-12)
        assert score.bubble == sim.bubble
        assert score.memory_bytes == max(m["total_bytes"] for m in plan.extra["memory"])


@pytest.mark.parametrize("schedule, stages", [("1f1b", 4), ("zero-bubble", 4), ("interleaved-virtual", 8)])
def test_fixed_degrees_are_priced_as_smp_simulate_prices_them_across_nodes(costs, schedule, stages) -> None:
    from pipeline.stage_pricing import pipeline_costs, simulate_costs
    from smp.cli.commands.simulate import COMPARED

    options = PartitionOptions.of(OPTIONS, microbatches=8)
    rates = OPTIONS.resolve_rates()
    step = simulate_costs(COMPARED[schedule], pipeline_costs(costs.graph(1, 2), options, stages), 8, 4, 2,
                          (rates.inter_node_bytes_per_s, rates.inter_node_latency_s), virtual_stages=stages // 4)
    score = scorer(costs, ranks_per_node=2).score(lay(pp=4, microbatches=8, schedule=schedule,
                                                      virtual_stages=stages // 4))
    assert score.pipeline_s == step.step_s  # two stages a node: the inter-node link between them
    assert score.pipeline_s > scorer(costs, ranks_per_node=8).score(lay(pp=4, microbatches=8, schedule=schedule,
                                                                        virtual_stages=stages // 4)).pipeline_s


def test_checkpointing_recomputes_the_forward_and_keeps_less(costs) -> None:
    s = scorer(costs)
    # GPipe holds all 4 microbatches: a checkpointed stage keeps their inputs, and one microbatch's activations.
    plain, ckpt = s.score(lay(schedule="gpipe")), s.score(lay(schedule="gpipe", checkpointing="full"))
    assert ckpt.step_s > plain.step_s and ckpt.activation_bytes < plain.activation_bytes
    assert ckpt.parameter_bytes == plain.parameter_bytes
    # With one microbatch in flight (the last stage of 1F1B) it keeps more: the input as well.
    assert s.score(lay(checkpointing="full")).activation_bytes > s.score(lay()).activation_bytes


def test_data_parallel_gradients_are_reduced_after_the_step_and_zero1_shards_the_optimizer(costs) -> None:
    s = scorer(costs)
    one, four, zero1 = s.score(lay()), s.score(lay(dp=4)), s.score(lay(dp=4, zero1=True))
    assert four.pipeline_s == one.pipeline_s and four.step_s > four.pipeline_s and four.dp_comm_s > 0
    assert four.samples_per_s == pytest.approx(4 * 2 * 4 / four.step_s)
    assert four.tokens_per_s == pytest.approx(four.samples_per_s * 32)
    assert four.mfu == pytest.approx(four.flops_per_s_per_device / OPTIONS.resolve_rates().matmul_flops_per_s("bf16"))
    assert zero1.parameter_bytes < four.parameter_bytes and zero1.step_s > four.step_s  # + the weights' all-gather
    assert four.exposed_comm_s >= four.dp_comm_s
    # After the reduction each rank's optimizer step; ZeRO-1's rank updates a quarter of the state.
    assert four.optimizer_s == pytest.approx(one.optimizer_s) and one.optimizer_s > 0
    assert zero1.optimizer_s == pytest.approx(four.optimizer_s / 4)
    assert four.step_s == pytest.approx(four.pipeline_s + four.dp_comm_s + four.optimizer_s)


def test_the_bounds_bound_the_prices(costs) -> None:
    s = scorer(costs)
    for layout in (lay(), lay(dp=4, zero1=True), lay(pp=4, schedule="gpipe"), lay(checkpointing="full"),
                   lay(tp=2, pp=1, schedule="1f1b"), lay(pp=4, microbatches=8, schedule="interleaved-virtual",
                                                          virtual_stages=2)):
        bound, score = s.bound(layout), s.score(layout)
        assert bound.step_s <= score.step_s and bound.memory_bytes <= score.memory_bytes, layout.describe()
        assert bound.step_s <= bound.estimate_s and s.memory_bound(layout) == bound.memory_bytes
        assert s.plan_bound(layout) <= score.step_s, layout.describe()  # the busiest rank's passes, cut
        # the search prices without the second (free-communication) simulation and adds it to the proposals alone
        bare = s.score(layout, exposed=False)
        assert math.isnan(bare.exposed_comm_s) and s.exposed(layout, bare) == score


def test_placement_orders_the_axes_with_tp_fastest() -> None:
    cluster, pdt = lay(pp=2, tp=2, dp=2), lay(pp=2, tp=2, dp=2, placement="PDT")
    assert [global_rank(cluster, p, d) for d in range(2) for p in range(2)] == [0, 2, 4, 6]
    assert [global_rank(pdt, p, d) for p in range(2) for d in range(2)] == [0, 2, 4, 6]
    assert global_rank(cluster, 1, 0, tp_rank=1) == 3


def test_sharded_data_parallelism_is_priced_as_smp_simulate_sdp_prices_it(costs) -> None:
    from partitioner.sdp.group import ShardingGroup, group_link
    from pipeline.stage_pricing import pipeline_costs, simulate_costs

    options = PartitionOptions.of(OPTIONS, microbatches=4)
    rates = OPTIONS.resolve_rates()
    inter = (rates.inter_node_bytes_per_s, rates.inter_node_latency_s)
    for rpn in (8, 2):  # the sharding group on one node, then across two
        group = ShardingGroup(2, link=group_link(rates, 2, 2, rpn, inter))
        step = simulate_costs("1f1b", pipeline_costs(costs.graph(1, 2), options, 2, sdp=group), 4, 2, rpn, inter)
        score = scorer(costs, ranks_per_node=rpn).score(lay(dp=2, sdp=2))
        assert score.step_s - score.optimizer_s == pytest.approx(step.step_s, rel=1e-12)  # simulate: no optimizer
    s = LayoutScorer(costs, Pricing(OPTIONS, 8, sdp_threshold=1000), pipeline_simulator)  # shard gpt2's layers
    plain, sharded = s.score(lay(dp=4)), s.score(lay(dp=4, sdp=4))
    assert sharded.parameter_bytes < plain.parameter_bytes and sharded.step_s > plain.pipeline_s
    bound = s.bound(lay(dp=4, sdp=4))
    assert bound.memory_bytes <= sharded.memory_bytes and bound.step_s <= sharded.step_s
    assert bound.memory_bytes < s.bound(lay(dp=4)).memory_bytes  # the bound counts the state / sdp


def _bisected(seconds: np.ndarray, stages: int, fixed: np.ndarray, acts: np.ndarray, in_flight: list[int],
              budget: float, rtol: float = 1e-3) -> float:
    """The estimate's bottleneck as first written: each probe packed greedily with one np.searchsorted per stage."""
    cum = np.concatenate([[0.0], np.cumsum(seconds)])
    cf, ca = (np.concatenate([[0.0], np.cumsum(x)]) for x in (fixed, acts))

    def fits(cap: float) -> bool:
        pos = 0
        for s in range(stages):
            held = cf + in_flight[s] * ca
            end = min(int(np.searchsorted(cum, cum[pos] + cap, side="right")) - 1,
                      int(np.searchsorted(held, held[pos] + budget, side="right")) - 1)
            pos = max(pos, end)
            if pos >= len(seconds):
                return True
        return False

    largest = float(seconds.max(initial=0.0))
    lo = max(cum[-1] / stages, largest)
    hi = lo + largest
    if not fits(hi):
        hi = cum[-1] + largest
        if not fits(hi):
            return math.inf
    while hi - lo > rtol * lo:
        cap = (lo + hi) / 2
        lo, hi = (lo, cap) if fits(cap) else (cap, hi)
    return hi


def test_the_estimate_is_the_bisection_to_the_last_bit() -> None:
    # The chains keep their sums as Python lists, probed with bisect, and each op's reach within the budget per
    # microbatches in flight: the same comparisons of the same doubles as a searchsorted per probe, so the same
    # estimate exactly (the search's order, and the walk's stop, depend on it), zeros and memory that binds included.
    from partitioner.layout.chain import Chain

    rng = np.random.default_rng(40)
    for _ in range(300):
        n, k = int(rng.integers(1, 120)), int(rng.integers(1, 24))
        seconds = rng.exponential(1.0, n) * (rng.random(n) < 0.8)
        fixed, acts = rng.exponential(1.0, n) * (rng.random(n) < 0.5), rng.exponential(1.0, n)
        flight = [int(f) for f in rng.integers(1, 5, k)]
        budget = float(rng.uniform(0.3, 3.0) * (fixed.sum() + 3 * acts.sum()) / k)
        chain = Chain(seconds, fixed=fixed, acts=acts, budget=budget)
        assert chain.bottleneck(k, flight) == _bisected(seconds, k, fixed, acts, flight, budget)
        assert chain_bottleneck(seconds, k) == _bisected(seconds, k, fixed, acts, flight, math.inf)


def test_the_estimate_cuts_the_ops_into_the_fastest_contiguous_stages_that_fit() -> None:
    ops = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    assert chain_bottleneck(ops, 3) == pytest.approx(6.0, rel=1e-3)  # [1 2 3] [4] [5]
    assert chain_bottleneck(np.ones(4), 8) == pytest.approx(1.0, rel=1e-3)  # stages to spare: the largest op
    # Each op keeps 1 byte per microbatch in flight; the first stage holds 3 microbatches, the others 1.
    held: dict[str, Any] = {"fixed": np.zeros(5), "acts": np.ones(5), "in_flight": [3, 1, 1]}
    assert chain_bottleneck(ops, 3, budget=3, **held) == pytest.approx(9.0, rel=1e-3)  # [1] [2 3] [4 5]
    assert chain_bottleneck(ops, 3, budget=2, **held) == math.inf  # [] [1 2] [3 4]: no room for 5


def test_a_layout_that_reduces_nothing_adds_exactly_nothing_to_its_step(costs) -> None:
    # A step's fixed cost (pipeline.step_model) puts the pipeline's end past the last rank's: (end + step) - end,
    # a difference of floats, printed "gradient all-reduce -0.0 us" for about one overhead in six.
    for overhead in np.linspace(1e-3, 1e-2, 10):
        rates = dataclasses.replace(OPTIONS.resolve_rates(), step_overhead_s=float(overhead))
        score = scorer(costs, rates=rates).score(lay())  # dp 1: no gradient reduction
        assert score.dp_comm_s == 0.0 and math.copysign(1.0, score.dp_comm_s) == 1.0, overhead
        assert score.step_s - score.optimizer_s == pytest.approx(score.pipeline_s, rel=1e-12), overhead
    assert scorer(costs).score(lay(dp=2)).dp_comm_s > 0


def test_plans_keep_the_headroom_free_and_are_cut_for_it(costs) -> None:
    from partitioner.cut.objective import HEADROOM
    from partitioner.layout.headroom import DEFAULT, Headroom, parse_headroom

    assert DEFAULT == Headroom(fraction=HEADROOM) == parse_headroom("10%") == parse_headroom("0.1")
    assert parse_headroom("8GiB") == Headroom(nbytes=8 * 2**30) and parse_headroom("0") == Headroom()
    for bad in ("100%", "-5%", "2", "lots"):
        with pytest.raises(ValueError, match="give a fraction of the budget .0.1 or 10%. or a size .8GiB."):
            parse_headroom(bad)
    s = scorer(costs, device_memory="80GB")
    assert s.device_budget == 80e9 and s.budget == pytest.approx(72e9)
    assert s.score(lay()).budget_bytes == s.budget
    assert Headroom().usable(80e9) == 80e9 and Headroom(nbytes=8e9).usable(80e9) == 72e9
    assert DEFAULT.cut_budget(80e9) == 80e9  # the partitioner's own 10% line is the plans' limit
    assert Headroom(fraction=0.28).cut_budget(80e9) == pytest.approx(64e9)  # its line at 80e9 x 0.72
    assert Headroom(nbytes=1e9).cut_budget(80e9) == 80e9  # less than 10%: the budget itself


def test_a_context_parallel_rank_holds_the_activations_of_its_tokens_and_pays_the_gathers() -> None:
    from tests.smp.test_context_parallel import causal_lm

    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    costs = layout_costs(causal_lm("llama"), (ids,), {"labels": ids}, sizes=[1, 2], tp_degrees=[1, 2],
                         rates=OPTIONS.resolve_rates(), dtype="bf16")
    assert costs.sequence == 64
    scorer = LayoutScorer(costs, Pricing(OPTIONS, 8), pipeline_simulator)
    one = Layout(pp=1, tp=1, dp=4, microbatch_size=1, microbatches=2)
    whole, split = (scorer.score(dataclasses.replace(one, cp=cp)) for cp in (1, 4))
    assert split.activation_bytes < 0.5 * whole.activation_bytes  # a quarter of the tokens, keys and values whole
    assert split.parameter_bytes == whole.parameter_bytes  # the weights whole on every rank
    assert whole.tp_comm_s == 0 < split.tp_comm_s  # the gathers of keys and values
    assert split.samples_per_s == pytest.approx(2 / split.step_s)  # one cp group of 4: its 2 samples per step
    graph = scorer.priced(dataclasses.replace(one, tp=2, cp=2))[0]
    assert graph.fx.context.cp == 2 and not graph.fx.sharding.sequence  # tp without sequence parallelism under cp
