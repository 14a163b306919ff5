"""``pipe_split()`` markers (torch.distributed.pipelining's) are the user's split points: k markers, k + 1 stages,
cut where they stand, the model's outputs and gradients unchanged; a count that does not match, or markers with
nothing between them, is a clear error."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import pipe_split

import partitioner


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
