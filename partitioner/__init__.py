"""Partitioner: trace a torch model into an op graph and cut it into balanced, acyclic, executable stages.

    graph = partitioner.trace(model, args, kwargs)
    plan = partitioner.partition(graph, num_stages=4, microbatches=8)
    print(plan.summary())
    staged = plan.as_module()          # same outputs and gradients as ``model``

One concept per file: ``trace`` (torch.export -> :class:`OpGraph`, in ``graph``), ``mutation`` (in-place
updates as dependencies), ``flops``, ``devices`` (datasheet profiles of rented GPUs, links) and
``calibrate`` (this CPU, measured and cached), ``precision`` (bytes per training dtype), ``cost`` (the roofline
cost model), ``measure`` (timing ops and stages for real), ``options``, ``objective`` (scoring a plan),
``memory`` (what each stage's rank holds), ``dp``, ``metis``, ``refine`` and ``partition`` (the portfolio),
``baselines``, ``plan`` (the JSON-ready plan), ``split`` (executable stage modules), ``units``, ``errors``,
``lazy`` (these exports).

The names below are imported on first use (:mod:`partitioner.lazy`), so ``import partitioner.errors`` or
``partitioner.units`` does not import torch.
"""
from typing import TYPE_CHECKING

from .lazy import lazy_exports

if TYPE_CHECKING:
    from .calibrate import calibrate
    from .cost import NodeCosts, estimate
    from .devices import DEVICES, LINKS, PRECISIONS, DeviceRates, UnknownDeviceError, profile
    from .errors import EngineError
    from .graph import GraphError, OpGraph
    from .measure import StageTimes, measure, measure_stages
    from .memory import StageMemory, stage_memory
    from .objective import MemoryBudgetError
    from .options import METHODS, UNLIMITED, PartitionOptions
    from .partition import partition
    from .plan import PartitionPlan, StageSummary
    from .split import SplitModel, Stage, split
    from .trace import TraceError, trace
    from .units import format_bytes, parse_size

__all__ = [
    "trace", "TraceError", "OpGraph", "GraphError", "partition", "PartitionOptions", "METHODS", "PartitionPlan",
    "StageSummary", "DeviceRates", "DEVICES", "LINKS", "PRECISIONS", "UNLIMITED", "UnknownDeviceError", "profile",
    "NodeCosts", "calibrate", "estimate", "measure", "measure_stages",
    "StageTimes", "StageMemory", "stage_memory", "MemoryBudgetError", "EngineError", "parse_size", "format_bytes",
    "split", "Stage", "SplitModel",
]

__getattr__, __dir__ = lazy_exports(__name__)
