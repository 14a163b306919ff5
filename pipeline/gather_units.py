"""Units of sharded parameters, each gathered and reduce-scattered by one flat collective: FSDP's flat parameters.

PyTorch FSDP (Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel",
arXiv:2304.11277, section 3.2.1 "FlatParameter" and 3.4 "Communication optimizations") communicates a unit at a
time: the parameters of one wrapped module (a transformer block) are flattened into one buffer per rank, so a unit
costs one all-gather in each pass and one reduce-scatter per step, not one per parameter; FSDP2 (``fully_shard``)
keeps each parameter a ``Shard(0)`` DTensor and builds the flat buffer per collective, padding each parameter's dim-0
shard to ``ceil(rows / ranks)`` rows, as is done here. A unit is what :func:`units_of` groups from a stage graph's
reads, in the order the graph first reads them: the parameters of one block of a layer list (the module path up to
its first numeric component, ``model.layers.3``), and the parameters outside any block in consecutive runs cut where
one reaches a block's bytes: :func:`partitioner.sdp.units.group_units`, the grouping the planner prices.

* :meth:`Unit.start_gather` copies this rank's shards into one flat buffer (padding left as it is) and launches one
  ``all_gather_single`` over the sharding group, asynchronously; :meth:`Unit.finish_gather` waits for it and copies
  each parameter's rows out of the rank-major result (``[rank][parameter][padded rows]``) into a whole tensor of its
  own (FSDP2's all-gather copy-out), so each whole parameter is freed on its own once its last reader is done.
* :meth:`Unit.start_reduce` lays the unit's whole gradients out rank-major (zero padding) and launches one
  ``reduce_scatter_single`` (sum); :meth:`Unit.finish_reduce` waits, adds the replica rows with one ``all_reduce``
  when the mesh has two dimensions (hybrid sharding), divides by the replicas and adds each parameter's shard to its
  ``.grad`` (a view of the unit's reduced buffer), a DTensor placed as the parameter.

The results are those of gathering and reducing each parameter alone: the same values, rows and sums, a sum over the
sharding group then over the rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from partitioner.sdp.units import group_units

__all__ = ["Unit", "Gathering", "Reducing", "units_of"]

# Newer torch names them *_single (the old names warn); the oldest accepted, 2.9, has only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class _Slot:
    """One parameter's place in its unit's flat shard: ``offset`` (elements), ``rows`` per rank (padded, the first
    ranks' ``ceil(whole rows / ranks)``), ``row_numel`` (elements of one row), its whole ``shape``, this rank's
    ``local_rows``."""

    offset: int
    rows: int
    row_numel: int
    shape: torch.Size
    local_rows: int

    @property
    def numel(self) -> int:
        """Elements of the padded shard."""
        return self.rows * self.row_numel


@dataclass
class Gathering:
    """An all-gather of a unit in flight: the output buffer, the input it reads, and its work handle."""

    out: torch.Tensor
    flat: torch.Tensor
    work: Any

    @property
    def nbytes(self) -> int:
        """Bytes of its buffers."""
        return self.out.numel() * self.out.element_size() + self.flat.numel() * self.flat.element_size()


@dataclass
class Reducing:
    """A reduce-scatter of a unit's gradients in flight: input, output and work handle."""

    unit: "Unit"
    inp: torch.Tensor
    out: torch.Tensor
    work: Any


@dataclass(eq=False)
class Unit:
    """Sharded parameters gathered and reduced together (see the module docstring): ``params`` (DTensors sharded
    ``Shard(0)`` on the mesh's last dimension, ``Replicate`` on any other) and their stage attribute ``names``, in
    the order the stage reads them; ``order`` is the stage's list of units in that order, ``index`` this unit's place
    in it."""

    params: list[DTensor]
    names: list[str]
    order: list["Unit"] = field(default_factory=list)
    index: int = 0

    def __post_init__(self) -> None:
        first = self.params[0]
        self.mesh = first.device_mesh
        if self.mesh.ndim > 2:
            raise ValueError(f"sharded parameters over a {self.mesh.ndim}-dimensional mesh: only a sharding group "
                             "and replica rows are gathered by units")
        self.group = self.mesh.get_group(self.mesh.ndim - 1)
        self.rows_group = self.mesh.get_group(0) if self.mesh.ndim == 2 else None
        self.ranks = self.mesh.size(self.mesh.ndim - 1)
        self.replicas = self.mesh.size()
        self.dtype = first.dtype
        local = first.to_local()
        self.device = local.device
        rank = self.mesh.get_local_rank(self.mesh.ndim - 1)
        self.slots: list[_Slot] = []
        offset = 0
        for name, p in zip(self.names, self.params):
            whole_rows = p.shape[0]
            rows = -(-whole_rows // self.ranks)
            local_rows = p.to_local().shape[0]
            if local_rows != max(0, min(rows, whole_rows - rank * rows)):
                raise ValueError(f"{name}: {local_rows} rows on rank {rank} of {self.ranks} is not torch's Shard(0) of "
                                 f"{whole_rows} rows")
            slot = _Slot(offset, rows, math.prod(p.shape[1:]), p.shape, local_rows)
            self.slots.append(slot)
            offset += slot.numel
        self.numel = offset  # elements of this rank's flat shard

    @property
    def whole_nbytes(self) -> int:
        """Bytes of the unit's parameters whole."""
        return sum(p.numel() * p.element_size() for p in self.params)

    def versions(self) -> tuple[int, ...]:
        """The version counters of this rank's shards: they change when an optimizer steps them in place."""
        return tuple(p.to_local()._version for p in self.params)

    def start_gather(self) -> Gathering:
        """Launch the unit's all-gather (asynchronous; every rank of the sharding group launches the same)."""
        flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        for slot, p in zip(self.slots, self.params):
            flat[slot.offset:slot.offset + slot.local_rows * slot.row_numel].copy_(p.to_local().reshape(-1))
        out = torch.empty(self.ranks * self.numel, dtype=self.dtype, device=self.device)
        return Gathering(out, flat, _all_gather(out, flat, group=self.group, async_op=True))

    def finish_gather(self, g: Gathering) -> list[torch.Tensor]:
        """Wait for ``g`` and return each parameter whole, a tensor of its own."""
        g.work.wait()
        by_rank = g.out.view(self.ranks, self.numel)
        return [by_rank[:, s.offset:s.offset + s.numel].reshape(self.ranks * s.rows, *s.shape[1:])[:s.shape[0]]
                for s in self.slots]

    def start_reduce(self, grads: list[torch.Tensor | None]) -> Reducing:
        """Launch the reduce-scatter (a sum) of the whole gradients ``grads`` (one per parameter, None for zero)."""
        inp = torch.empty(self.ranks, self.numel, dtype=self.dtype, device=self.device)
        for s, g in zip(self.slots, grads):
            blocks = inp[:, s.offset:s.offset + s.numel].view(self.ranks, s.rows, s.row_numel)
            if g is None:
                blocks.zero_()
                continue
            full, rem = divmod(s.shape[0], s.rows) if s.rows else (0, 0)
            rows = g.reshape(s.shape[0], s.row_numel)
            blocks[:full].copy_(rows[:full * s.rows].view(full, s.rows, s.row_numel))
            if full < self.ranks:
                blocks[full, :rem].copy_(rows[full * s.rows:])
                blocks[full, rem:].zero_()
                blocks[full + 1:].zero_()
        out = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        work = _reduce_scatter(out, inp.view(-1), op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return Reducing(self, inp, out, work)

    def finish_reduce(self, r: Reducing) -> None:
        """Wait for ``r``, sum over the replica rows, average, and add each shard to its parameter's ``.grad``."""
        r.work.wait()
        if self.rows_group is not None:
            dist.all_reduce(r.out, group=self.rows_group)
        r.out.div_(self.replicas)
        for s, p in zip(self.slots, self.params):
            if not p.requires_grad:
                continue
            local = r.out[s.offset:s.offset + s.local_rows * s.row_numel].view(s.local_rows, *s.shape[1:])
            shard = DTensor.from_local(local, self.mesh, p.placements, shape=p.shape, stride=p.stride())
            p.grad = shard if p.grad is None else p.grad + shard


def units_of(reads: list[tuple[str, DTensor]]) -> list[Unit]:
    """The units of a stage that reads the sharded parameters ``reads`` ((attribute name, parameter), in the order
    the stage first reads them): :func:`partitioner.sdp.units.group_units`, the planner's grouping, with each unit of
    one dtype and mesh."""
    groups = group_units([name for name, _ in reads], [p.numel() * p.element_size() for _, p in reads],
                         [(p.dtype, id(p.device_mesh)) for _, p in reads])
    units = [Unit([reads[i][1] for i in g], [reads[i][0] for i in g]) for g in groups]
    for i, u in enumerate(units):
        u.order, u.index = units, i
    return units
