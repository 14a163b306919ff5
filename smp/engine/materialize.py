"""Each rank holds only its own stages' weights: materialise them on a weightless model, release the rest.

A model too large for one device is built without weights — on the ``meta`` device, or under
``smp.delay_param_initialization`` (:mod:`smp.delayed_init`; parameters on meta, buffers real: they are small
and often computed, like rotary frequencies) — then traced and partitioned with no memory for weights. After
partitioning each rank allocates only the parameters and buffers its own stages use and initialises them:
Hugging Face models with their ``_init_weights``, other modules with their own ``reset_parameters()``. A
model passed in materialised instead has the tensors of other stages released (turned to meta), so every
rank's memory drops to its share (the same rule torchtitan follows with ``to_empty`` + ``init_weights``).

Tensors change in place (:func:`torch.utils.swap_tensors`): the ``nn.Parameter`` objects stay the same, so
an optimizer built over ``model.parameters()`` before partitioning steps the materialised ones. Each
module is initialised from a generator seeded by its path and the user's initial seed, in a forked random
state: a module gets the same values on whichever rank holds it, and the user's random streams are
untouched.
"""
from __future__ import annotations

import itertools
import zlib
from typing import Iterable

import torch

from partitioner.errors import EngineError

__all__ = ["has_meta", "materialize", "release", "keep_own_share",
           "tensor_ids", "MaterializeError"]


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


def _swap(t: torch.Tensor, data: torch.Tensor) -> None:
    new = torch.nn.Parameter(data, t.requires_grad) if isinstance(t, torch.nn.Parameter) else data
    torch.utils.swap_tensors(t, new)


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
            _swap(t, torch.full(t.shape, fill, dtype=t.dtype, device=device))
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
    seed = torch.initial_seed()
    with torch.random.fork_rng(devices=[]):
        for path, sub in module.named_modules():
            own = list(itertools.chain(sub.parameters(recurse=False), sub.buffers(recurse=False)))
            if not any(id(t) in fresh for t in own):
                continue
            key = path if path not in shard_of else f"{path}@tp{shard_of[path]}"
            torch.manual_seed((seed + zlib.crc32(key.encode())) % 2**63)
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
        _swap(t, torch.empty(t.shape, dtype=t.dtype, device="meta"))
    return freed


def keep_own_share(module: torch.nn.Module, names: Iterable[str], device: torch.device | str,
                   initialise: bool = True, shard_of: dict[str, int] | None = None) -> int:
    """Make exactly this rank's tensors ``names`` real: allocate (and, with ``initialise``, initialise) those
    still on meta, release every other; returns the bytes released. ``shard_of``: see :func:`materialize`."""
    names = set(names)
    materialize(module, names, device, initialise, shard_of)
    return release(module, keep=names)
