"""What the engine needs of the model a step runs: :class:`PipelineModel`.

``smp.DistributedModel`` (the SMP surface) satisfies it. The engine sits below that surface and never
imports it: the step, the re-partitioning between steps and the migration of tensors to a new plan reach the
model only through these names, so what crosses the boundary is written down in one place and checked by mypy.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from pipeline import PipelineRunner
from smp.engine.grad_averaging import GradAveraging

__all__ = ["PipelineModel"]


class PipelineModel(Protocol):
    """A model that runs as a pipeline: partitioned on the first step, then one :class:`~pipeline.PipelineRunner`
    per rank holding that rank's stages."""

    module: torch.nn.Module
    partitioned: bool
    runner: PipelineRunner | None
    traced_autocast: tuple[str, torch.dtype] | None
    average_grads_across_microbatches: bool
    grad_averaging: GradAveraging  # over the data-parallel replicas: overlapped buckets (SMP's overlapping_allreduce)

    @property
    def out_spec(self) -> Any:
        """The structure of the model's outputs (a pytree spec), from the trace."""

    def partition(self, call: Any) -> None:
        """Partition, traced with ``call`` (a :class:`~smp.engine.step_run.MicrobatchCall`)."""

    def is_last_stage_rank(self) -> bool:
        """Does this rank hold the last stage?"""

    def local_parameters(self) -> Iterator[torch.nn.Parameter]:
        """The parameters this rank holds."""

    def local_named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """(name, parameter) of the parameters this rank holds."""

    def local_buffers(self) -> Iterator[torch.Tensor]:
        """The buffers this rank holds."""

    def checkpointed_paths(self) -> list[str]:
        """Submodules marked for activation checkpointing."""

    def register_post_partition_hook(self, fn: Callable[[Any, Any], None]) -> Any:
        """Run ``fn(model, optimizer)`` right after partitioning."""

    def run_post_step_hooks(self) -> None:
        """Run the hooks waiting for the end of a step."""
