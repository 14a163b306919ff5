"""Sharded parameters gathered where a stage's graph reads them, a unit at a time and prefetched: ZeRO-3 / FSDP at the
granularity of the graph.

ZeRO stage 3 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
arXiv:1910.02054) keeps each parameter sharded over the data-parallel replicas and makes it whole only while an op
needs it. FSDP (Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel",
arXiv:2304.11277) does so per module, from forward hooks; our stages are flat ``fx.GraphModule`` s that read
parameters by ``get_attr`` (:mod:`partitioner.capture.stage_modules`, placed before each parameter's first reader),
where a hook would gather a whole stage at once. So, as SimpleFSDP does (Zhang et al. 2024, "SimpleFSDP: Simpler
Fully Sharded Data Parallel with torch.compile", arXiv:2411.00284), the parameters are DTensors sharded on dim 0 and
the graph itself gathers them: :meth:`GatheredParams.insert` puts a ``gather`` node right after each ``get_attr`` of
a sharded parameter, and groups the stage's sharded parameters into units (:mod:`pipeline.gather_units`: one block
of a layer list each, one flat collective each), in the order the graph reads them.

* forward: the first ``gather`` of a unit waits for the unit's all-gather (launched when the previous unit was
  gathered, or now for the stage's first) and launches the next unit's, which runs while this one computes
  (FSDP's forward prefetch, section 3.4); each whole parameter is handed to the ops as a plain tensor and dropped
  after its last reader (fx's generated code drops a value after its last use).
* what autograd saves of a gathered tensor (a weight for its matmul's backward, or a view of it) is not kept: under
  :meth:`GatheredParams.saving` the saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``) pack it as a
  reference to its parameter, and the backward gathers its unit again when it needs it (FSDP's
  ``reshard_after_forward=True``), prefetching the unit before it (in the stage's order) whose weights the backward
  also needs (FSDP's backward prefetch); a unit gathered in a backward is held until the next is, or the pass ends
  (:meth:`GatheredParams.release`). A stage's last unit (of two or more) is the exception, as FSDP's root unit is
  not resharded after the forward: gathered once a step and kept whole until the step ends
  (:meth:`GatheredParams.end_step`; gathered again should its shards change in place), the backward, which starts
  with it, does not gather it again but launches the next unit's gather as its first gradient arrives.
* backward: the gradient of a gathered tensor accumulates whole, over the step's microbatches, in a buffer of its
  own, and is reduced once per step into the parameter's sharded ``.grad``: a reduce-scatter of the unit over the
  sharding group, and an all-reduce across its replicas when the mesh has two dimensions (hybrid sharding) — torch's
  own choice for pipelines of FSDP modules, which synchronise gradients at the last microbatch only
  (``torch.distributed.pipelining``'s ``backward_maybe_with_nosync``), trading a whole gradient buffer per stage for
  ``microbatches - 1`` fewer reductions. In the stage's last backward of the step (``final``, which the executor
  sets) a unit's reduce-scatter is launched as soon as each of its parameters has its last gradient, as FSDP's
  post-backward hook does, and runs while the backward goes on (two at most in flight);
  :meth:`GatheredParams.reduce_gradients` reduces what is left and waits for every one before the step returns.

Exact: the all-gathers move the shards' values, and the gradients are summed over the sharding group then over the
replica rows and divided by the replicas, as DTensor's ``Partial("avg")`` to ``Shard(0)`` did parameter by parameter
(equal up to that summation order, float rounding on 3 or more replicas).

``trace`` records each gather (forward or backward) with the bytes held then (whole parameters and the buffers of the
all-gathers in flight): the memory test and benchmark hold it to what :mod:`partitioner.sdp.units` plans.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.fx
from torch.distributed.tensor import DTensor, distribute_tensor

from partitioner.sdp.units import keeps_last
from pipeline.gather_units import Gathering, Reducing, Unit, units_of

__all__ = ["GatheredParams", "GatherEvent", "is_sharded", "shard_of"]


def is_sharded(t: Any) -> bool:
    """Is ``t`` a parameter held as a DTensor shard (one this module gathers)?"""
    return isinstance(t, DTensor) and isinstance(t, torch.nn.Parameter)


def shard_of(whole: torch.Tensor, mesh: Any, placements: Any) -> DTensor:
    """``whole`` as a DTensor over ``mesh`` with ``placements``: this rank's shard cut out with no communication
    (every replica holds the same whole value) into memory of its own, so ``whole`` can be freed."""
    cut = distribute_tensor(whole.detach(), mesh, placements, src_data_rank=None).to_local().clone()
    return DTensor.from_local(cut, mesh, placements, shape=whole.shape, stride=whole.stride())


class GatherEvent(NamedTuple):
    """One gather: the parameter's ``name`` (its attribute in the stage), ``backward`` (gathered again for the
    backward), its whole ``nbytes``, and ``live_bytes``, the most the gathering held while gathering its unit (whole
    parameters and all-gather buffers: :attr:`GatheredParams.held_bytes`)."""

    name: str
    backward: bool
    nbytes: int
    live_bytes: int


class _Gather(torch.autograd.Function):
    """The whole value of a sharded parameter; its gradient goes to the owner's whole-gradient buffer."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, owner: "GatheredParams") -> torch.Tensor:
        ctx.owner, ctx.param = owner, param
        ctx.set_materialize_grads(False)  # no gradient this pass (pipeline.row_grads defers one): no zeros added
        return owner.whole(param)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[None, None]:
        if grad is not None:
            ctx.owner.accumulate(ctx.param, grad)
        return None, None


@dataclass(eq=False)
class GatheredParams:
    """The gathering of one rank's sharded parameters: graph rewriting, units and their prefetches, saved-tensor
    hooks, gradient buffers and their reduction."""

    trace: list[GatherEvent] = field(default_factory=list)
    record: bool = False  # keep every gather in ``trace`` (the memory benchmark)
    final: bool = False  # the running backward is its stage's last of the step: reduce each unit once complete
    _grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # id(param) -> (param, buf)
    _live: dict[int, tuple[torch.Tensor, str]] = field(default_factory=dict)  # storage address -> (param, name)
    _live_bytes: int = 0
    _buffer_bytes: int = 0  # of the all-gathers in flight: output and input
    _reads: dict[int, int] = field(default_factory=dict)  # id(param) -> gather nodes reading it in its stage
    _unit: dict[int, Unit] = field(default_factory=dict)  # id(param) -> its unit
    _fwd: dict[Unit, dict[int, torch.Tensor]] = field(default_factory=dict)  # unit -> wholes its forward reads still
    _left: dict[int, int] = field(default_factory=dict)  # id(param) -> reads still to come in the running forward
    _again: "weakref.WeakValueDictionary[int, torch.Tensor]" = field(default_factory=weakref.WeakValueDictionary)
    _held: list[torch.Tensor] = field(default_factory=list)  # the unit a backward gathered last
    _regather: set[Unit] = field(default_factory=set)  # units whose weights a backward gathers again
    _pending: dict[Unit, Gathering] = field(default_factory=dict)  # prefetches in flight
    _final_seen: dict[int, int] = field(default_factory=dict)  # id(param) -> its gradients in the final backward
    _reducing: list[Reducing] = field(default_factory=list)  # reduce-scatters in flight
    _reduced: set[Unit] = field(default_factory=set)  # units reduced this step already
    _owned: set[int] = field(default_factory=set)  # id(param) whose gradient buffer is this object's to add into
    _kept: dict[Unit, tuple[tuple[int, ...], dict[int, torch.Tensor]]] = field(default_factory=dict)  # a stage's
    # last unit, whole this step: its shards' versions when gathered, and each parameter's whole value
    _backward_prefetched: bool = False  # the running backward launched its first gather

    def insert(self, gm: torch.fx.GraphModule) -> int:
        """Rewrite ``gm`` so that each ``get_attr`` of a sharded parameter is followed by its ``gather`` and every
        reader reads the whole tensor, and group its sharded parameters into units in the order ``gm`` reads them;
        returns how many gathers were inserted (0 leaves ``gm`` as it was)."""
        reads: dict[int, int] = {}
        first: list[tuple[str, Any]] = []
        for node in list(gm.graph.nodes):
            param = _attribute(gm, str(node.target)) if node.op == "get_attr" else None
            if not is_sharded(param):
                continue
            if id(param) not in reads:
                first.append((str(node.target), param))
            reads[id(param)] = reads.get(id(param), 0) + 1
            with gm.graph.inserting_after(node):
                whole = gm.graph.call_function(self.gather, (node, str(node.target)))
            node.replace_all_uses_with(whole, delete_user_cb=lambda user, new=whole: user is not new)
        self._reads.update(reads)
        for unit in units_of(first):
            self._unit.update((id(p), unit) for p in unit.params)
        if reads:
            gm.recompile()
        return sum(reads.values())

    def gather(self, param: torch.Tensor, name: str) -> torch.Tensor:
        """The whole value of the sharded parameter ``param`` (the stage's attribute ``name``), differentiable: its
        gradient goes to this step's whole-gradient buffer (the node :meth:`insert` adds). A plain tensor in its
        place (the fake weights a stage runs on to learn its outputs' metadata) is passed through."""
        return _Gather.apply(param, self) if isinstance(param, DTensor) else param

    def whole(self, param: torch.Tensor) -> torch.Tensor:
        """``param`` whole for a forward's reader: its unit gathered at its first read in the pass (see the module
        docstring), the whole value held until its last read in the pass, or, in a stage's last unit, until the
        step ends (:meth:`end_step`)."""
        unit, key = self._unit[id(param)], id(param)
        if _kept_whole(unit):
            held, versions = self._kept.get(unit), unit.versions()
            if held is None or held[0] != versions:  # gathered, or gathered again if a shard has changed
                held = self._kept[unit] = (versions,
                                           dict(zip(map(id, unit.params), self._gathered(unit, backward=False))))
            return held[1][key]
        wholes = self._fwd.get(unit)
        if wholes is None:
            wholes = self._fwd[unit] = dict(zip(map(id, unit.params), self._gathered(unit, backward=False)))
        left = self._left.pop(key, self._reads.get(key, 1)) - 1
        if left > 0:
            self._left[key] = left
            return wholes[key]
        out = wholes.pop(key)
        if not wholes:
            del self._fwd[unit]
        return out

    def _gathered(self, unit: Unit, backward: bool) -> list[torch.Tensor]:
        """``unit``'s parameters whole (its prefetch waited for, or gathered now), known to the hooks while they
        live; the next unit of the pass's direction is launched once this one's buffers are gone."""
        pending = self._pending.pop(unit, None) or self._start(unit)
        wholes = unit.finish_gather(pending)
        for p, name, out in zip(unit.params, unit.names, wholes):
            nbytes = out.numel() * out.element_size()
            key = out.untyped_storage().data_ptr()
            self._live[key] = (p, name)
            self._live_bytes += nbytes
            weakref.finalize(out, self._forget, key, nbytes)
        copied_out = self.held_bytes
        self._buffer_bytes -= pending.nbytes
        del pending  # its buffers go before the next unit's are made, as partitioner.sdp.units prices it
        if backward:
            after = self._regathered_before(unit)
        else:
            after = unit.order[unit.index + 1] if unit.index + 1 < len(unit.order) else None
        if after is not None and after not in self._pending and after not in self._kept:
            self._pending[after] = self._start(after)
        if self.record:
            held = max(copied_out, self.held_bytes)
            self.trace.extend(GatherEvent(name, backward, out.numel() * out.element_size(), held)
                              for name, out in zip(unit.names, wholes))
        return wholes

    def _regathered_before(self, unit: Unit) -> Unit | None:
        """The unit before ``unit`` in its stage's order whose weights a backward gathers again, if any."""
        return next((u for u in reversed(unit.order[:unit.index]) if u in self._regather), None)

    def _start(self, unit: Unit) -> Gathering:
        g = unit.start_gather()
        self._buffer_bytes += g.nbytes
        return g

    def _forget(self, key: int, nbytes: int) -> None:
        self._live.pop(key, None)
        self._live_bytes -= nbytes

    @property
    def live_bytes(self) -> int:
        """Bytes of gathered (whole) parameters alive now."""
        return self._live_bytes

    @property
    def held_bytes(self) -> int:
        """Bytes the gathering holds now: whole parameters and the buffers of the all-gathers in flight."""
        return self._live_bytes + self._buffer_bytes

    def accumulate(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Add ``grad`` (whole) to ``param``'s gradient buffer of this step; in the final backward, launch the
        reduction of ``param``'s unit once each of its parameters has all its gradients."""
        held, unit = self._grads.get(id(param)), self._unit[id(param)]
        if held is None:  # autograd's own tensor, not copied: another node may read it, so never added into
            self._grads[id(param)] = (param, grad.detach())
        elif id(param) in self._owned:
            held[1].add_(grad)
        else:
            self._grads[id(param)] = (param, held[1] + grad)
            self._owned.add(id(param))
        if _kept_whole(unit) and not self._backward_prefetched:  # the backward's first gather: launched as it starts
            self._backward_prefetched = True
            before = self._regathered_before(unit)
            if before is not None and before not in self._pending:
                self._pending[before] = self._start(before)
        if self.final:
            self._final_seen[id(param)] = self._final_seen.get(id(param), 0) + 1
            if all(self._final_seen.get(id(p), 0) >= self._reads.get(id(p), 1)
                   for p in unit.params if p.requires_grad):
                self._reduce(unit)

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Run a stage's forward with gathered tensors saved for backward as references, gathered again there."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def release(self) -> None:
        """The end of a stage's backward: drop what it gathered (the executor calls it)."""
        self._held = []
        self._backward_prefetched = False

    def end_step(self) -> None:
        """The end of a step's passes (the executor calls it, whatever happened): the stages' last units, kept whole
        through the step, are dropped before the optimizer changes their shards."""
        self._kept.clear()
        self._fwd.clear()
        self._left.clear()

    def _pack(self, t: torch.Tensor) -> Any:
        key = _storage_key(t) if self._live else None
        found = self._live.get(key) if key is not None else None
        if found is None or _kept_whole(self._unit[id(found[0])]):  # whole until the step ends: saved as it is
            return t
        self._regather.add(self._unit[id(found[0])])
        return _Ref(found[0], found[1], tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Ref):
            return packed
        whole = self._again.get(id(packed.param))  # a weight several ops saved: gathered once while it lives
        if whole is None:
            unit = self._unit[id(packed.param)]
            self._held = []  # the unit gathered before: what the backward still reads of it lives on in its views
            self._held = self._gathered(unit, backward=True)
            for p, out in zip(unit.params, self._held):
                self._again[id(p)] = out
            whole = self._again[id(packed.param)]
        return whole.as_strided(packed.shape, packed.stride, packed.offset)

    def reduce_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """Give each sharded ``param`` (of ``params``; others are skipped) its step's gradient: the whole buffers
        averaged over the mesh and left sharded as the parameter (zero for a parameter no microbatch reached),
        added to ``.grad`` as torch accumulates. Collective over the mesh: every replica calls it after its step,
        and it returns once every reduction of the step is done."""
        left: list[Unit] = []
        loose: list[tuple[str, Any]] = []  # sharded parameters no stage graph reads
        for p in params:
            unit = self._unit.get(id(p)) if is_sharded(p) and p.requires_grad else None
            if unit is None and is_sharded(p) and p.requires_grad:
                loose.append(("", p))
            elif unit is not None and unit not in self._reduced and unit not in left:
                left.append(unit)
        for unit in left + units_of(loose):
            self._reduce(unit)
        for r in self._reducing:
            r.unit.finish_reduce(r)
        for g in self._pending.values():  # a backward prefetch no backward used: its values may change now
            g.work.wait()
            self._buffer_bytes -= g.nbytes
        self._reducing, self._pending, self._held = [], {}, []
        self._grads.clear()
        self._owned.clear()
        self._final_seen.clear()
        self._reduced.clear()

    def _reduce(self, unit: Unit) -> None:
        """Launch the reduction of ``unit``'s whole gradients of this step (zero where none came), first finishing
        the oldest in flight when two are (so two at most hold their buffers)."""
        self._reduced.add(unit)
        if len(self._reducing) >= 2:
            r = self._reducing.pop(0)
            r.unit.finish_reduce(r)
        self._reducing.append(unit.start_reduce([self._grads.pop(id(p), (p, None))[1] for p in unit.params]))


@dataclass(frozen=True)
class _Ref:
    """A saved gathered tensor, packed: its parameter and where the saved tensor sits in the whole one."""

    param: torch.Tensor
    name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _kept_whole(unit: Unit) -> bool:
    """Is ``unit`` its stage's last of two or more, gathered once a step and kept whole until the step ends? Its
    backward comes first and at once, as FSDP keeps its root unit unsharded after the forward; the planner prices
    the memory (:func:`partitioner.sdp.units.gathered_peak`)."""
    return unit.index == len(unit.order) - 1 and keeps_last(len(unit.order))


def _storage_key(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage; None for tensors without one of their own (meta, subclasses)."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter or t.device.type == "meta":
        return None
    return t.untyped_storage().data_ptr()


def _attribute(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj
