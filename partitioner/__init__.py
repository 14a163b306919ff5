"""Partitioner: trace a torch model into an op graph and cut it into balanced, acyclic, executable stages.

    graph = partitioner.trace(model, args, kwargs)
    plan = partitioner.partition(graph, num_stages=4, microbatches=8)
    print(plan.summary())
    staged = plan.as_module()          # same outputs and gradients as ``model``

One folder per concern, each with a docstring that says what it owns and what it may import:
``capture`` (the traced program, the op graph and the stage modules cut from it), ``cost`` (the cost model: devices,
calibration, precision, the roofline, collectives, timing), ``cut`` (the options, the objective and the portfolio
behind :func:`partition`, the plan), one folder per parallel axis with its finding, rewriting and pricing (``tp``,
``sdp``) and ``layout`` (the layout planner behind ``smp plan``). Arrows go layout -> sdp -> cut -> tp -> cost ->
capture, never back; ``errors``, ``units`` and ``lazy`` (these exports) are the foundation every folder may import.
Every name a user imports is exported here; modules are named for concepts and the exported functions for actions,
so no export is hidden by a submodule of its name.

The names below are imported on first use (:mod:`partitioner.lazy`), so ``import partitioner.errors`` or
``partitioner.units`` does not import torch.
"""
from typing import TYPE_CHECKING

from .lazy import lazy_exports

if TYPE_CHECKING:
    from .capture.graph import GraphError, OpGraph
    from .capture.stage_modules import SplitModel, Stage, split
    from .capture.tracing import TraceError, trace
    from .cost.calibration import calibrate
    from .cost.devices import DEVICES, LINKS, PRECISIONS, DeviceRates, UnknownDeviceError, profile
    from .cost.roofline import NodeCosts, estimate
    from .cost.timing import StageTimes, measure, measure_stages
    from .cut.memory import StageMemory, stage_memory
    from .cut.objective import MemoryBudgetError
    from .cut.options import METHODS, UNLIMITED, PartitionOptions
    from .cut.plan import PartitionPlan, PlanError, PlanMismatchError, StageSummary
    from .cut.portfolio import partition
    from .errors import EngineError
    from .sdp.shards import PERSISTENCE_THRESHOLD, ShardedRank, sharded_dp
    from .tp.shard_program import shard_graph, tensor_parallel_graph
    from .tp.sharding import Sharding, find_sharding
    from .units import format_bytes, parse_size

__all__ = [
    "trace", "TraceError", "OpGraph", "GraphError", "partition", "PartitionOptions", "METHODS", "PartitionPlan",
    "StageSummary", "DeviceRates", "DEVICES", "LINKS", "PRECISIONS", "UNLIMITED", "UnknownDeviceError", "profile",
    "NodeCosts", "calibrate", "estimate", "measure", "measure_stages",
    "StageTimes", "StageMemory", "stage_memory", "MemoryBudgetError", "EngineError", "parse_size", "format_bytes",
    "split", "Stage", "SplitModel", "PlanError", "PlanMismatchError", "Sharding", "find_sharding", "shard_graph",
    "tensor_parallel_graph", "PERSISTENCE_THRESHOLD", "ShardedRank", "sharded_dp",
]

__getattr__, __dir__ = lazy_exports(__name__)
