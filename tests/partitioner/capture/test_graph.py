"""OpGraph files: a traced graph saved and loaded partitions exactly like the original."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from partitioner import DeviceRates, OpGraph, partition, trace


def test_a_saved_graph_loads_equal_and_partitions_the_same(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4))
    graph = trace(model, (torch.randn(4, 16),), {})
    graph.save(tmp_path / "g.npz")
    loaded = OpGraph.load(tmp_path / "g.npz")
    assert loaded.fx is None and loaded.names == graph.names and loaded.members == graph.members
    for name in ("flops", "src", "dst", "value_bytes", "param_bytes", "param_trainable", "use_node"):
        assert np.array_equal(getattr(loaded, name), getattr(graph, name)), name
    a = partition(graph, 3, rates=DeviceRates())
    b = partition(loaded, 3, rates=DeviceRates())
    assert a.assignment == b.assignment and a.bottleneck == b.bottleneck
