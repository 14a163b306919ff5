"""The roofline cost model: matmuls at the dtype's tensor-core rate, memory-bound ops priced by their bytes,
and plans for a GPU that differ from plans for this CPU where the roofline says they should."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import partitioner
from partitioner import DeviceRates, estimate, profile
from partitioner.cut.portfolio import fixed_plan

WIDTH, ROWS, TAIL = 4096, 8192, 40


class GemmsThenElementwise(nn.Module):
    """Four big GEMMs, then a long memory-bound tail of elementwise ops (no FLOPs to speak of)."""

    def __init__(self):
        super().__init__()
        self.gemms = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x):
        for lin in self.gemms:
            x = lin(x)
        for _ in range(TAIL):
            x = torch.tanh(x) * 1.01 + 0.1
        return x


@pytest.fixture(scope="module")
def graph():
    with torch.device("meta"):  # shapes only: nothing of this size is ever allocated
        return partitioner.trace(GemmsThenElementwise(), (torch.randn(ROWS, WIDTH),))


def _first(g, kind):
    return next(i for i, k in enumerate(g.kinds) if k == kind)


def test_roofline_prices_matmuls_by_flops_and_elementwise_ops_by_bytes(graph):
    g = graph
    h100 = profile("h100-80gb")
    mm, tanh = _first(g, "aten.linear"), _first(g, "aten.tanh")
    for dtype, rate, shrink in (("bf16", 989.5e12, 0.5), ("tf32", 494.5e12, 1.0), ("fp32", 67e12, 1.0)):
        fwd = estimate(g, h100, dtype).forward_s
        assert fwd[mm] == pytest.approx(g.flops[mm] / (rate * 0.75) + 5e-6)
        moved = g.move_bytes[tanh] * shrink
        assert fwd[tanh] == pytest.approx(moved / (3.35e12 * 0.85) + 5e-6)
    # On this CPU's kind of rates the GEMM dwarfs the elementwise op; on an H100 in bf16 it does not.
    cpu = estimate(g, DeviceRates()).forward_s
    gpu = estimate(g, h100, "bf16").forward_s
    assert cpu[mm] / cpu[tanh] > 100 and gpu[mm] / gpu[tanh] < 10


def test_h100_plan_moves_work_to_where_the_roofline_puts_the_time(graph):
    g = graph
    cpu = partitioner.partition(g, 2, rates=DeviceRates(), memory_weight=0.0)
    gpu = partitioner.partition(g, 2, device="h100-80gb", dtype="bf16", memory_weight=0.0)
    last_gemm = [i for i, k in enumerate(g.kinds) if k == "aten.linear"][-1]
    assert cpu.assignment[g.names[last_gemm]] == 1  # the CPU splits the GEMMs between the stages ...
    assert gpu.assignment[g.names[last_gemm]] == 0  # ... the H100 keeps them together: the tail is the work
    cpu_plan_on_gpu = fixed_plan(g, 2, np.array([cpu.assignment[n] for n in g.names]), device="h100-80gb",
                                 dtype="bf16", memory_weight=0.0)
    assert cpu_plan_on_gpu.bottleneck > 1.5 * gpu.bottleneck
    assert gpu.balance < 1.05
