"""Throughput in a profile and its report (smp.profiling.measurements, smp.profiling.report): every step's counts
are recorded by the pipeline, turned into rates by partitioner.cost.throughput's one definition, and shown by
``smp report`` (samples/s, tokens/s, model FLOP/s per device, MFU)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner.cost.throughput import Throughput, from_counts, peak_flops_per_s
from pipeline.timeline import Counter
from smp.profiling.measurements import load_profile
from smp.profiling.report import write_report
from smp.testing import run_ranks
from tests.smp import synthetic_profile as syn


def test_the_report_shows_every_steps_throughput(tmp_path):
    plan, _ = syn.plan_of()
    events, counters, info = syn.make(plan, forward_s=[0.01, 0.01], backward_s=[0.02, 0.02], steps=3)
    seconds = [0.20, 0.10, 0.40]
    for rank in (0, 1):  # every rank of the pipeline records the same counts
        counters += [Counter(rank, "throughput", 1.0 + i, {"seconds": s, "samples": 16.0, "tokens": 512.0,
                                                          "model_flops": 3e9, "devices": 2.0})
                     for i, s in enumerate(seconds)]
    m = load_profile(syn.write(tmp_path, events, counters, info))
    peak = peak_flops_per_s(plan)
    assert peak is not None
    assert m.throughput == [from_counts(s, 16, 512, 3e9, 2, peak) for s in seconds]
    assert m.throughput[1].samples_per_s == pytest.approx(160.0) and m.throughput[1].tokens_per_s == 5120.0
    report, _ = write_report(tmp_path)
    text = open(report).read()
    assert "## Throughput" in text
    assert f"Median step: {m.throughput[0]}." in text  # 0.20 s is the median of the three
    assert "| 1 | 100.00 | 160.0 | 5120.0 | 15.00 |" in text  # 3e9 FLOPs / (0.1 s x 2 devices) = 15 GFLOP/s
    assert f"{m.throughput[1].mfu:.2%}" in text


def _profiled(rank: int, world: int, directory: str) -> list[Throughput]:
    from partitioner import DeviceRates, partition, trace
    from pipeline import PipelineRunner
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(8 * 6, 4))
    ids, y = torch.randint(0, 50, (8, 6)), torch.randn(8, 4)
    runner = PipelineRunner(partition(trace(model, (ids[:4],)), 1, rates=DeviceRates()), microbatches=2,
                            record=directory)
    results = [runner.step((ids,), target=y, loss_fn=nn.functional.mse_loss).throughput for _ in range(3)]
    runner.write_profile()
    return results


def test_a_profiled_run_records_the_figures_it_returns(tmp_path):
    returned = run_ranks(_profiled, 1, str(tmp_path))[0]
    assert load_profile(tmp_path).throughput == returned
    assert returned[0].samples == 8 and returned[0].tokens == 48


def _dp2_step(rank: int, world: int) -> tuple[int, int | None, int, float]:
    import smp
    smp.init({"pipeline_parallel_degree": 1, "ddp": True, "microbatches": 2})
    torch.manual_seed(0)
    model = smp.DistributedModel(nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(8 * 6, 4)))
    ids, y = torch.randint(0, 50, (8, 6)), torch.randn(8, 4)

    @smp.step
    def step(model, ids, y):
        loss = nn.functional.mse_loss(model(ids), y)
        model.backward(loss)
        return loss

    figures = step(model, ids, y).throughput
    return figures.samples, figures.tokens, figures.devices, figures.samples_per_s * figures.seconds


def test_a_data_parallel_run_counts_the_jobs_samples_as_smp_plan_does():
    """A dp2 run printed one replica's samples/s on each rank ('3.8 samples/s ... on 1 device(s)') where smp plan
    printed the job's for the same layout: every rank now reports the job's samples, tokens and devices."""
    for samples, tokens, devices, per_step in run_ranks(_dp2_step, 2):
        assert (samples, tokens, devices) == (16, 96, 2) and per_step == pytest.approx(16)
