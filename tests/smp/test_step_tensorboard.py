"""The smp config's ``"tensorboard"`` key: every ``@smp.step`` writes this rank's loss (on the last stage's rank),
throughput and memory through pipeline.tensorboard; and the checks of the keys this engine adds for it and for
variable input shapes (``"shape_cache_size"``)."""
from __future__ import annotations

import json
import os
import sys
import types

import pytest

from smp.runtime.config import ConfigError, load_config
from smp.testing import run_ranks
from tests.smp.scripts import mlp_step


class _Writer:
    """torch.utils.tensorboard.SummaryWriter's calls, kept as JSON in its log directory (the package is optional)."""

    def __init__(self, log_dir: str) -> None:
        self.path, self.scalars = os.path.join(log_dir, "scalars.json"), []
        os.makedirs(log_dir, exist_ok=True)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append([tag, float(value), step])

    def flush(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self.scalars, f)


def _train(rank: int, world: int, directory: str) -> list[float]:
    sys.modules["torch.utils.tensorboard"] = types.SimpleNamespace(SummaryWriter=_Writer)  # type: ignore[assignment]
    _, step = mlp_step({"tensorboard": directory})
    return [float(step().reduce_mean()) for _ in range(2)]


def test_every_step_writes_loss_throughput_and_memory(tmp_path):
    losses = run_ranks(_train, 2, str(tmp_path))[0]
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}" / "scalars.json") as f:
            scalars = json.load(f)
        tags = {tag for tag, _, _ in scalars}
        assert {"throughput/samples_per_s", "throughput/tflops_per_device", "memory/bytes"} <= tags
        assert [v for tag, v, step in scalars if tag == "throughput/samples_per_s" and step == 1][0] > 0
        logged = [v for tag, v, _ in scalars if tag == "loss"]
        assert logged == (pytest.approx(losses) if rank == 1 else [])  # the loss lives on the last stage's rank


@pytest.mark.parametrize("key,value,message", [("tensorboard", "", "the directory to write TensorBoard logs to"),
                                               ("tensorboard", 3, "the directory to write TensorBoard logs to"),
                                               ("shape_cache_size", 0, "a positive integer: how many input shape"),
                                               ("shape_cache_size", 2.5, "a positive integer: how many input shape")])
def test_bad_values_are_named(key, value, message):
    with pytest.raises(ConfigError, match=f"{key!r}={value!r} is not valid: {message}"):
        load_config({"pipeline_parallel_degree": 2, key: value})


def test_defaults():
    cfg = load_config({"pipeline_parallel_degree": 2})
    assert (cfg.tensorboard, cfg.shape_cache_size) == (None, 8)
