"""Partitioner: trace a torch model into an op graph and cut it into balanced, acyclic, executable stages.

    graph = partitioner.trace(model, args, kwargs)
    plan = partitioner.partition(graph, num_stages=4)
    print(plan.summary())
    staged = plan.as_module()          # same outputs and gradients as ``model``
"""
from .cost import DeviceRates, NodeCosts, calibrate, estimate, measure
from .graph import GraphError, OpGraph
from .objective import MemoryBudgetError
from .partition import METHODS, parse_size, partition
from .plan import PartitionPlan, StageSummary
from .split import SplitModel, Stage, split
from .trace import TraceError, trace

__all__ = [
    "trace", "TraceError", "OpGraph", "GraphError", "partition", "METHODS", "PartitionPlan", "StageSummary",
    "DeviceRates", "NodeCosts", "calibrate", "estimate", "measure", "MemoryBudgetError", "parse_size",
    "split", "Stage", "SplitModel",
]
