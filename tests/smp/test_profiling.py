"""Profiling real smp runs on two ranks: the rules fire on an imbalanced manual split, a data loader that
sleeps, and a rank slowed by a busy loop, and stay quiet on a balanced run; what smp.profile, the config's
"profile" key and smp.annotate record; what profiling costs. On one rank, the system monitor's rules: a list
that grows every step fires MemoryGrowth, a data loader with more busy workers than cores CPUBottleneck."""
from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.timeline import load_trace
from smp.profiling.measurements import load_profile
from smp.profiling.report import write_report
from smp.profiling.rules import evaluate
from smp.profiling.system_rules import cpu_during_waits
from smp.testing import run_ranks

WIDTH = 1024  # passes of several milliseconds: the engine's own per-pass work stays small beside them


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    # The first block's norm makes its linear layer compute an input gradient as the others do: without it stage 0
    # would do 1/8 less backward work than any cut could give stage 1, a 4-8 % imbalance before the host's noise.
    first = nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh())
    return nn.Sequential(first, *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(7)])


def _train(cfg: dict, steps: int, *, first_alone=False, sleep=0.0, busy=False, block: str | None = None):
    import smp
    from smp.runtime import state

    smp.init({"microbatches": 4, **cfg})
    net = _mlp()
    if first_alone:
        smp.set_partition(net[0], 0)
    model = smp.DistributedModel(net, trace_execution_times=True)  # the cut balanced by this machine's op times
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(model, x, y):
        with smp.annotate("loss"):
            out = model(x)
            loss = F.mse_loss(out, y) if out is not None else None
        model.backward(loss)
        return loss

    stop = threading.Event()
    if busy:  # a Python thread spinning beside the training: it holds the GIL half the time
        threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)], daemon=True).start()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(128, WIDTH, generator=g), torch.randn(128, WIDTH, generator=g)
    x, y = x.chunk(smp.dp_size())[smp.dp_rank()], y.chunk(smp.dp_size())[smp.dp_rank()]
    with smp.profile(block) if block else smp.annotate("no profile block"):
        for _ in range(steps):
            with smp.annotate("load"):
                time.sleep(sleep)
            train_step(model, x, y)
            opt.step()
            opt.zero_grad()
    stop.set()
    smp.barrier()
    state.reset()


def _scenarios(rank: int, world: int, root: str) -> None:
    pp2 = {"pipeline_parallel_degree": 2}
    _train({**pp2, "profile": {"dir": os.path.join(root, "balanced"), "steps": [1, 7]}}, 7)
    _train({**pp2, "auto_partition": False, "default_partition": 1,
            "profile": {"dir": os.path.join(root, "imbalanced"), "steps": [1, 5]}}, 5, first_alone=True)
    _train(pp2, 5, sleep=0.1, block=os.path.join(root, "data"))


def _straggler(rank: int, world: int, root: str) -> None:
    _train({"pipeline_parallel_degree": 1, "ddp": True, "profile": {"dir": root, "steps": [1, 4]}}, 4,
           busy=rank == 1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    run_ranks(_scenarios, 2, str(root), timeout=300)
    return root


def _fired(directory) -> dict:
    return {f.rule: f for f in evaluate(load_profile(directory)) if f.fired}


def _without_the_hosts_imbalance(fired: dict) -> dict:
    """The findings less a StageImbalance this 2-core VM makes on its own: its cores ran one GPT-2 step in 26.5 and
    37.7 ms minutes apart, so two ranks' equal stages measure up to 1.4x apart. A misjudged cut goes further (the
    manual split below, 1 block against 7, is 1.75x)."""
    imbalance = fired.pop("StageImbalance", None)
    assert imbalance is None or imbalance.numbers["max_over_mean"] < 1.5, str(imbalance)
    return fired


def _without_the_hosts_drift(fired: dict) -> dict:
    """The findings less a StepDrift of the host: a host busy with other jobs (the suite beside it), or running at
    another speed than when rank 0 timed the ops (this VM's moves by 1.5x within a minute), slows the whole step,
    which StepDrift reports as time outside the passes or as the host's speed, not as a misjudged plan."""
    drift = fired.pop("StepDrift", None)
    excused = ("passes do not account for", "another speed")
    assert drift is None or any(why in drift.recommendation for why in excused), str(drift)
    return fired


def test_a_balanced_run_fires_no_rule_and_profiling_costs_under_two_percent(runs):
    m = load_profile(runs / "balanced")
    fired = _without_the_hosts_drift(_without_the_hosts_imbalance(_fired(runs / "balanced")))
    assert not fired, [str(f) for f in evaluate(m)]
    assert m.steps == [1, 2, 3, 4, 5, 6] and m.ranks == [0, 1]
    assert 0 < m.overhead < 0.02
    assert all(m.memory[r]["rss_bytes"] > 2**20 for r in m.ranks)


def test_an_imbalanced_manual_split_fires_stage_imbalance(runs):
    f = _fired(runs / "imbalanced")["StageImbalance"]
    assert f.numbers["slowest"] == 1 and "stage 1 (1.0 .. 7.1)" in f.summary and "stage 0 (0.0 .. 0.2)" in f.summary


def test_a_sleeping_data_loader_fires_data_bound(runs):
    fired = _fired(runs / "data")
    assert sorted(fired["DataBound"].numbers["ranks"]) == [0, 1]
    _without_the_hosts_imbalance(fired)
    # The loader's 0.1 s a step is between the steps, in no stage's cost (it would add 25 ms or more to ~20 ms).
    data, balanced = (load_profile(runs / k).stage_cost_s for k in ("data", "balanced"))
    assert max(data) < 1.5 * max(balanced), (data, balanced)


def test_smp_profile_and_annotations_are_in_the_trace(runs):
    events, _, _ = load_trace(runs / "data" / "trace.json")
    m = load_profile(runs / "data")
    assert m.steps == [0, 1, 2, 3, 4]  # every step inside the block, numbered from the run's first
    loads = [e for e in events if e.action == "load"]
    assert len(loads) == 2 * 4 and all(e.duration >= 0.1 for e in loads)  # between the steps of the block
    losses = [e for e in events if e.action == "loss"]
    assert losses and all(e.thread == 1 for e in losses)  # the step function's track
    assert sum(e.cat == "optimizer" for e in events) == 2 * 5  # after every step of the block


@pytest.mark.slow
def test_a_rank_slowed_by_a_busy_loop_is_a_straggler(tmp_path):
    run_ranks(_straggler, 2, str(tmp_path), timeout=300)
    f = _fired(tmp_path)["Straggler"]
    assert f.numbers["ranks"] == [1] and "rank 1 runs stage 0" in f.summary


def test_only_one_profile_records_at_a_time_and_annotate_needs_no_profile(tmp_path):
    run_ranks(_nested, 1, str(tmp_path), timeout=120)


def _nested(rank: int, world: int, root: str) -> None:
    import smp
    from smp.runtime import state

    with smp.annotate("before init"):  # no smp yet: nothing to record, no error
        pass
    smp.init({"pipeline_parallel_degree": 1, "profile": {"dir": root, "steps": [0, 1]}})
    model = smp.DistributedModel(nn.Linear(4, 4))

    @smp.step
    def step(model, x):
        with pytest.raises(RuntimeError, match="already recording"), smp.profile(root):
            pass
        return model(x).sum()

    step(model, torch.randn(2, 4))
    assert os.path.exists(os.path.join(root, "trace.json"))
    state.reset()


# -- the system monitor, on one rank ---------------------------------------------------------------------------
class _BusyBatches(torch.utils.data.Dataset):
    """Batches that cost ``cpu_s`` of pure-Python CPU each to make: a CPU-heavy data pipeline."""

    def __init__(self, n: int, cpu_s: float) -> None:
        self.n, self.cpu_s = n, cpu_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        t = time.thread_time()
        while time.thread_time() - t < self.cpu_s:
            pass
        g = torch.Generator().manual_seed(i)
        return torch.randn(64, WIDTH, generator=g), torch.randn(64, WIDTH, generator=g)


def _one_rank(rank: int, world: int, root: str, mode: str) -> None:
    import smp
    from smp.runtime import state

    steps = 12 if mode == "busy loader" else 7  # the loader's: a window of a few seconds, tens of samples
    smp.init({"pipeline_parallel_degree": 1, "profile": {"dir": root, "steps": [1, steps], "monitor_s": 0.1}})
    model = smp.DistributedModel(_mlp(), trace_execution_times=True)  # the plan's step is this machine's
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(model, x, y):
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    if mode == "busy loader":  # more busy workers than cores: they saturate them, and the step waits for batches
        import multiprocessing

        multiprocessing.current_process().daemon = False  # run_ranks' ranks are daemonic: they may not fork workers
        workers = (os.cpu_count() or 1) + 2
        # Twice the profiled steps: the workers prefetch while the first step partitions, and must still be busy
        # through the profiled window (with as many batches as steps they had made most of them before it began)
        batches = torch.utils.data.DataLoader(_BusyBatches(2 * steps, 0.3), batch_size=None, num_workers=workers)
    else:
        g = torch.Generator().manual_seed(0)
        batches = [(torch.randn(64, WIDTH, generator=g), torch.randn(64, WIDTH, generator=g))] * steps
    kept = []
    for x, y in batches:
        train_step(model, x, y)
        opt.step()
        opt.zero_grad()
        if mode == "growing list":
            kept.append(torch.ones(2**20))  # 4 MiB more every step, never released
    state.reset()


def test_a_list_that_grows_every_step_fires_memory_growth_and_the_monitor_is_in_the_profile(tmp_path):
    run_ranks(_one_rank, 1, str(tmp_path), "growing list", timeout=120)
    m = load_profile(tmp_path)
    fired = _without_the_hosts_drift({f.rule: f for f in evaluate(m) if f.fired})
    assert set(fired) == {"MemoryGrowth"}, [str(f) for f in evaluate(m)]
    assert fired["MemoryGrowth"].numbers["per_step_bytes"]["0 rss_bytes"] == pytest.approx(4 * 2**20, rel=0.2)
    _, counters, _ = load_trace(tmp_path / "trace.json")
    assert {"cpu", "process", "system", "io", "memory"} <= {c.name for c in counters}  # no "gpu" on CPU
    system = json.loads((tmp_path / "profile.json").read_text())["ranks"]["0"]["system"]
    assert system["cores"] == os.cpu_count() and system["interval_s"] == 0.1 and system["gpu"] is None
    assert system["samples"] == len(m.system[0].series["cpu"].times) > 0
    assert m.system[0].core_busy.shape == (system["samples"], os.cpu_count())


@pytest.mark.slow
def test_a_cpu_heavy_data_loader_fires_cpu_bottleneck_and_the_heatmap_shows_saturated_cores(tmp_path):
    run_ranks(_one_rank, 1, str(tmp_path / "prof"), "busy loader", timeout=300)
    m = load_profile(tmp_path / "prof")
    fired = {f.rule: f for f in evaluate(m) if f.fired}
    assert "DataBound" in fired and "CPUBottleneck" in fired, [str(f) for f in evaluate(m)]
    cpu = fired["CPUBottleneck"].numbers["cpu"][0]
    assert cpu["children"] >= os.cpu_count() + 2 and cpu["children_cores"] > 0.6 * os.cpu_count()
    assert f"{cpu['children']:.0f} child process(es)" in fired["CPUBottleneck"].summary
    # The heatmap's matrix: while the step waited for batches, every core was close to saturated.
    assert cpu_during_waits(m, 0)["busy"] > 0.9
    assert (m.system[0].core_busy.mean(axis=0) > 80).all()
    write_report(tmp_path / "prof", tmp_path / "report")
    assert (tmp_path / "report" / "cpu_heatmap.png").stat().st_size > 5000
    assert "## System" in (tmp_path / "report" / "report.md").read_text()
