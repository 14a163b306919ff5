"""``partitioner.cost.op_times``: a graph's ops are timed once per machine; later processes read the same costs, so they
make the same plan; another graph, or SMP_RECALIBRATE, times them again."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import partitioner.cost.op_times as op_times
from partitioner import DeviceRates, partition, trace
from partitioner.cost.calibration import RECALIBRATE_ENV


def _mlp_graph(width: int):
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(6)])
    x = torch.randn(8, width)
    return trace(net, (x,)), (x,)


@pytest.fixture
def timings(tmp_path, monkeypatch) -> list[int]:
    """A fresh cache folder; counts the real timings; the machine's speed holds still (a loaded host's would not)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(op_times, "probe_s", lambda: 1e-3)
    monkeypatch.delenv(RECALIBRATE_ENV, raising=False)
    calls: list[int] = []
    real = op_times.measure

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(op_times, "measure", counted)
    return calls


def test_the_ops_are_timed_once_and_every_later_process_plans_alike(timings, monkeypatch) -> None:
    rates = DeviceRates()
    graph, args = _mlp_graph(32)
    first = op_times.timed_costs(graph, args, {}, rates)
    again, _ = _mlp_graph(32)  # another process tracing the same model
    second = op_times.timed_costs(again, args, {}, rates)
    assert len(timings) == 1 and second.measured
    assert np.array_equal(first.forward_s, second.forward_s) and np.array_equal(first.backward_s, second.backward_s)
    plans = [partition(g, 3, rates=rates, measure=True, example_inputs=args).assignment for g in (graph, again)]
    assert plans[0] == plans[1]
    other, other_args = _mlp_graph(48)  # other shapes: other costs
    op_times.timed_costs(other, other_args, {}, rates)
    assert len(timings) == 2
    monkeypatch.setenv(RECALIBRATE_ENV, "1")
    op_times.timed_costs(graph, args, {}, rates)
    assert len(timings) == 3


def test_the_runtimes_costs_do_not_time_the_ops_again_and_the_op_rates_do(timings) -> None:
    import dataclasses

    rates = DeviceRates()
    graph, args = _mlp_graph(24)
    op_times.timed_costs(graph, args, {}, rates)
    # smp calibrate measured this machine's per-pass and per-step costs: they price steps, not ops.
    op_times.timed_costs(graph, args, {}, dataclasses.replace(rates, pass_overhead_s=7e-4, step_overhead_s=3e-3))
    assert len(timings) == 1
    op_times.timed_costs(graph, args, {}, dataclasses.replace(rates, op_overhead_s=2 * rates.op_overhead_s))
    assert len(timings) == 2


def test_an_unreadable_cache_file_is_timed_again(timings) -> None:
    rates = DeviceRates()
    graph, args = _mlp_graph(16)
    op_times.timed_costs(graph, args, {}, rates)
    (path,) = list((op_times.cache_dir()).glob("op-times-*.json"))
    path.write_text("{not json")
    costs = op_times.timed_costs(graph, args, {}, rates)
    assert len(timings) == 2 and len(costs.forward_s) == graph.num_nodes


def test_an_entry_is_timed_again_once_the_machine_runs_at_another_speed(timings, monkeypatch) -> None:
    """A laptop on battery or a busy shared host: the reference workload beside the entry says the op times are no
    longer this machine's now, so they are timed again; within the tolerance the entry (and the plan) stays."""
    rates = DeviceRates()
    graph, args = _mlp_graph(24)
    speed = [1e-3]
    monkeypatch.setattr(op_times, "probe_s", lambda: speed[0])
    op_times.timed_costs(graph, args, {}, rates)
    speed[0] = 1e-3 * (1 + op_times.STALE * 0.8)  # noise: kept
    op_times.timed_costs(graph, args, {}, rates)
    assert len(timings) == 1
    speed[0] = 1.6e-3  # the machine runs 1.6x slower than when the ops were timed
    op_times.timed_costs(graph, args, {}, rates)
    assert len(timings) == 2
    op_times.timed_costs(graph, args, {}, rates)  # the new entry holds the new speed
    assert len(timings) == 2


def test_the_reference_workload_keeps_the_callers_random_streams() -> None:
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    assert op_times.probe_s(repeats=2) > 0
    assert torch.equal(torch.rand(3), expected)


class _Vmapped(torch.nn.Module):
    """A model that batches part of its forward with torch.vmap, as transformers builds attention masks."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.vmap(lambda row: row * 2 + 1)(x))


def test_a_graph_whose_ops_cannot_run_one_at_a_time_is_estimated_with_a_warning(timings) -> None:
    """Run one at a time, vmap's entered level would stay entered and every later op (a pipeline's sends) run under
    it; so such a graph is priced by the cost model, and measure() itself refuses it with the way out."""
    from partitioner.cost.timing import UntimeableGraphError, measure

    x = torch.randn(3, 4)
    graph = trace(_Vmapped(), (x,))
    with pytest.warns(UserWarning, match="functorch transform ops .* the cost model prices its ops"):
        costs = op_times.timed_costs(graph, (x,), {}, DeviceRates())
    assert not costs.measured and not timings
    with pytest.raises(UntimeableGraphError, match="cannot be timed one by one.*--estimate"):
        measure(graph, (x,))
    assert torch.vmap(lambda r: r + 1)(x).shape == x.shape  # no transform level was left behind
