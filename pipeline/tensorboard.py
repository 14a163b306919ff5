"""An optional TensorBoard writer of a run's loss, throughput and memory, one scalar set per step.

``torch.utils.tensorboard`` needs the ``tensorboard`` package, which the engine does not depend on: creating a
:class:`TensorBoardWriter` without it raises :class:`TensorBoardMissingError` saying what to install. Each rank
writes its own run (``DIR/rank<N>``): throughput is the same on every rank of a pipeline, memory is not.
"""
from __future__ import annotations

import os
import resource
from typing import Any

import torch

from partitioner.cost.throughput import Throughput
from partitioner.errors import EngineError

__all__ = ["TensorBoardMissingError", "TensorBoardWriter"]


class TensorBoardMissingError(EngineError, ImportError):
    """``torch.utils.tensorboard`` cannot be imported (the ``tensorboard`` package is not installed)."""


def _summary_writer() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise TensorBoardMissingError("writing TensorBoard logs needs the `tensorboard` package "
                                      f"(pip install tensorboard): {exc}") from None
    return SummaryWriter


class TensorBoardWriter:
    """Scalars of every step under ``log_dir/rank<rank>``: ``loss``, ``throughput/samples_per_s``,
    ``throughput/tokens_per_s``, ``throughput/tflops_per_device``, ``throughput/mfu`` and ``memory/bytes`` (the
    CUDA device's peak allocation on a GPU, the process's peak resident set on a CPU)."""

    def __init__(self, log_dir: str | os.PathLike[str], rank: int = 0, device: torch.device | None = None):
        self.writer = _summary_writer()(log_dir=os.path.join(os.fspath(log_dir), f"rank{rank}"))
        self.device = device or torch.device("cpu")
        self.step = 0

    def memory_bytes(self) -> int:
        """This rank's peak memory so far (see the class docstring)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: kilobytes

    def log(self, loss: float | None, throughput: Throughput | None, step: int | None = None) -> None:
        """Write one step's scalars (``step`` defaults to a counter of the calls)."""
        step = self.step if step is None else step
        self.step = step + 1
        w = self.writer
        if loss is not None and loss == loss:  # not NaN (a step without a loss function)
            w.add_scalar("loss", loss, step)
        if throughput is not None:
            w.add_scalar("throughput/samples_per_s", throughput.samples_per_s, step)
            if throughput.tokens_per_s is not None:
                w.add_scalar("throughput/tokens_per_s", throughput.tokens_per_s, step)
            w.add_scalar("throughput/tflops_per_device", throughput.flops_per_s_per_device / 1e12, step)
            if throughput.mfu is not None:
                w.add_scalar("throughput/mfu", throughput.mfu, step)
        w.add_scalar("memory/bytes", self.memory_bytes(), step)
        w.flush()  # on disk when the step returns: a job that ends without close() keeps every step

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()
