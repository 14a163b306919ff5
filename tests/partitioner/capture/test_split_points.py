"""``pipe_split()`` markers (torch.distributed.pipelining's) are the user's split points: k markers, k + 1 stages,
cut where they stand, the model's outputs and gradients unchanged; a count that does not match, or markers with
nothing between them, is a clear error. On fewer ranks than stages they run as interleaved virtual stages when the
ranks divide them (the plan's summary says so), and a count the ranks do not divide is an error naming both."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import pipe_split

import partitioner
from partitioner import PartitionPlan
from partitioner.capture.split_points import RANKS_KEY, stages_on_ranks


class Marked(nn.Module):
    """Four layers with a marker after each of the first three, as torch.distributed.pipelining's examples."""

    def __init__(self, markers: tuple[int, ...] = (0, 1, 2)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.markers = markers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            for _ in range(self.markers.count(i)):
                pipe_split()
        return x


def test_markers_are_the_stage_boundaries_and_the_stages_compute_the_model():
    torch.manual_seed(0)
    model, x = Marked(), torch.randn(4, 16)
    plan = partitioner.partition(partitioner.trace(model, (x,)), 4)
    assert plan.method == "pipe_split"
    assert [sorted({m for m in s.modules if m.startswith("layers.")}) for s in plan.stages] == \
        [["layers.0"], ["layers.1"], ["layers.2"], ["layers.3"]]
    staged = plan.as_module()
    out = staged(x)
    out.sum().backward()
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    reference = Marked()
    reference.load_state_dict(model.state_dict())
    reference(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_marker_count_that_does_not_match_the_stages_is_an_error():
    graph = partitioner.trace(Marked(), (torch.randn(4, 16),))
    with pytest.raises(ValueError, match=r"3 pipe_split\(\) marker\(s\), which make 4 stages, but 2 were asked for"):
        partitioner.partition(graph, 2)


def test_markers_with_nothing_between_them_make_no_empty_stage():
    graph = partitioner.trace(Marked(markers=(0, 0)), (torch.randn(4, 16),))
    with pytest.raises(ValueError, match=r"stage\(s\) \[1\] would hold no op: .* stand after layers.0"):
        partitioner.partition(graph, 3)


def test_a_model_without_markers_is_partitioned_as_before():
    plan = partitioner.partition(partitioner.trace(Marked(markers=()), (torch.randn(4, 16),)), 2)
    assert plan.method != "pipe_split"


def test_the_plan_says_its_stages_come_from_the_markers_and_how_many_each_rank_runs():
    plan = partitioner.partition(partitioner.trace(Marked(), (torch.randn(4, 16),)), 4)
    assert plan.summary().splitlines()[-1] == "4 stages from the model's 3 pipe_split() markers"
    on_two = PartitionPlan.from_json(replace(plan, extra={RANKS_KEY: 2}).to_json())  # as a pipeline of 2 records it
    assert on_two.summary().splitlines()[-1] == \
        "4 stages from the model's 3 pipe_split() markers, 2 per rank on 2 ranks (interleaved virtual stages)"


def test_the_markers_stages_run_on_ranks_that_divide_them_and_others_are_told_what_fits():
    graph = partitioner.trace(Marked(), (torch.randn(4, 16),))
    assert [stages_on_ranks(graph, p) for p in (1, 2, 4)] == [4, 4, 4]
    assert stages_on_ranks(partitioner.trace(Marked(markers=()), (torch.randn(4, 16),)), 2) is None
    with pytest.raises(ValueError) as three:
        stages_on_ranks(graph, 3)
    assert str(three.value) == (
        "the model's 3 pipe_split() marker(s) make 4 stages, which a pipeline of 3 ranks cannot share: every rank runs "
        "the same number of stages (interleaved virtual stages when several), so the stages must be a multiple of 3; "
        "add or remove markers to make 3 or 6 stages (2 or 5 markers), or use a pipeline degree that divides 4 "
        "(1, 2 or 4)")
    with pytest.raises(ValueError, match=r"make 4 stages, which a pipeline of 8 ranks .* make 8 stages \(7 markers\)"):
        stages_on_ranks(graph, 8)
