"""One plan for every rank: trace on each rank, partition on global rank 0, share the plan.

Partitioning prices ops with measured device rates, which differ from one process to the next; if every
rank partitioned on its own they could disagree on the stages. So global rank 0 alone partitions and
broadcasts the plan as JSON, and every rank binds it to its own trace of the model (the stages it builds
hold its own parameters). This is where the ``smp`` layer composes the partitioner and the pipeline
runtime: :func:`pipeline_runner` is the one-call way from a model to a running :class:`pipeline.PipelineRunner`.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from partitioner import PartitionOptions, PartitionPlan, partition, trace
from pipeline import PipelineRunner, microbatch
from pipeline.p2p import named_failures

from . import state

__all__ = ["shared_plan", "pipeline_runner", "smp_runner"]


def shared_plan(model: torch.nn.Module, args: tuple, kwargs: dict, num_stages: int,
                options: PartitionOptions | None = None, group: Any = None,
                timeout_s: float | None = None) -> PartitionPlan:
    """Every rank traces ``model`` on one microbatch; global rank 0 partitions and sends the plan to all, over
    ``group`` (every rank; default: the default group), whose timeout bounds the other ranks' wait
    (``timeout_s`` names it in the error: raise it when partitioning takes longer)."""
    graph = trace(model, args, kwargs)
    text = [partition(graph, num_stages, options, example_inputs=args, example_kwargs=kwargs).to_json()
            if dist.get_rank() == 0 else None]
    with named_failures("receiving the partition plan from rank 0", [0], dist.get_rank(), timeout_s):
        dist.broadcast_object_list(text, src=0, group=group)
    plan = PartitionPlan.from_json(text[0])
    plan.graph = graph
    return plan


def pipeline_runner(model: torch.nn.Module, args: tuple = (), kwargs: dict | None = None, *,
                    num_stages: int | None = None, microbatches: int = 1, virtual_stages: int = 1,
                    options: PartitionOptions | None = None, **runner_kwargs: Any) -> PipelineRunner:
    """Trace ``model`` on one microbatch of the batch ``(args, kwargs)``, partition on global rank 0, share
    the plan with every rank and build this rank's :class:`pipeline.PipelineRunner` (``runner_kwargs``:
    ``schedule``, ``ranks``/``pipelines``, ``timeout_s``, ...). ``num_stages`` defaults to the pipeline's
    ranks times ``virtual_stages``; ``options`` default to ``PartitionOptions(microbatches=microbatches)``."""
    pipelines = runner_kwargs.get("pipelines") or [runner_kwargs.get("ranks") or range(dist.get_world_size())]
    mb_args, mb_kwargs = microbatch.split(tuple(args), dict(kwargs or {}), microbatches)[0]
    stages = num_stages or len(list(pipelines[0])) * virtual_stages
    plan = shared_plan(model, mb_args, mb_kwargs, stages, PartitionOptions.of(options, microbatches=microbatches))
    return PipelineRunner(plan, microbatches=microbatches, virtual_stages=virtual_stages, **runner_kwargs)


def smp_runner(plan: PartitionPlan, checkpoint_modules: list[str]) -> PipelineRunner:
    """This rank's pipeline of ``plan`` as the smp config sets it up (``smp.DistributedModel`` at partitioning,
    and when re-partitioned in flight, :mod:`smp.migrate`)."""
    st = state.get()
    cfg = st.config
    return PipelineRunner(plan, schedule=cfg.schedule, microbatches=cfg.microbatches,
                          max_in_flight=cfg.active_microbatches if cfg.schedule == "1f1b" else None,
                          pipelines=st.topology.mp_groups(), device=st.device, timeout_s=cfg.timeout_s,
                          checkpoint_modules=checkpoint_modules)
