"""Sharded parameters gathered where a stage's graph reads them: ZeRO-3 at the granularity of the graph.

ZeRO stage 3 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
arXiv:1910.02054) keeps each parameter sharded over the data-parallel replicas and makes it whole only while an op
needs it. FSDP (PyTorch's ``fully_shard``) does so per module, from forward hooks; our stages are flat
``fx.GraphModule`` s that read parameters by ``get_attr`` (:mod:`partitioner.capture.stage_modules`), where a hook
would gather
a whole stage at once. So, as SimpleFSDP does (Zhang et al. 2024, "SimpleFSDP: Simpler Fully Sharded Data Parallel
with torch.compile", arXiv:2411.00284), the parameters are DTensors sharded on dim 0 and the graph itself gathers
them: :meth:`GatheredParams.insert` puts a ``gather`` node right after each ``get_attr`` of a sharded parameter, so a
parameter is whole from the first op that reads it to the last (fx's generated code drops a value after its last
use). Every collective is DTensor's (``redistribute``), none is written here.

* forward: ``gather`` redistributes the parameter to ``Replicate`` and hands the ops a plain tensor.
* what autograd saves of a gathered tensor (a weight for its matmul's backward, or a view of it) is not kept: under
  :meth:`GatheredParams.saving` the saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``) pack it as a
  reference to its parameter, and the backward gathers it again when it needs it (FSDP's
  ``reshard_after_forward=True``), so memory holds the whole weights of the running ops only.
* backward: the gradient of a gathered tensor accumulates whole, over the step's microbatches, in a buffer of its
  own, and is reduced once per step into the parameter's sharded ``.grad``: a reduce-scatter over the sharding
  group, and an all-reduce across its replicas when the mesh has two dimensions (hybrid sharding) — torch's own
  choice for pipelines of FSDP modules, which synchronise gradients at the last microbatch only
  (``torch.distributed.pipelining``'s ``backward_maybe_with_nosync``), trading a whole gradient buffer per stage for
  ``microbatches - 1`` fewer reductions. In the stage's last backward of the step (``final``, which the executor
  sets) a parameter is reduced as soon as its last gradient is in, as FSDP's post-backward hook does, so its whole
  buffer goes while the backward goes on; :meth:`GatheredParams.reduce_gradients` reduces what is left.

``trace`` records each gather (forward or backward) with the bytes whole at that moment, what the memory benchmark
prints to show that no more than the planned parameters are whole at once.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.fx
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

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
    backward), its whole ``nbytes``, and ``live_bytes``, the whole bytes of every gathered parameter alive then."""

    name: str
    backward: bool
    nbytes: int
    live_bytes: int


class _Gather(torch.autograd.Function):
    """The whole value of a sharded parameter; its gradient goes to the owner's whole-gradient buffer."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, owner: "GatheredParams", name: str) -> torch.Tensor:
        ctx.owner, ctx.param = owner, param
        return owner.whole(param, name, backward=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.owner.accumulate(ctx.param, grad)
        return None, None, None


@dataclass(eq=False)
class GatheredParams:
    """The gathering of one rank's sharded parameters: graph rewriting, saved-tensor hooks and gradient buffers."""

    trace: list[GatherEvent] = field(default_factory=list)
    record: bool = False  # keep every gather in ``trace`` (the memory benchmark)
    _grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # id(param) -> (param, buf)
    _live: dict[int, tuple[torch.Tensor, str]] = field(default_factory=dict)  # storage address -> (param, name)
    _live_bytes: int = 0
    _again: "weakref.WeakValueDictionary[int, torch.Tensor]" = field(default_factory=weakref.WeakValueDictionary)
    final: bool = False  # the running backward is its stage's last of the step: reduce each gradient once complete
    _reads: dict[int, int] = field(default_factory=dict)  # id(param) -> gather nodes reading it in its stage
    _final_seen: dict[int, int] = field(default_factory=dict)  # id(param) -> its gradients in the final backward
    _reduced: set[int] = field(default_factory=set)  # id(param) of those reduced this step already

    def insert(self, gm: torch.fx.GraphModule) -> int:
        """Rewrite ``gm`` so that each ``get_attr`` of a sharded parameter is followed by its ``gather`` and every
        reader reads the whole tensor; returns how many were inserted (0 leaves ``gm`` as it was)."""
        count = 0
        reads: dict[int, int] = {}
        for node in list(gm.graph.nodes):
            param = _attribute(gm, str(node.target)) if node.op == "get_attr" else None
            if not is_sharded(param):
                continue
            reads[id(param)] = reads.get(id(param), 0) + 1
            with gm.graph.inserting_after(node):
                whole = gm.graph.call_function(self.gather, (node, str(node.target)))
            node.replace_all_uses_with(whole, delete_user_cb=lambda user, new=whole: user is not new)
            count += 1
        self._reads.update(reads)
        if count:
            gm.recompile()
        return count

    def gather(self, param: torch.Tensor, name: str) -> torch.Tensor:
        """The whole value of the sharded parameter ``param`` (the stage's attribute ``name``), differentiable: its
        gradient goes to this step's whole-gradient buffer (the node :meth:`insert` adds). A plain tensor in its
        place (the fake weights a stage runs on to learn its outputs' metadata) is passed through."""
        return _Gather.apply(param, self, name) if isinstance(param, DTensor) else param

    def whole(self, param: torch.Tensor, name: str, backward: bool) -> torch.Tensor:
        """``param`` gathered (DTensor's redistribute to ``Replicate``), known to the hooks while it lives."""
        assert isinstance(param, DTensor)  # gather() passes other tensors through
        with torch.no_grad():
            out = param.redistribute(param.device_mesh, [Replicate()] * param.device_mesh.ndim).to_local()
        nbytes = out.numel() * out.element_size()
        key = out.untyped_storage().data_ptr()
        self._live[key] = (param, name)
        self._live_bytes += nbytes
        weakref.finalize(out, self._forget, key, nbytes)
        if self.record:
            self.trace.append(GatherEvent(name, backward, nbytes, self._live_bytes))
        return out

    def _forget(self, key: int, nbytes: int) -> None:
        self._live.pop(key, None)
        self._live_bytes -= nbytes

    @property
    def live_bytes(self) -> int:
        """Bytes of gathered (whole) parameters alive now."""
        return self._live_bytes

    def accumulate(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Add ``grad`` (whole) to ``param``'s gradient buffer of this step."""
        held = self._grads.get(id(param))
        if held is None:
            self._grads[id(param)] = (param, grad.detach().clone(memory_format=torch.contiguous_format))
        else:
            held[1].add_(grad)
        if self.final:
            seen = self._final_seen[id(param)] = self._final_seen.get(id(param), 0) + 1
            if seen == self._reads.get(id(param), 1):
                self._reduce(param)

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Run a stage's forward with gathered tensors saved for backward as references, gathered again there."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, t: torch.Tensor) -> Any:
        key = _storage_key(t) if self._live else None
        found = self._live.get(key) if key is not None else None
        if found is None:
            return t
        return _Ref(found[0], found[1], tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Ref):
            return packed
        whole = self._again.get(id(packed.param))  # a weight several ops saved: gathered once while it lives
        if whole is None:
            whole = self.whole(packed.param, packed.name, backward=True)
            self._again[id(packed.param)] = whole
        return whole.as_strided(packed.shape, packed.stride, packed.offset)

    def reduce_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """Give each sharded ``param`` (of ``params``; others are skipped) its step's gradient: the whole buffers
        averaged over the mesh and left sharded as the parameter (zero for a parameter no microbatch reached),
        added to ``.grad`` as torch accumulates. Collective over the mesh: every replica calls it after its step."""
        for p in params:
            if is_sharded(p) and p.requires_grad and id(p) not in self._reduced:
                self._reduce(p)
        self._grads.clear()
        self._final_seen.clear()
        self._reduced.clear()

    def _reduce(self, p: torch.Tensor) -> None:
        """``p``'s whole gradient of this step (zero if none came), averaged over the mesh into its sharded
        ``.grad``."""
        assert isinstance(p, DTensor)
        self._reduced.add(id(p))
        held = self._grads.pop(id(p), None)
        buf = held[1] if held is not None else torch.zeros(p.shape, dtype=p.dtype, device=p.to_local().device)
        mesh = p.device_mesh
        reduced = DTensor.from_local(buf, mesh, [Partial("avg")] * mesh.ndim, shape=p.shape,
                                     stride=p.stride()).redistribute(mesh, p.placements)
        p.grad = reduced if p.grad is None else p.grad + reduced


@dataclass(frozen=True)
class _Ref:
    """A saved gathered tensor, packed: its parameter and where the saved tensor sits in the whole one."""

    param: torch.Tensor
    name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


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
