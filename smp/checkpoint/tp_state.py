"""State dicts across tensor-parallel layouts: whole tensors gathered from the tp ranks' shards, and a rank's
shards cut back out of whole tensors.

Under tensor parallelism each tp rank's model holds its shards of the sharded parameters under the model's own
names (``smp.engine.tp_shards``), and its optimizer keeps state of the same shapes. A *full* state dict holds
whole tensors, so it loads under any tensor-parallel degree: gathering puts the shards together (block by block
for a fused weight such as GPT-2's ``c_attn``, :func:`partitioner.tp.shard_program.unshard_tensor`), and loading
cuts this rank's shard out (:func:`partitioner.tp.shard_program.shard_tensor`). A *partial* state dict holds one
tp rank's shards, so it loads only into that tp rank under that degree: :func:`check_partial` refuses any other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from partitioner.tp.shard_program import local_length, shard_tensor, unshard_tensor
from partitioner.tp.sharding import Shard
from smp.checkpoint.commit import CheckpointError

__all__ = ["TPLayout", "ShardedParam", "check_partial", "whole_model_state", "cut_model_state",
           "whole_optimizer_state", "cut_optimizer_state"]


@dataclass(frozen=True)
class TPLayout:
    """Where this rank stands in tensor parallelism: ``degree`` ranks per tp group, this one tp rank ``rank``,
    and the shard of every sharded state-dict key (each name of a tied weight)."""

    degree: int = 1
    rank: int = 0
    shards: dict[str, Shard] = field(default_factory=dict)

    def marker(self) -> dict[str, int]:
        """What a partial state dict records of the layout it was saved under."""
        return {"degree": self.degree, "rank": self.rank}


@dataclass(frozen=True)
class ShardedParam:
    """A sharded parameter as an optimizer sees it: its :class:`Shard` and this rank's (local) shape."""

    shard: Shard
    shape: tuple[int, ...]

    def piece_shape(self, degree: int, rank: int) -> tuple[int, ...]:
        """The shape of tp rank ``rank``'s shard."""
        out = list(self.shape)
        out[self.shard.dim] = local_length(self.shard, degree, rank)
        return tuple(out)

    def whole_shape(self) -> tuple[int, ...]:
        """The shape of the whole parameter."""
        out = list(self.shape)
        out[self.shard.dim] = self.shard.size
        return tuple(out)


def check_partial(saved_degree: int, saved_rank: int | None, layout: TPLayout, what: str) -> None:
    """Refuse ``what``, a partial state dict saved by tp rank ``saved_rank`` (None: not recorded) of
    ``saved_degree``, unless this rank has that place in the same degree."""
    if saved_degree != layout.degree:
        raise CheckpointError(f"{what} was saved with tensor_parallel_degree={saved_degree}, this run has "
                              f"tensor_parallel_degree={layout.degree}: a partial checkpoint holds each tp rank's "
                              "shards and loads only under the degree it was saved with; save a full checkpoint "
                              "(model.state_dict(), or smp.save_checkpoint(..., partial=False)) to change the degree")
    if saved_rank is not None and saved_rank != layout.rank:
        raise CheckpointError(f"{what} holds the shards of tp rank {saved_rank}, but this is tp rank {layout.rank}: "
                              "load this rank's own part (files named ..._<pp_rank>_<tp_rank>)")


def whole_model_state(parts: list[tuple[int, dict[str, torch.Tensor]]], layout: TPLayout) -> dict[str, torch.Tensor]:
    """Merge ``(tp_rank, local state)`` parts of every rank of a model replica into whole tensors: a sharded key
    from the shards of every tp rank, any other from whichever part holds it. Keys that shared one shard tensor
    (tied weights) share one whole tensor."""
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for tp_rank, part in parts:
        for key, value in part.items():
            pieces.setdefault(key, {})[tp_rank] = value
    out: dict[str, torch.Tensor] = {}
    made: dict[tuple[int, ...], torch.Tensor] = {}
    for key, by_rank in pieces.items():
        shard = layout.shards.get(key)
        if shard is None:
            out[key] = next(iter(by_rank.values()))
            continue
        if sorted(by_rank) != list(range(layout.degree)):
            raise CheckpointError(f"gathering {key}: the shards of tp ranks {sorted(by_rank)} arrived, but all "
                                  f"{layout.degree} tp ranks hold one")
        ordered = [by_rank[r] for r in range(layout.degree)]
        memo = tuple(id(t) for t in ordered)
        if memo not in made:
            made[memo] = unshard_tensor(ordered, shard, layout.degree)
        out[key] = made[memo]
    return out


def _cut(key: str, value: Any, shard: Shard, layout: TPLayout) -> Any:
    """This rank's shard of ``value`` when it is whole along the shard's dim; as it is when it is already this
    rank's shard."""
    if not isinstance(value, torch.Tensor) or value.dim() <= shard.dim:
        return value
    length = value.shape[shard.dim]
    mine = local_length(shard, layout.degree, layout.rank)
    if length == shard.size:
        return shard_tensor(value, shard, layout.degree, layout.rank)
    if length == mine:
        return value
    raise CheckpointError(f"{key} has length {length} along dim {shard.dim}, neither the whole {shard.size} nor tp "
                          f"rank {layout.rank}'s shard of {mine} (tensor_parallel_degree={layout.degree}): the state "
                          "is of another model or config")


def cut_model_state(sd: dict[str, Any], layout: TPLayout) -> dict[str, Any]:
    """``sd`` (whole tensors, a full state dict) with every sharded key cut to this rank's shard."""
    cut: dict[int, Any] = {}  # tied keys keep sharing one tensor
    out: dict[str, Any] = {}
    for key, value in sd.items():
        shard = layout.shards.get(key)
        if shard is None:
            out[key] = value
        else:
            if id(value) not in cut:
                cut[id(value)] = _cut(key, value, shard, layout)
            out[key] = cut[id(value)]
    return out


def whole_optimizer_state(parts: list[tuple[int, dict[int, dict[str, Any]]]], params: dict[int, ShardedParam],
                          degree: int) -> dict[int, dict[str, Any]]:
    """Merge ``(tp_rank, optimizer "state")`` parts into one: for a sharded parameter (``params``, by its key in the
    optimizer), each state tensor shaped like the shards (momenta, second moments) is put back together from every
    tp rank's; other entries (a step count) are tp rank 0's, which every tp rank shares."""
    by_index: dict[int, dict[int, dict[str, Any]]] = {}
    for tp_rank, part in parts:
        for index, entry in part.items():
            by_index.setdefault(index, {})[tp_rank] = entry
    out: dict[int, dict[str, Any]] = {}
    for index, by_rank in by_index.items():
        param = params.get(index)
        if param is None:
            out[index] = next(iter(by_rank.values()))
            continue
        if sorted(by_rank) != list(range(degree)):
            raise CheckpointError(f"gathering the optimizer state of parameter {index}: the state of tp ranks "
                                  f"{sorted(by_rank)} arrived, but all {degree} tp ranks hold a shard of it")
        merged: dict[str, Any] = {}
        for name, first in by_rank[0].items():
            values = [by_rank[r].get(name) for r in range(degree)]
            pieces = [v for r, v in enumerate(values)
                      if isinstance(v, torch.Tensor) and tuple(v.shape) == param.piece_shape(degree, r)]
            if len(pieces) == degree:
                merged[name] = unshard_tensor(pieces, param.shard, degree)
            else:
                merged[name] = first
        out[index] = merged
    return out


def cut_optimizer_state(state: dict[int, dict[str, Any]], params: dict[int, ShardedParam],
                        layout: TPLayout) -> dict[int, dict[str, Any]]:
    """An optimizer's ``"state"`` with the whole state tensors of sharded parameters (shaped like the whole
    parameter) cut to this rank's shards; state already of this rank's shapes stays as it is."""
    out: dict[int, dict[str, Any]] = {}
    for index, entry in state.items():
        param = params.get(index)
        if param is None or not isinstance(entry, dict):
            out[index] = entry
            continue
        whole = param.whole_shape()
        out[index] = {name: shard_tensor(v, param.shard, layout.degree, layout.rank)
                      if isinstance(v, torch.Tensor) and tuple(v.shape) == whole and whole != param.shape else v
                      for name, v in entry.items()}
    return out
