"""Each rank holds only its own stages' weights: materialise them on a weightless model, release the rest.

A model too large for one device is built without weights — on the ``meta`` device, or under
``smp.delay_param_initialization`` (:mod:`smp.delayed_init`; parameters on meta, buffers real: they are small
and often computed, like rotary frequencies) — then traced and partitioned with no memory for weights. After
partitioning each rank allocates only the parameters and buffers its own stages use and initialises them:
Hugging Face models with their ``_init_weights``, other modules with their own ``reset_parameters()``. A
model passed in materialised instead has the tensors of other stages released (turned to meta), so every
rank's memory drops to its share (the same rule torchtitan follows with ``to_empty`` + ``init_weights``).

Tensors change in place (:func:`swap_in`, :func:`torch.utils.swap_tensors`): the ``nn.Parameter`` objects stay the
same, so an optimizer built over ``model.parameters()`` before partitioning steps the materialised ones, also when
the model ran a forward before it was wrapped and a live autograd graph still holds its weights. Each
module is initialised from a generator seeded by its path and the user's initial seed (the one in effect when
the module was built under ``smp.delay_param_initialization``, :data:`INIT_SEED`), in a forked random
state: a module gets the same values on whichever rank holds it, and the user's random streams are
untouched.
"""
from __future__ import annotations

import itertools
import weakref
import zlib
from typing import Iterable

import torch

from partitioner.errors import EngineError

__all__ = ["has_meta", "materialize", "release", "keep_own_share", "swap_in",
           "tensor_ids", "MaterializeError", "STALE_GRAPH", "INIT_SEED"]

INIT_SEED = "_smp_init_seed"  # attribute of a module built without weights: the torch seed when it was built


class MaterializeError(EngineError, RuntimeError):
    """A weightless model could not be made runnable on this rank (the message names the tensors)."""


def has_meta(module: torch.nn.Module) -> bool:
    """Does the module hold any parameter or buffer without data (on the meta device)?"""
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(itertools.chain(module.named_parameters(remove_duplicate=False),
                                module.named_buffers(remove_duplicate=False)))


def tensor_ids(module: torch.nn.Module, names: Iterable[str] | None = None) -> set[int]:
    """Ids of the parameters and buffers of ``module`` named in ``names`` (every one of them when None); a
    tied tensor is in it when any of its names is."""
    tensors = _tensors(module)
    wanted = set(tensors) if names is None else set(names)
    return {id(t) for n, t in tensors.items() if n in wanted}


STALE_GRAPH = ("this backward runs through an autograd graph made before smp.DistributedModel partitioned the "
               "model, whose weights have since moved or been released on this rank: run the forward again, inside "
               "@smp.step, and call model.backward(loss) there")


def swap_in(t: torch.Tensor, data: torch.Tensor) -> None:
    """Give the parameter or buffer ``t`` the value ``data`` in place: the object stays the same (an optimizer or
    a traced program holding it sees the new value); its ``grad`` is dropped.

    :func:`torch.utils.swap_tensors` does it, but refuses a tensor that a live autograd graph holds: a model that
    ran a forward before it was wrapped saved its weights in that graph (a module that keeps its activation, a
    script that keeps an output). Such a tensor is cut out of the old graph: the graph keeps the value it
    computed with until whoever holds the graph drops it (the model no longer holds it), and a backward through
    it raises :data:`STALE_GRAPH` instead of accumulating a gradient the model would never see."""
    new = torch.nn.Parameter(data, t.requires_grad) if isinstance(t, torch.nn.Parameter) else data
    if t.requires_grad and t.is_leaf:  # the node a graph made before accumulates into: it now refuses, saying why
        torch.autograd.graph.get_gradient_edge(t).node.register_prehook(_stale_graph)
    try:
        torch.utils.swap_tensors(t, new)
    except RuntimeError:
        if weakref.getweakrefs(t) or t._use_count() <= 1 or type(t) is not type(new):  # type: ignore[attr-defined]
            raise  # not held by a graph: torch's reason stands
        _swap_held(t, new)


def _stale_graph(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
    raise RuntimeError(STALE_GRAPH)


def _swap_held(t: torch.Tensor, new: torch.Tensor) -> None:
    """:func:`torch.utils.swap_tensors` for a ``t`` that more than its own AccumulateGrad node holds: what it does,
    without its use-count check."""
    for name in ("__class__", "__dict__"):
        mine = getattr(t, name)
        setattr(t, name, getattr(new, name))
        setattr(new, name, mine)
    torch._C._swap_tensor_impl(t, new)


def materialize(module: torch.nn.Module, names: Iterable[str], device: torch.device | str,
                initialise: bool = True, shard_of: dict[str, int] | None = None) -> list[str]:
    """Allocate the named parameters and buffers that are on meta on ``device`` and (with ``initialise``)
    give them their modules' initial values; returns the names allocated. Tied names are one tensor.
    ``shard_of``: module path -> this rank's tp rank, for the modules holding a tensor-parallel shard: each
    shard is drawn from a stream of its own, so the ranks' shards are not copies of one another."""
    tensors = _tensors(module)
    wanted = set(names)
    done: dict[int, str] = {}
    for name in sorted(wanted):
        t = tensors[name]
        if t.is_meta and id(t) not in done:
            # NaN until an initialiser writes it: what none writes is found below, not left as garbage.
            fill = float("nan") if t.is_floating_point() else 0
            swap_in(t, torch.full(t.shape, fill, dtype=t.dtype, device=device))
            done[id(t)] = name
    if initialise and done:
        _initialise(module, {id(t) for t in tensors.values() if id(t) in done}, shard_of or {})
    left = sorted(n for n in wanted if tensors[n].is_meta)
    if left:
        raise MaterializeError(f"{', '.join(left[:3])}{' ...' if len(left) > 3 else ''} stayed on the meta device")
    return sorted(done.values())


def _initialise(module: torch.nn.Module, fresh: set[int], shard_of: dict[str, int]) -> None:
    """Initial values for the modules owning a fresh tensor, each from its own seeded generator; a buffer no
    initialiser filled is an error (it cannot be recovered from the checkpoint either: it is not saved)."""
    hf_root = next((m for m in module.modules() if callable(getattr(m, "_init_weights", None))), None)
    under_hf = {id(m) for m in hf_root.modules()} if hf_root is not None else set()
    now = torch.initial_seed()
    with torch.random.fork_rng(devices=[]):
        for path, sub in module.named_modules():
            own = list(itertools.chain(sub.parameters(recurse=False), sub.buffers(recurse=False)))
            if not any(id(t) in fresh for t in own):
                continue
            key = path if path not in shard_of else f"{path}@tp{shard_of[path]}"
            torch.manual_seed((getattr(sub, INIT_SEED, now) + zlib.crc32(key.encode())) % 2**63)
            with torch.no_grad():
                if hf_root is not None and id(sub) in under_hf:
                    hf_root._init_weights(sub)  # type: ignore[operator]  # a transformers model's method
                elif callable(getattr(sub, "reset_parameters", None)):
                    sub.reset_parameters()
    unset = []
    for path, sub in module.named_modules():
        for name, t in itertools.chain(sub.named_parameters(recurse=False), sub.named_buffers(recurse=False)):
            if id(t) in fresh and t.is_floating_point() and bool(torch.isnan(t).all()):
                if name in sub._non_persistent_buffers_set:
                    unset.append(f"{path}.{name}" if path else name)
                else:  # a checkpoint can fill it; until then nothing said how: zeros, not NaN
                    with torch.no_grad():
                        t.zero_()
    if unset:
        raise MaterializeError(f"buffer(s) {', '.join(unset[:3])} were built on the meta device and no "
                               "initialiser restores them (buffers are not in checkpoints): build the model under "
                               "smp.delay_param_initialization(), which keeps buffers, not on torch.device('meta')")


def release(module: torch.nn.Module, keep: Iterable[str]) -> int:
    """Turn every parameter and buffer not named in ``keep`` (nor tied to one that is) into a meta tensor;
    returns the bytes released."""
    tensors = _tensors(module)
    kept = {id(tensors[n]) for n in keep}
    freed, seen = 0, set()
    for t in tensors.values():
        if id(t) in kept or id(t) in seen or t.is_meta:
            continue
        seen.add(id(t))
        freed += t.numel() * t.element_size()
        swap_in(t, torch.empty(t.shape, dtype=t.dtype, device="meta"))
    return freed


def keep_own_share(module: torch.nn.Module, names: Iterable[str], device: torch.device | str,
                   initialise: bool = True, shard_of: dict[str, int] | None = None) -> int:
    """Make exactly this rank's tensors ``names`` real: allocate (and, with ``initialise``, initialise) those
    still on meta, release every other; returns the bytes released. ``shard_of``: see :func:`materialize`."""
    names = set(names)
    materialize(module, names, device, initialise, shard_of)
    return release(module, keep=names)
