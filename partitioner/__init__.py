"""Partitioner: trace a torch model into an op graph and cut it into balanced, acyclic, executable stages.

    graph = partitioner.trace(model, args, kwargs)
    plan = partitioner.partition(graph, num_stages=4, microbatches=8)
    print(plan.summary())
    staged = plan.as_module()          # same outputs and gradients as ``model``

One concept per file: ``tracing`` (torch.export -> :class:`OpGraph`, in ``graph``; ``build`` and ``program``
turn the exported program into ops), ``mutation`` (in-place updates as dependencies), ``flops``, ``devices``
(datasheet profiles of rented GPUs, links) and ``calibration`` (this CPU, measured and cached), ``precision``
(bytes per training dtype), ``cost`` (the roofline cost model), ``timing`` (timing ops and stages for real),
``options``, ``objective`` (scoring a plan), ``memory`` (what each stage's rank holds), ``dp``, ``metis``,
``refine`` and ``portfolio`` (the portfolio behind :func:`partition`), ``baselines``, ``chunk`` (column chunks of
a heavy linear), ``plan`` (the JSON-ready plan), ``stage_modules`` (executable stage modules, :func:`split`),
``units``, ``errors``, ``lazy`` (these exports). Modules are named for concepts and the exported functions for
actions, so no export is hidden by a submodule of its name.

The names below are imported on first use (:mod:`partitioner.lazy`), so ``import partitioner.errors`` or
``partitioner.units`` does not import torch.
"""
from typing import TYPE_CHECKING

from .lazy import lazy_exports

if TYPE_CHECKING:
    from .calibration import calibrate
    from .cost import NodeCosts, estimate
    from .devices import DEVICES, LINKS, PRECISIONS, DeviceRates, UnknownDeviceError, profile
    from .errors import EngineError
    from .graph import GraphError, OpGraph
    from .memory import StageMemory, stage_memory
    from .objective import MemoryBudgetError
    from .options import METHODS, UNLIMITED, PartitionOptions
    from .plan import PartitionPlan, StageSummary
    from .portfolio import partition
    from .stage_modules import SplitModel, Stage, split
    from .timing import StageTimes, measure, measure_stages
    from .tracing import TraceError, trace
    from .units import format_bytes, parse_size

__all__ = [
    "trace", "TraceError", "OpGraph", "GraphError", "partition", "PartitionOptions", "METHODS", "PartitionPlan",
    "StageSummary", "DeviceRates", "DEVICES", "LINKS", "PRECISIONS", "UNLIMITED", "UnknownDeviceError", "profile",
    "NodeCosts", "calibrate", "estimate", "measure", "measure_stages",
    "StageTimes", "StageMemory", "stage_memory", "MemoryBudgetError", "EngineError", "parse_size", "format_bytes",
    "split", "Stage", "SplitModel",
]

__getattr__, __dir__ = lazy_exports(__name__)
