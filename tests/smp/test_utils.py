"""``smp.utils.rmsg``: a log line tagged with the rank that wrote it, as SMP's."""
from __future__ import annotations

import pytest
import torch

from smp import utils
from smp.runtime import state
from smp.runtime.config import load_config
from smp.runtime.topology import Topology


def test_rmsg_prefixes_the_global_rank(monkeypatch):
    st = state.State(config=load_config({"partitions": 2}), topology=Topology(4, 2, placement="cluster"), rank=3,
                     mp_group=None, dp_group=None, device=torch.device("cpu"))
    monkeypatch.setattr(state, "_state", st)
    assert utils.rmsg("loss 0.5") == "[3] loss 0.5"
    assert utils.rmsg(1.5) == "[3] 1.5"


def test_rmsg_needs_smp_init(monkeypatch):
    monkeypatch.setattr(state, "_state", None)
    with pytest.raises(RuntimeError, match="call smp.init"):
        utils.rmsg("x")
