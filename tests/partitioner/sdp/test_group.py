"""``partitioner.sdp.group``: a sharding group's link (within a node or across), the options its stages are cut with,
the rank over the budget, and what a plan records of it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from partitioner import UNLIMITED, DeviceRates, PartitionOptions, partition, trace
from partitioner.sdp.group import ShardingGroup, cut_options, group_link, over_budget, sharded_dp_record
from partitioner.sdp.shards import PERSISTENCE_THRESHOLD, sharded_dp
from smp import zoo

RATES = DeviceRates(link="nvlink4", link_bytes_per_s=4e11, link_latency_s=1e-6, inter_node_link="ib-ndr",
                    inter_node_bytes_per_s=5e10, inter_node_latency_s=5e-6)


def test_the_group_runs_on_the_node_it_fits_in_else_across_nodes() -> None:
    assert group_link(RATES, 2, 4, 8) is RATES  # 2 replicas 4 ranks apart: one node of 8
    across = group_link(RATES, 4, 4, 8)
    assert (across.link, across.link_bytes_per_s, across.link_latency_s) == ("ib-ndr", 5e10, 5e-6)
    given = group_link(RATES, 4, 4, 8, inter=(1e9, 1e-3))
    assert (given.link_bytes_per_s, given.link_latency_s) == (1e9, 1e-3)
    assert ShardingGroup(2) == ShardingGroup(2, PERSISTENCE_THRESHOLD, None)


def test_sharded_stages_are_cut_without_the_budget_and_its_ranks_held_to_it() -> None:
    options = PartitionOptions(device="h100-80gb", device_memory=10**9)
    assert cut_options(options, 1) is options
    cut = cut_options(options, 2)
    assert cut.device_memory == UNLIMITED and cut.device == options.device
    ranks = [SimpleNamespace(peak_bytes=5.0), SimpleNamespace(peak_bytes=9.0)]
    assert over_budget(ranks, None) is None and over_budget(ranks, 9.0) is None  # type: ignore[arg-type]
    assert over_budget(ranks, 8.0) is ranks[1]  # type: ignore[arg-type]


def test_the_record_has_every_rank_and_the_step_when_given() -> None:
    z = zoo.build("mlp")
    graph = trace(z.model, z.args, z.kwargs)
    plan = partition(graph, 2, microbatches=2)
    ranks = sharded_dp(plan, graph, 2, threshold=1, link=RATES)
    rec = sharded_dp_record(ranks, 1, RATES, None)
    assert rec["degree"] == rec["replicas"] == 2 and rec["threshold"] == 1 and rec["device_memory"] is None
    assert rec["link"] == {"name": "nvlink4", "bytes_per_s": 4e11, "latency_s": 1e-6}
    assert rec["ranks"] == [r.to_dict() for r in ranks] and "predicted_step_s" not in rec
    assert sharded_dp_record(ranks, 1, RATES, 1e9, 0.5, 0.25)["predicted_step_s"] == pytest.approx(0.5)
