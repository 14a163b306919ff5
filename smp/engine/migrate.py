"""Moving a running DistributedModel to a new plan: parameters, gradients and optimizer state change ranks.

Between two steps every rank of a pipeline knows both plans, so it knows which stages each pipeline rank
holds before and after, and so which tensors (parameters and buffers) every rank gains. For each tensor a
rank gains, one rank that held it sends its value, its gradient and its optimizer state (the wrapped torch
optimizer's per-parameter entry); messages go pair by pair in one order that every rank follows, so no rank
waits on one that waits on it. Tensors travel pickled, so every bit arrives as it left: the run continues
exactly as a run started with the new plan would (same losses, bit for bit). A rank that no longer holds a
parameter drops its gradient and optimizer state. Every pipeline (data-parallel replica) moves its own
tensors; the replicas hold equal values, so they stay equal.

The new :class:`pipeline.PipelineRunner` is built after the moves, since it makes the replicas of shared
parameters (tied weights) equal to their first holder, which must already hold the current value.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from partitioner import PartitionPlan
from partitioner.capture.stage_modules import split
from smp.engine.materialize import materialize
from smp.engine.pipeline_model import PipelineModel
from smp.engine.planning import smp_runner
from smp.runtime.state import State

__all__ = ["migrate", "holdings"]


def holdings(plan: PartitionPlan, stage_to_rank: list[int]) -> dict[int, set[int]]:
    """Pipeline rank -> ids of the tensors (parameters and buffers) its stages of ``plan`` hold."""
    out: dict[int, set[int]] = defaultdict(set)
    for st in split(plan.traced_graph(), plan.assignment, plan.num_stages).stages:
        module = st.module
        out[stage_to_rank[st.index]].update(id(t) for t in list(module.parameters()) + list(module.buffers()))
    return out


def _payload(tensor: torch.Tensor, optimizer: Any) -> dict[str, Any]:
    """What a new holder of ``tensor`` needs: its value, its gradient and its optimizer state (on the CPU)."""
    def cpu(value: Any) -> Any:
        return value.detach().cpu() if isinstance(value, torch.Tensor) else value

    grad = tensor.grad if isinstance(tensor, torch.nn.Parameter) else None
    entry = optimizer.state.get(tensor) if optimizer is not None else None
    return {"value": cpu(tensor), "grad": None if grad is None else cpu(grad),
            "state": None if entry is None else {k: (cpu(v), v.device.type if isinstance(v, torch.Tensor) else None)
                                                  for k, v in entry.items()}}


def _install(tensor: torch.Tensor, payload: dict[str, Any], optimizer: Any) -> None:
    with torch.no_grad():
        tensor.copy_(payload["value"])
    if isinstance(tensor, torch.nn.Parameter):
        tensor.grad = None if payload["grad"] is None else payload["grad"].to(tensor.device)
    if optimizer is not None and payload["state"] is not None:
        optimizer.state[tensor] = {k: (v.to(tensor.device if device != "cpu" else "cpu") if device else v)
                                   for k, (v, device) in payload["state"].items()}


def migrate(st: State, model: PipelineModel, plan: PartitionPlan) -> None:
    """Move ``model`` (partitioned, between steps) to ``plan`` (bound to its graph) on every rank: a collective
    over each pipeline (see the module docstring)."""
    old = model.runner
    assert old is not None  # partitioned
    stage_to_rank = old.schedule.stage_to_rank
    before, after = holdings(old.plan, stage_to_rank), holdings(plan, stage_to_rank)
    tensors: dict[int, tuple[str, torch.Tensor]] = {}
    for key, t in model.module.state_dict(keep_vars=True).items():
        tensors.setdefault(id(t), (key, t))
    wrapped = st.optimizer.optimizer if st.optimizer is not None else None
    moves: dict[tuple[int, int], list[int]] = defaultdict(list)  # (source, destination) pipeline ranks -> ids
    for ident in sorted(tensors, key=lambda i: tensors[i][0]):
        held = sorted(r for r, ids in before.items() if ident in ids)
        for dst in sorted(r for r, ids in after.items() if ident in ids and r not in held):
            if held:
                moves[held[0], dst].append(ident)
    me = old.rank
    ranks = old.ranks
    gained = [tensors[i][0] for i in after.get(me, set()) - before.get(me, set()) if i in tensors]
    materialize(model.module, gained, st.device, initialise=False)  # released earlier: room for what arrives
    for (src, dst), idents in sorted(moves.items()):
        if me == src:
            box = [{tensors[i][0]: _payload(tensors[i][1], wrapped) for i in idents}]
            dist.send_object_list(box, dst=ranks[dst], group=st.mp_group)
        elif me == dst:
            box = [{}]
            dist.recv_object_list(box, src=ranks[src], group=st.mp_group)
            for i in idents:
                _install(tensors[i][1], box[0][tensors[i][0]], wrapped)
    for ident in before.get(me, set()) - after.get(me, set()):  # no longer this rank's: forget its training state
        t = tensors[ident][1] if ident in tensors else None
        if isinstance(t, torch.nn.Parameter):
            t.grad = None
            if wrapped is not None:
                wrapped.state.pop(t, None)
    model.runner = smp_runner(st, model, plan, model.checkpointed_paths())  # also releases what this rank gave up
    old.close()
