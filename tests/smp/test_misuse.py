"""Misuse gets a clear error: config mistakes, a model called outside a step, loss.backward() instead of
model.backward, a batch that does not divide into microbatches, a second DistributedModel."""
from __future__ import annotations

import json

import pytest
import torch

from smp.runtime.config import ConfigError, load_config
from smp.testing import run_ranks


@pytest.mark.parametrize("config,needle", [
    ({"pipeline_parallel_degree": 2, "microbatchs": 4}, "unknown smp config key(s) ['microbatchs']"),
    ({"microbatches": 4}, "needs 'pipeline_parallel_degree'"),
    ({"partitions": 0}, "'pipeline_parallel_degree'=0 is not valid: a positive integer"),
    ({"partitions": 2, "pipeline": "fast"}, "'pipeline'='fast' is not valid"),
    ({"partitions": 2, "placement_strategy": "random"}, "'cluster' (= 'DPT'), 'spread' (= 'TPD') or a permutation"),
    ({"partitions": 2, "placement_strategy": "DPP"}, "'placement_strategy'='DPP' is not valid"),
    ({"partitions": 2, "auto_partition": False}, "required when auto_partition is False"),
    ({"partitions": 2, "memory_weight": 1.5}, "a number in [0, 1]"),
    ({"partitions": 2, "pipeline_parallel_degree": 4}, "disagree"),
    ({"partitions": 2, "tensor_parallel_degree": 2}, "'tensor_parallel_degree'=2 is not valid: a degree above 1 "
                                                      "needs 'ddp': True"),
    ({"partitions": 2, "tensor_parallel_degree": 0, "ddp": True}, "'tensor_parallel_degree'=0 is not valid"),
])
def test_config_errors(config, needle):
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert needle in str(err.value)


def test_config_sources(tmp_path, monkeypatch):
    path = tmp_path / "smp.json"
    path.write_text(json.dumps({"partitions": 2, "microbatches": 4, "optimize": "memory"}))
    cfg = load_config(str(path))
    assert (cfg.pipeline_parallel_degree, cfg.microbatches, cfg.effective_memory_weight) == (2, 4, 0.8)
    assert cfg.schedule == "1f1b" and cfg.max_in_flight == 4
    monkeypatch.setenv("SMP_CONFIG", '{"pipeline_parallel_degree": 3, "pipeline": "simple"}')
    assert load_config(None).schedule == "gpipe"
    monkeypatch.setenv("SMP_CONFIG", "{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(None)


def _misuse(rank: int, world: int, case: str):
    import smp

    smp.init({"pipeline_parallel_degree": world, "microbatches": 2})
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model = smp.DistributedModel(net)

    @smp.step
    def good(model, x):
        loss = model(x).sum()
        model.backward(loss)
        return loss

    @smp.step
    def wrong_backward(model, x):
        loss = model(x).sum()
        loss.backward()
        return loss

    try:
        if case == "outside":
            model(torch.randn(4, 8))
        elif case == "backward":
            wrong_backward(model, torch.randn(4, 8))
        elif case == "indivisible":
            good(model, torch.randn(5, 8))
        elif case == "twice":
            smp.DistributedModel(net)
        elif case == "shape":
            good(model, torch.randn(4, 8))
            good(model, torch.randn(4, 9))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("case,needle", [
    ("outside", "RuntimeError: smp.DistributedModel was called outside an @smp.step function"),
    ("backward", "call model.backward(loss) instead"),
    ("indivisible", "BatchSplitError: cannot split x of shape (5, 8) into 2 microbatches"),
    ("twice", "RuntimeError: a DistributedModel already exists"),
    ("shape", "cannot trace Sequential: RuntimeError in module 0 (Linear"),  # a new shape the model cannot take
])
def test_misuse_one_rank(case, needle):
    (out,) = run_ranks(_misuse, 1, case, timeout=120)
    assert needle in out, out


def test_wrong_backward_on_two_ranks_names_the_rank():
    out = run_ranks(_misuse, 2, "backward", timeout=120)
    assert "call model.backward(loss) instead" in out[1], out
    assert "PeerError" in out[0] and "rank 1" in out[0], out


def test_init_needs_processes_for_pipelines():
    (out,) = run_ranks(_needs_processes, 1, timeout=60)
    assert "pipeline_parallel_degree=4 needs" in out or "cannot form pipelines of 4 stages" in out, out


def _needs_processes(rank: int, world: int):
    import smp

    try:
        smp.init({"pipeline_parallel_degree": 4})
    except Exception as exc:
        return str(exc)
    return "no error"
