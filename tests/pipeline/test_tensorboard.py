"""The optional TensorBoard writer (pipeline.tensorboard)."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from partitioner.cost.throughput import Throughput
from pipeline.tensorboard import TensorBoardMissingError, TensorBoardWriter


def test_without_the_package_the_writer_names_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    with pytest.raises(TensorBoardMissingError, match="pip install tensorboard"):
        TensorBoardWriter(tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="the tensorboard package is not installed")
def test_writes_an_event_file_per_rank(tmp_path):
    w = TensorBoardWriter(tmp_path, rank=1)
    w.log(0.5, Throughput(1.0, 8, 64, 1e9, 2, 5e8, 1e12, 5e-4))
    w.close()
    assert any(p.name.startswith("events.") for p in (tmp_path / "rank1").iterdir())
