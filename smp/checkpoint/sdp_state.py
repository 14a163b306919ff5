"""State dicts of sharded parameters (sharded data parallelism, :mod:`smp.engine.sharded_dp`).

A sharded parameter is a DTensor, ``Shard(0)`` over its sharding group; so is each of its optimizer state tensors
(torch's optimizers keep state shaped as the parameter). Three ways out and back in:

* partial (``local_state_dict``): each rank's own shards, as plain tensors, marked :data:`SDP_KEY` with the
  sharding degree and this rank's place in the group; they load only into the same place of the same degree
  (:func:`check_shards`), as DTensors again (:func:`as_param`).
* full (``state_dict``): the whole tensors, gathered over the sharding group (``DTensor.full_tensor``, a collective:
  every replica calls it), under the module's own keys, so a full checkpoint of an sdp run loads into any layout.
* a whole tensor loaded into a sharded parameter keeps this rank's shard of it (:func:`as_param`, with no
  communication: :func:`pipeline.param_gather.shard_of`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pipeline.param_gather import shard_of
from smp.checkpoint.commit import CheckpointError

__all__ = ["local_shards", "whole_values", "as_param", "load_into", "check_shards", "marker", "shard_state",
           "optimizer_shards", "optimizer_whole"]


def marker(mesh: Any) -> dict[str, int]:
    """What :data:`SDP_KEY` records: the sharding degree and this rank's coordinate in its sharding group."""
    return {"degree": mesh.size(mesh.ndim - 1), "rank": mesh.get_local_rank(mesh.ndim - 1)}


def local_shards(values: dict[Any, Any]) -> dict[Any, Any]:
    """``values`` with every DTensor replaced by this rank's shard (a plain tensor), detached."""
    return {k: v.to_local().detach() if isinstance(v, DTensor) else v for k, v in values.items()}


def whole_values(values: dict[Any, Any]) -> dict[Any, Any]:
    """``values`` with every DTensor gathered whole (a collective over its mesh: every replica calls it)."""
    return {k: v.full_tensor().detach() if isinstance(v, DTensor) else v for k, v in values.items()}


def as_param(value: torch.Tensor, like: DTensor, whole: bool) -> DTensor:
    """``value`` laid out as the DTensor ``like``: from its ``whole`` tensor this rank's shard is cut; else ``value``
    is this rank's shard already (of a partial checkpoint of the same layout)."""
    value = value.detach().to(like.to_local().device, like.dtype)
    if whole:
        if tuple(value.shape) != tuple(like.shape):
            raise CheckpointError(f"a tensor of shape {tuple(value.shape)} cannot load into a sharded parameter of "
                                  f"shape {tuple(like.shape)}: the checkpoint is of another model or config")
        return shard_of(value, like.device_mesh, like.placements)
    if tuple(value.shape) != tuple(like.to_local().shape):
        raise CheckpointError(f"a shard of shape {tuple(value.shape)} cannot load into this rank's shard of shape "
                              f"{tuple(like.to_local().shape)}: the partial checkpoint is of another layout")
    return DTensor.from_local(value, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())


def load_into(module: torch.nn.Module, values: dict[str, Any], whole: bool) -> dict[str, Any]:
    """Copy into ``module``'s sharded parameters their entries of ``values`` (whole tensors with ``whole``, else this
    rank's shards); returns the other entries, for ``module.load_state_dict``."""
    params = dict(module.named_parameters(remove_duplicate=False))
    rest = {}
    with torch.no_grad():
        for k, v in values.items():
            p = params.get(k)
            if isinstance(p, DTensor) and isinstance(v, torch.Tensor):
                p.to_local().copy_(as_param(v, p, whole).to_local())
            else:
                rest[k] = v
    return rest


def shard_state(optimizer: torch.optim.Optimizer, whole: bool) -> None:
    """After ``optimizer.load_state_dict``: the state of each sharded parameter laid out as the parameter (its
    ``whole`` tensors cut to this rank's shard, or this rank's shards made DTensors again); scalars stay."""
    for p, entries in optimizer.state.items():
        if isinstance(p, DTensor):
            for k, v in entries.items():
                if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.dim() > 0:
                    entries[k] = as_param(v, p, whole)


def optimizer_shards(state: dict[Any, Any]) -> dict[Any, Any]:
    """An optimizer ``state_dict()["state"]`` with each sharded tensor as this rank's shard (plain)."""
    return {k: local_shards(v) if isinstance(v, dict) else v for k, v in state.items()}


def optimizer_whole(state: dict[Any, Any]) -> dict[Any, Any]:
    """An optimizer ``state_dict()["state"]`` with each sharded tensor gathered whole (collective, as
    :func:`whole_values`)."""
    return {k: whole_values(v) if isinstance(v, dict) else v for k, v in state.items()}


def check_shards(saved: dict[str, int] | None, mesh: Any, what: str) -> None:
    """Refuse ``what`` (a partial dict whose :data:`SDP_KEY` is ``saved``) unless this rank holds the same shards."""
    mine = marker(mesh) if mesh is not None else None
    if saved != mine:
        def say(m: dict[str, int] | None) -> str:
            return "no sharding" if m is None else f"shard {m['rank']} of sharded_data_parallel_degree={m['degree']}"
        raise CheckpointError(f"{what} holds {say(saved)}, but this rank holds {say(mine)}: a partial checkpoint of "
                              "sharded parameters loads on the layout and rank it was saved from (each replica its "
                              "own file); save a full checkpoint (partial=False, state_dict()) to change the layout")
