"""``smp.tensor_parallelism``: modules created inside stay as they are (the engine shards a model's layers on
its traced graph whatever context created them); the degree itself is checked at init."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import smp
from smp.runtime import state
from smp.runtime.compat import NoEffectWarning
from smp.runtime.config import ConfigError, load_config
from smp.runtime.topology import Topology


@pytest.fixture
def initialised(monkeypatch):
    st = state.State(config=load_config({"partitions": 1}), topology=Topology(1, 1, placement="cluster"), rank=0,
                     mp_group=None, dp_group=None, device=torch.device("cpu"))
    monkeypatch.setattr(state, "_state", st)


def test_modules_created_inside_are_left_alone(initialised):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning without keyword arguments
        with smp.tensor_parallelism():
            torch.manual_seed(0)
            inside = nn.Linear(8, 8)
            with smp.tensor_parallelism(enabled=False):
                nested = nn.Linear(8, 8)
    torch.manual_seed(0)
    outside = nn.Linear(8, 8)
    assert type(inside) is nn.Linear and type(nested) is nn.Linear
    assert torch.equal(inside.weight, outside.weight)


def test_keyword_arguments_warn_that_they_have_no_effect(initialised):
    with pytest.warns(NoEffectWarning, match=r"tensor_parallelism\(fused_bias_gelu=..., fused_softmax=...\)"):
        with smp.tensor_parallelism(fused_softmax=True, fused_bias_gelu=False):
            pass


def test_misuse(initialised, monkeypatch):
    with pytest.raises(TypeError, match="enabled must be True or False"):
        with smp.tensor_parallelism(enabled="yes"):
            pass
    with pytest.raises(ConfigError, match="ddp"):  # as in SMP v1, tensor parallelism is carved out of ddp ranks
        load_config({"partitions": 1, "tensor_parallel_degree": 2})
    monkeypatch.setattr(state, "_state", None)
    with pytest.raises(RuntimeError, match="call smp.init"):
        with smp.tensor_parallelism():
            pass
