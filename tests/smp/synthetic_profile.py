"""A profile built from the simulator instead of a run: exact, chosen stage times, for testing what reads
profiles (measurements, rules, report, re-planning) without processes or clocks."""
from __future__ import annotations

import json
import os

import torch
from torch import nn

from partitioner import DeviceRates, partition, trace
from pipeline.lowering import lower
from pipeline.profile_description import GRAPH_FILE, PROFILE_FILE, TRACE_FILE, run_description
from pipeline.schedule import make_schedule
from pipeline.simulate import simulate
from pipeline.timeline import Counter, Event, to_chrome_trace

WIDTH = 64


def model(layers: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(layers)])


class FakeRunner:
    """What run_description reads from a PipelineRunner."""

    def __init__(self, plan, stages: int, microbatches: int, replicas: int = 1):
        self.plan = plan
        self.schedule = lower(make_schedule("1f1b", stages, microbatches))
        self.pipelines = [[p * stages + i for i in range(stages)] for p in range(replicas)]


def plan_of(stages: int = 2, microbatches: int = 4, net: nn.Module | None = None):
    net = net or model()
    graph = trace(net, (torch.randn(4, WIDTH),), {})
    return partition(graph, stages, rates=DeviceRates(), microbatches=microbatches, memory_weight=0.0), graph


def make(plan, *, forward_s, backward_s, steps: int = 5, microbatches: int = 4, replicas: int = 1,
         gap_s: float = 0.0, slow: dict[int, float] | None = None, slow_steps: dict[int, float] | None = None,
         rss_step: float = 0.0, late_steps: dict[int, float] | None = None):
    """(events, counters, info) of ``steps`` steps whose passes take the given per-stage seconds; ``slow``:
    rank -> factor on its passes' wall time; ``slow_steps``: step -> extra gap before it (seconds);
    ``rss_step``: bytes the RSS grows by every step; ``late_steps``: step -> seconds it spends before its passes
    start (the engine's own work, as the first step's partitioning)."""
    stages = plan.num_stages
    info = run_description(FakeRunner(plan, stages, microbatches, replicas))
    info.pop("graph")
    info.update(version=1, world=stages * replicas, steps=[0, steps],
                ranks={str(r): {"offset_s": 0.0, "offset_error_s": 0.0, "overhead": {"fraction": 0.001}}
                       for r in range(stages * replicas)})
    sim = simulate(make_schedule("1f1b", stages, microbatches), forward_s, backward_s)
    events, counters, t = [], [], 0.0
    for step in range(steps):
        gap = gap_s + (slow_steps or {}).get(step, 0.0)
        if step:
            for p in info["pipelines"]:
                for r in p:
                    events.append(Event(r, "between steps", t, t + gap, "between"))
        t += gap
        late = (late_steps or {}).get(step, 0.0)
        for p in info["pipelines"]:
            for pos, r in enumerate(p):
                factor = (slow or {}).get(r, 1.0)
                for e in sim.events:
                    if e.rank == pos:
                        events.append(Event(r, e.action, t + late + e.start * factor, t + late + e.end * factor,
                                            cost=e.duration))
                events.append(Event(r, f"step {step}", t,
                                    t + late + sim.step_s * max((slow or {}).values(), default=1.0), "step"))
                counters.append(Counter(r, "memory", t + late + sim.step_s, {"rss_bytes": 1e8 + step * rss_step}))
        t += late + sim.step_s * max((slow or {}).values(), default=1.0)
    return events, counters, info


def write(directory, events, counters, info, graph=None) -> str:
    os.makedirs(directory, exist_ok=True)
    to_chrome_trace(events, os.path.join(directory, TRACE_FILE), counters=counters)
    with open(os.path.join(directory, PROFILE_FILE), "w") as f:
        json.dump(info, f)
    if graph is not None:
        graph.save(os.path.join(directory, GRAPH_FILE))
    return os.fspath(directory)


def monitor(events, info, *, cores: int = 2, busy: float = 50.0, ranks_cores: float = 0.5, children: int = 0,
            children_cores: float = 0.0, iowait: float = 0.0, gpu_util: float | None = None, interval: float = 1e-3):
    """System monitor counters every ``interval`` seconds over the run of ``events``, on every rank, all on one
    host: every core ``busy`` %, the ranks' processes together using ``ranks_cores`` cores, each rank's
    ``children`` child processes together ``children_cores`` cores; ``gpu_util``: GPU samples at that
    utilisation (None: a CPU run). Records the monitor's description in ``info``."""
    end = max(e.end for e in events)
    counters = []
    for r in range(info["world"]):
        info["ranks"][str(r)]["system"] = {"host": "h", "cores": cores, "interval_s": interval, "samples": 1,
                                           "per_sample_s": 1e-4, "gpu": "Fake GPU" if gpu_util is not None else None}
        t = interval
        while t < end:
            counters.append(Counter(r, "cpu", t, {**{f"core {i}": busy for i in range(cores)}, "iowait": iowait}))
            counters.append(Counter(r, "process", t, {"cpu_cores": ranks_cores / info["world"], "rss_bytes": 1e8,
                                                      "children": children, "children_cpu_cores": children_cores,
                                                      "children_rss_bytes": 1e7 * children}))
            counters.append(Counter(r, "io", t, {"disk_read_bytes_s": 5e6, "disk_write_bytes_s": 0.0,
                                                 "net_recv_bytes_s": 1e3, "net_sent_bytes_s": 1e3}))
            if gpu_util is not None:
                counters.append(Counter(r, "gpu", t, {"util_percent": gpu_util, "memory_used_bytes": 1e9}))
            t += interval
    return counters
