"""Activation statistics at module boundaries inside each stage, for the training-health rules.

SageMaker Debugger's ``poor_weight_initialization`` and ``exploding_tensor`` rules read layer outputs that its hook
saved. Here a stage is one flat ``torch.fx.GraphModule`` (:mod:`partitioner.capture.stage_modules`) whose nodes remember
the module that ran them (``nn_module_stack``), so the output of a layer is the last floating-point node of that
module. :class:`ActivationTaps` keeps, per local stage, a copy of the stage graph with a tap after each layer's
output and after each value the stage sends on (the activations crossing stages); the copy shares the stage's
parameters (``GraphModule`` copies attribute references). On check steps only, :meth:`ActivationTaps.start`
puts the copies in the stages' place, so other steps run the stage graphs unchanged and pay nothing. A tap
computes the variance of its value (``torch.var_mean``: NaN when the value holds NaN or Inf) and keeps it on the
device; nothing is copied off the device before the check reads every statistic at once.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.fx

from partitioner.capture.program import copy_graph

__all__ = ["ActivationTaps", "layer_paths"]


def layer_paths(named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> set[str]:
    """The modules whose outputs are layer activations: those holding a weight matrix or kernel (2-D or more),
    such as Linear, Conv and Embedding; norms and biases only rescale."""
    return {name.rpartition(".")[0] for name, p in named_parameters if p.dim() >= 2}


def _paths(node: torch.fx.Node) -> list[str]:
    return [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]


def _is_float(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


class ActivationTaps:
    """Variance of every layer output and stage output of this rank's stages, recorded on check steps."""

    def __init__(self, stages: Iterable[Any], layers: set[str]) -> None:
        """``stages``: this rank's :class:`partitioner.capture.stage_modules.Stage` objects, in stage order."""
        self.names: list[tuple[str, str]] = []  # tap index -> (module path, "layer" or "boundary")
        self.records: list[list[torch.Tensor]] = []
        self.copies: dict[int, tuple[Any, torch.fx.GraphModule]] = {}  # stage index -> (stage, graph not in use)
        self.active = False  # the tapped copies are in the stages' place
        for stage in stages:
            self.copies[stage.index] = (stage, self._tap(stage, layers))

    def _tap(self, stage: Any, layers: set[str]) -> torch.fx.GraphModule:
        module: torch.fx.GraphModule = stage.module
        graph = copy_graph(module.graph)
        last: dict[str, torch.fx.Node] = {}  # layer -> its last floating-point node, in graph order
        for node in graph.nodes:
            if node.op == "call_function" and _is_float(node):
                for path in _paths(node):
                    if path in layers:
                        last[path] = node
        position = {n: i for i, n in enumerate(graph.nodes)}
        targets = [(node, (path, "layer")) for path, node in sorted(last.items(), key=lambda kv: position[kv[1]])]
        output = next(n for n in graph.nodes if n.op == "output")
        if stage.consumers:  # not the last stage: what it sends on
            for node in torch.fx.node.map_aggregate(output.args[0], lambda n: n):
                if isinstance(node, torch.fx.Node) and _is_float(node):
                    where = (_paths(node) or [node.name])[-1] or "(model)"
                    targets.append((node, (f"{where} -> stage {stage.index + 1}+", "boundary")))
        for node, name in targets:
            index = len(self.names)
            self.names.append(name)
            self.records.append([])
            with graph.inserting_after(node):
                graph.call_function(self.record, (node, index))
        return torch.fx.GraphModule(module, graph, class_name=f"TappedStage{stage.index}")

    def record(self, value: torch.Tensor, index: int) -> None:
        """Called by a tap in a stage graph: keep the variance of ``value`` (on its device, no sync)."""
        self.records[index].append(torch.var_mean(value.detach(), correction=0)[0].float())

    def start(self) -> None:
        """Run the tapped copies in the stages' place until :meth:`stop` (one check step)."""
        if not self.active:
            for rec in self.records:
                rec.clear()
            self._swap()

    def stop(self) -> None:
        """Put the stages' own graphs back (nothing happens when :meth:`start` was not called)."""
        if self.active:
            self._swap()

    def _swap(self) -> None:
        for index, (stage, other) in list(self.copies.items()):
            if other.training != stage.module.training:  # the graphs read their module's ``training`` flag
                other.train(stage.module.training)
            self.copies[index] = (stage, stage.module)
            stage.module = other
        self.active = not self.active

    def variances(self) -> list[tuple[str, str, torch.Tensor]]:
        """(module path, kind, variance averaged over the recorded microbatches) of each tap that ran."""
        return [(path, kind, torch.stack(rec).mean()) for (path, kind), rec in zip(self.names, self.records) if rec]
