"""``partitioner.layout.search``: the search returns what pricing every layout would (brute force over the same
scorer), never a layout over the memory budget, and says what would fit when nothing does."""
from __future__ import annotations

import dataclasses

import pytest

from partitioner.cut.options import PartitionOptions
from partitioner.layout.costs import layout_costs
from partitioner.layout.headroom import DEFAULT, Headroom
from partitioner.layout.layout import SCHEDULES
from partitioner.layout.score import LayoutScorer, Pricing
from partitioner.layout.search import (
    NoLayoutFitsError,
    SearchSpace,
    candidates,
    cp_choices,
    divisors,
    search,
    tp_choices,
)
from partitioner.layout.sharded import shards_nothing
from pipeline.stage_simulation import pipeline_simulator
from smp import zoo

OPTIONS = PartitionOptions(device="h100-80gb", dtype="bf16")
SPACE = SearchSpace(devices=4, global_batch=8, ranks_per_node=2, schedules=SCHEDULES, max_stages=100)


@pytest.fixture(scope="module")
def costs():
    z = zoo.build("gpt2", batch=2)
    sizes = {lay.microbatch_size for lay in candidates(SPACE, [1, 2])}
    return layout_costs(z.model, z.args, z.kwargs, sizes=sizes, tp_degrees=[1, 2], rates=OPTIONS.resolve_rates(),
                        dtype="bf16")


def scorer(costs, headroom: Headroom = DEFAULT, **options) -> LayoutScorer:
    return LayoutScorer(costs, Pricing(PartitionOptions.of(OPTIONS, **options), SPACE.ranks_per_node,
                                       headroom=headroom), pipeline_simulator)


def brute_force(costs, **options) -> list:
    """Every layout priced, but those whose sdp shards nothing (the same layout as sdp 1, under another name)."""
    s = scorer(costs, **options)
    priced = [(s.score(lay), lay) for lay in candidates(SPACE, costs.tp_degrees)
              if not shards_nothing(lay, s.plan(lay), costs.graph(lay.tp, lay.microbatch_size), 1_000_000)]
    return sorted([(sc.step_s, sc.memory_bytes, lay) for sc, lay in priced if sc.fits], key=lambda x: x[:2])


def test_the_space_is_every_grid_microbatching_and_variant_that_differs() -> None:
    layouts = list(candidates(SPACE, [1, 2]))
    assert len(layouts) == len(set(layouts)) > 50
    for lay in layouts:
        assert lay.devices == 4 and lay.global_batch == 8 and SPACE.ranks_per_node % lay.tp == 0
        assert lay.pp > 1 or lay.schedule == "1f1b"  # one stage: the pipelines are all the same
        assert lay.dp > 1 or not lay.zero1
    assert {lay.schedule for lay in layouts} == set(SCHEDULES)
    assert {lay.placement for lay in layouts} == {"DPT", "PDT"}  # two nodes of two
    assert divisors(12) == [1, 2, 3, 4, 6, 12] and tp_choices(16, 8, heads=(12,)) == [1, 2, 4]


def test_the_search_finds_the_brute_force_optimum(costs) -> None:
    want = brute_force(costs)
    for exhaustive in (False, True):
        result = search(candidates(SPACE, costs.tp_degrees), scorer(costs), top=3, exhaustive=exhaustive)
        assert result.proposals[0].layout == want[0][2] and result.proposals[0].score.step_s == want[0][0]
        assert result.scored < result.enumerated  # the bounds ruled layouts out unpriced
    exact = search(candidates(SPACE, costs.tp_degrees), scorer(costs), top=3, exhaustive=True)
    assert [p.layout for p in exact.proposals] == [w[2] for w in want[:3]]


def test_the_fast_search_finds_what_the_exhaustive_one_does_where_memory_binds(costs) -> None:
    # A budget that only some layouts fit: the estimate's chains are cut under it, the walk stops early, and a layout
    # whose stages cannot beat the K-th best is not simulated; the best K are those of the exhaustive walk.
    bounds = sorted(scorer(costs).memory_bound(lay) for lay in candidates(SPACE, costs.tp_degrees))
    budget = bounds[len(bounds) // 2] / DEFAULT.usable(1.0)
    fast, full = (search(candidates(SPACE, costs.tp_degrees), scorer(costs, device_memory=budget), top=3,
                         exhaustive=exhaustive) for exhaustive in (False, True))
    assert [p.layout for p in fast.proposals] == [p.layout for p in full.proposals]
    assert [p.score for p in fast.proposals] == [p.score for p in full.proposals]  # exposed communication included
    assert fast.scored < full.scored < full.enumerated - full.memory_pruned


def test_a_layout_over_the_memory_budget_is_never_returned(costs) -> None:
    everything = brute_force(costs)
    memory = sorted(m for _, m, _ in everything)
    budget = memory[len(memory) // 2]
    fitting = brute_force(costs, device_memory=budget)
    result = search(candidates(SPACE, costs.tp_degrees), scorer(costs, device_memory=budget), top=10)
    assert result.memory_pruned + result.scored < result.enumerated or result.memory_pruned > 0
    assert all(p.score.memory_bytes <= budget and p.score.fits for p in result.proposals)
    assert result.proposals[0].layout == fitting[0][2]
    assert everything[0][1] > budget or everything[0][2] == fitting[0][2]  # the budget changed the answer, or not


def test_when_nothing_fits_it_says_what_would(costs) -> None:
    space = SearchSpace(devices=4, global_batch=8, ranks_per_node=2, checkpointing=("none",), zero1=(False,),
                        max_stages=100)
    with pytest.raises(NoLayoutFitsError) as err:
        search(candidates(space, costs.tp_degrees), scorer(costs, device_memory="1MiB"), top=1)
    text = str(err.value)
    assert text.startswith("no layout fits 921.6 KiB per device (1.0 MiB less 10% kept free for the allocator): "
                           "every layout needs at least ")
    for needle in ("more devices (about", "activation checkpointing", "ZeRO-1", "a smaller global batch"):
        assert needle in text, needle
    assert "sharded data parallelism" not in text  # every degree was tried: none fits
    # Just over the least memory bound: that layout is priced (no stage split is that even), and named.
    least = min(scorer(costs).bound(lay).memory_bytes for lay in candidates(space, costs.tp_degrees))
    with pytest.raises(NoLayoutFitsError, match=r"the closest, .*, needs .* \(parameter state .*, activations"):
        search(candidates(space, costs.tp_degrees), scorer(costs, Headroom(), device_memory=int(least) + 1), top=1)
    # Within the device's memory but not its headroom: less headroom is named, with what it would leave free.
    with pytest.raises(NoLayoutFitsError, match=r"less memory headroom: it would leave \d+% of the device's"):
        search(candidates(space, costs.tp_degrees), scorer(costs, device_memory=int(least) + 1), top=1)


def test_sharded_data_parallelism_is_searched_and_named_when_it_would_fit(costs) -> None:
    # A threshold small enough that sdp shards gpt2's layers, and a budget only sdp 4 fits.
    pricing = Pricing(OPTIONS, SPACE.ranks_per_node, sdp_threshold=1000)
    space = SearchSpace(devices=4, global_batch=8, ranks_per_node=2, tp=(1,), dp=(4,), microbatch_size=(2,),
                        schedules=("1f1b",), checkpointing=("none",), zero1=(False,), max_stages=100)
    assert [lay.sdp for lay in candidates(space, [1])] == [1, 2, 4]
    fits = LayoutScorer(costs, pricing, pipeline_simulator).score(next(lay for lay in candidates(space, [1])
                                                                        if lay.sdp == 4)).memory_bytes
    tight = LayoutScorer(costs, Pricing(PartitionOptions.of(OPTIONS, device_memory=fits), 2, sdp_threshold=1000,
                                        headroom=Headroom()), pipeline_simulator)
    found = search(candidates(space, [1]), tight, top=3)
    assert [p.layout.sdp for p in found.proposals] == [4]
    with pytest.raises(NoLayoutFitsError, match=r"sharded data parallelism of degree 4 \(sharded_data_parallel_degree"):
        search(candidates(dataclasses.replace(space, sdp=(1,)), [1]), tight, top=1)


def test_a_bad_request_is_refused(costs) -> None:
    with pytest.raises(ValueError, match="devices must be a positive integer, got 0"):
        SearchSpace(devices=0, global_batch=8, ranks_per_node=8)
    with pytest.raises(ValueError, match="top must be a positive integer, got 0"):
        search([], scorer(costs), top=0)
    with pytest.raises(NoLayoutFitsError, match="no layout to search"):
        search([], scorer(costs), top=1)


def test_proposals_leave_the_headroom_free(costs) -> None:
    # One stage (pp 1): a layout's memory is its own, no cut to trade. A budget the fastest such layout fills to 95%
    # (as Llama-3-8B's tp2 dp4 filled 97% of an H100): without headroom it is proposed; with the default 10% it is
    # not, and every proposal stays under 90%.
    space = dataclasses.replace(SPACE, pp=(1,))
    s = scorer(costs)
    fastest = min(((s.score(lay), lay) for lay in candidates(space, costs.tp_degrees) if lay.sdp == 1),
                  key=lambda x: x[0].step_s)
    budget = fastest[0].memory_bytes / 0.95
    bare = search(candidates(space, costs.tp_degrees), scorer(costs, Headroom(), device_memory=budget), top=3)
    assert bare.proposals[0].layout == fastest[1]
    kept = search(candidates(space, costs.tp_degrees), scorer(costs, device_memory=budget), top=3)
    assert kept.proposals[0].layout != fastest[1] and kept.proposals[0].score.step_s > fastest[0].step_s
    assert all(p.score.memory_bytes <= 0.9 * budget for p in kept.proposals)
    assert kept.proposals[0].score.budget_bytes == pytest.approx(0.9 * budget)


def test_a_sharded_degree_that_shards_nothing_is_not_proposed(costs) -> None:
    from partitioner.layout.sharded import unsharded_tps

    space = SearchSpace(devices=4, global_batch=8, ranks_per_node=2, tp=(1,), dp=(4,), microbatch_size=(2,),
                        schedules=("1f1b",), checkpointing=("none",), zero1=(False,), max_stages=100)
    # gpt2's largest parameter has 65,536 elements: under SMP's 10^6 threshold nothing would be sharded
    found = unsharded_tps(costs, 1_000_000)
    assert set(found) == {1, 2} and found[1].largest_numel == 65_536 and found[1].over == 0
    assert [lay.sdp for lay in candidates(space, [1], unsharded=found)] == [1]
    result = search(candidates(space, [1]), scorer(costs), top=3)  # the search drops them itself
    assert [p.layout.sdp for p in result.proposals] == [1] and result.unsharded == 2
    assert unsharded_tps(costs, 1000) == {}  # a threshold of 1,000 shards the layers


def test_context_parallelism_is_searched_for_long_sequences_or_when_asked(costs) -> None:
    assert cp_choices(8, 32768) == [1, 2, 4, 8] and cp_choices(8, 2048) == [1] and cp_choices(8, None) == [1]
    assert cp_choices(8, 2048, (2, 4)) == [2, 4] and cp_choices(6, 20000) == [1, 2]  # 3 and 6 do not divide it
    space = dataclasses.replace(SPACE, cp=(1, 2))
    assert {lay.cp for lay in candidates(SPACE, [1, 2], sequence=costs.sequence)} == {1}  # zoo gpt2: 32 tokens
    layouts = list(candidates(space, [1, 2], sequence=costs.sequence))
    split = [lay for lay in layouts if lay.cp > 1]
    assert split and all(lay.global_batch == SPACE.global_batch for lay in layouts)
    # a cp group runs one replica's share of the batch: dp / cp replicas divide it; never with sdp
    assert all(lay.replica_batch == SPACE.global_batch * lay.cp // lay.dp and lay.sdp == 1 for lay in split)
    with pytest.raises(ValueError, match="cp=2 must divide dp=4, with sdp and ep 1"):
        dataclasses.replace(split[0], dp=4, sdp=2)
