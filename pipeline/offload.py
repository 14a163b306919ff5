"""Activation offloading: what a checkpointed stage keeps for its backward waits in host memory.

SageMaker model parallelism v1's ``offload_activations`` with ``activation_loading_horizon`` ("Activation
Offloading", https://docs.aws.amazon.com/sagemaker/latest/dg/model-parallel-extended-features-pytorch-activation-offloading.html):
the activations of checkpointed modules move to host memory after the forward and come back ahead of the backward,
``horizon`` passes early; the host-memory side of ZeRO-Offload (Ren et al. 2021, arXiv:2101.06840) applied to
activations. It is built from torch's saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``, the
mechanism of ``torch.autograd.graph.save_on_cpu``; https://pytorch.org/docs/stable/autograd.html#hooks-for-saved-tensors).

Here recomputation is per pipeline stage and microbatch (:mod:`pipeline.executor`), so the unit is (stage, microbatch):
a checkpointed stage (non-reentrant ``torch.utils.checkpoint``) keeps only its inputs for the backward, saved under
the hooks active around the checkpoint call (the ops inside save under checkpoint's own hooks), so
:meth:`ActivationOffload.saving` sees exactly the inputs of one F(stage, microbatch):

* pack: each input goes to host memory, on CUDA into pinned memory on a side stream ordered after the forward's
  kernels, elsewhere as a real copy (``.to("cpu", copy=True)``) so the bytes travel through the mechanism on CPU too.
  Parameters, views of them and empty tensors stay. The boundary inputs the executor holds for their gradients
  (autograd leaves) would keep their device memory: when the forward is done their storage is released, and the
  same tensors get it back on load.
* load: before each action (:meth:`ActivationOffload.advance`), the inputs of the next ``horizon`` backward actions
  of checkpointed stages in this rank's action list, of those whose forward ran, are copied back (on CUDA on the
  side stream, an event recorded); right before a backward the compute stream waits for its load.
* unpack hands the recomputation the loaded copy (the restored leaf itself), loading it now if nothing did.

Every pack, load and unpack is an :class:`OffloadEvent` in ``events`` (reset at every step), what tests count. On
CPU the host is the device, so no memory is saved there: the mechanism runs, and exactness is what it shows.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from pipeline.schedule import Action

__all__ = ["ActivationOffload", "OffloadEvent", "activation_offload", "DEFAULT_HORIZON"]

DEFAULT_HORIZON = 4  # SMP v1's default activation_loading_horizon


class OffloadEvent(NamedTuple):
    """One pack, load or unpack: ``kind`` ("pack", "load", "unpack"), the (``stage``, ``microbatch``) it belongs
    to, ``at`` the index in this rank's action list of the action running then, ``nbytes`` the bytes moved (a pack
    and an unpack are one tensor each, a load all of a (stage, microbatch)'s)."""

    kind: str
    stage: int
    microbatch: int
    at: int
    nbytes: int


@dataclass(eq=False)
class _Saved:
    """One packed tensor: its host copy until loaded, then its device copy; ``leaf``: the executor's tensor whose
    storage was released and comes back on load."""

    key: tuple[int, int]
    nbytes: int
    home: torch.device  # where it came from, and goes back to
    host: torch.Tensor | None
    leaf: torch.Tensor | None = None
    device: torch.Tensor | None = None


@dataclass
class _Entry:
    saved: list[_Saved] = field(default_factory=list)
    loaded: bool = False
    left: int = 0  # packed tensors not yet unpacked
    event: Any = None  # CUDA: the load's completion on the side stream


class ActivationOffload:
    """Moves the saved inputs of checkpointed stages to host memory and back (see the module docstring), on
    ``device``'s side stream when it is a CUDA device; ``horizon`` backward passes ahead."""

    def __init__(self, device: torch.device | str, horizon: int = DEFAULT_HORIZON):
        self.device = torch.device(device)
        self.horizon = horizon
        self.events: list[OffloadEvent] = []
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._store: dict[tuple[int, int], _Entry] = {}
        self._backwards: list[tuple[int, tuple[int, int]]] = []
        self._next = 0
        self._at = -1

    def start(self, actions: Sequence[Action], checkpointed: Collection[int]) -> None:
        """A new step over this rank's ``actions``: forget the last one's events and whatever it left."""
        self.events, self._store, self._next, self._at = [], {}, 0, -1
        self._backwards = [(i, (a.stage, a.microbatch)) for i, a in enumerate(actions)
                           if a.kind == "B" and a.stage in checkpointed]

    def advance(self, index: int) -> None:
        """Action ``index`` of the list is about to run: load the next ``horizon`` backwards' inputs (of those whose
        forward ran), and if it is such a backward, have the compute stream wait for its inputs."""
        self._at = index
        while self._next < len(self._backwards) and self._backwards[self._next][0] < index:
            self._next += 1
        for _, key in self._backwards[self._next:self._next + self.horizon]:
            entry = self._store.get(key)
            if entry is not None and not entry.loaded:
                self._load(key, entry)
        if self._next < len(self._backwards) and self._backwards[self._next][0] == index:
            entry = self._store.get(self._backwards[self._next][1])
            if entry is not None:
                self._wait(entry)

    @contextmanager
    def saving(self, stage: int, microbatch: int, module: torch.nn.Module,
               leaves: Iterable[torch.Tensor] = ()) -> Iterator[None]:
        """Around the checkpointed forward of ``stage`` on ``microbatch``: what it saves goes to host memory.
        ``leaves``: tensors the caller holds (boundary inputs kept for their gradients) whose storage is released
        once the forward is done, and restored on load; ``module``'s parameters are never moved."""
        key = (stage, microbatch)
        # A sharded parameter (a DTensor) by its local part.
        params = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
                  for p in module.parameters()}
        held = {id(t) for t in leaves}
        entry = self._store[key] = _Entry()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, key, entry, held, params), self._unpack):
            yield
        for saved in entry.saved:
            if saved.leaf is not None:  # on CUDA the side stream's copy still reads it: recorded in _pack
                saved.leaf.data = torch.empty(0, dtype=saved.leaf.dtype, device=saved.leaf.device)

    # -- the hooks ------------------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor, key: tuple[int, int], entry: _Entry, held: set[int], params: set[int]) -> Any:
        if t.numel() == 0 or isinstance(t, torch.nn.Parameter) or t.untyped_storage().data_ptr() in params:
            return t  # nothing to move, or not an activation
        saved = _Saved(key, t.numel() * t.element_size(), t.device, self._to_host(t.detach()),
                       leaf=t if id(t) in held else None)
        entry.saved.append(saved)
        entry.left += 1
        self._log("pack", key, saved.nbytes)
        return saved

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return packed
        entry = self._store.get(packed.key)
        if entry is not None:
            if not entry.loaded:  # a backward the schedule did not announce
                self._load(packed.key, entry)
            self._wait(entry)
            entry.left -= 1
            if not entry.left:
                del self._store[packed.key]
        self._log("unpack", packed.key, packed.nbytes)
        out = packed.leaf if packed.leaf is not None else packed.device
        assert out is not None, "an offloaded tensor is unpacked before it was loaded"
        return out

    # -- moving bytes ---------------------------------------------------------------------------------------
    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if self._side is None or not t.is_cuda:
            return t.to("cpu", copy=True)
        self._side.wait_stream(torch.cuda.current_stream(self.device))  # the forward's kernels made t
        with torch.cuda.stream(self._side):
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)
        t.record_stream(self._side)  # its memory is not reused before the copy is done
        return host

    def _load(self, key: tuple[int, int], entry: _Entry) -> None:
        for saved in entry.saved:
            assert saved.host is not None
            if self._side is None or saved.home.type != "cuda":
                saved.device = saved.host.to(saved.home, copy=True)
            else:
                with torch.cuda.stream(self._side):
                    saved.device = torch.empty_like(saved.host, device=saved.home)
                    saved.device.copy_(saved.host, non_blocking=True)
                saved.device.record_stream(torch.cuda.current_stream(saved.home))  # used on the compute stream
            saved.host = None
            if saved.leaf is not None:
                saved.leaf.data = saved.device
        if self._side is not None:
            entry.event = torch.cuda.Event()
            entry.event.record(self._side)
        entry.loaded = True
        self._log("load", key, sum(s.nbytes for s in entry.saved))

    def _wait(self, entry: _Entry) -> None:
        if entry.event is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.event)

    def _log(self, kind: str, key: tuple[int, int], nbytes: int) -> None:
        self.events.append(OffloadEvent(kind, key[0], key[1], self._at, nbytes))


def activation_offload(enabled: bool, horizon: int, device: torch.device | str,
                       checkpointed: Collection[int]) -> ActivationOffload | None:
    """The :class:`ActivationOffload` of a runner (None when not ``enabled``), after checking its options:
    offloading moves what checkpointed stages keep, so it needs some (``checkpointed``, the stages recomputed)."""
    if not isinstance(enabled, bool):
        raise ValueError(f"offload_activations={enabled!r} is not valid: True or False")
    if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
        raise ValueError(f"activation_loading_horizon={horizon!r} is not valid: a positive integer, how many "
                         f"backward passes ahead offloaded activations are loaded (default {DEFAULT_HORIZON})")
    if not enabled:
        return None
    if not checkpointed:
        raise ValueError("offload_activations=True moves the activations of checkpointed modules to host memory, "
                         "but no stage is checkpointed: mark modules with smp.set_activation_checkpointing "
                         "(PipelineRunner's checkpoint_modules=), or set offload_activations=False")
    return ActivationOffload(device, horizon)
