"""Reading a checkpoint on disk tensor by tensor, so that a rank reads only the weights of its own stages.

Three formats, the ones models come in: a ``torch.save`` file (loaded with ``mmap=True``: only the pages of
the tensors taken are read), a safetensors file, and a Hugging Face checkpoint directory as
``save_pretrained`` writes it (``model.safetensors``, or shards listed in ``model.safetensors.index.json``;
likewise ``pytorch_model.bin`` and its index). Keys are the model's ``state_dict()`` names. A rank asks for
its keys and opens only the files that hold them; the loader records which keys it read.

Under tensor parallelism a rank holds shards of the sharded weights: for those it reads only its slice
(:class:`Cut`: safetensors' ``get_slice``, one slice per block of a fused weight; from a ``torch.save`` file, the
mmap'd pages of the slice), never the whole tensor.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch.distributed.tensor import DTensor

from partitioner.errors import EngineError
from partitioner.tp.shard_program import shard_ranges
from partitioner.tp.sharding import Shard
from pipeline.param_gather import shard_of

__all__ = ["WeightsError", "LocalWeights", "Cut", "weight_cuts", "read_weights", "load_local"]

_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLE = ("model.safetensors", "pytorch_model.bin")


class WeightsError(EngineError, RuntimeError):
    """A checkpoint on disk does not hold what this rank needs (the message names the file and the keys)."""


@dataclass(frozen=True)
class Cut:
    """The part of a tensor a rank reads: along ``dim`` (of whole length ``size``), the ``[start, stop)`` ranges,
    concatenated in order (one per block of a fused weight)."""

    dim: int
    size: int
    ranges: tuple[tuple[int, int], ...]


def weight_cuts(shards: dict[str, Shard], tp: int, rank: int) -> dict[str, Cut]:
    """The :class:`Cut` of tp rank ``rank`` (of ``tp``) for each sharded key (``shards``: key -> its shard)."""
    return {k: Cut(s.dim, s.size, tuple(shard_ranges(s, tp, rank))) for k, s in shards.items()} if tp > 1 else {}


@dataclass
class LocalWeights:
    """The tensors read for this rank, the keys it asked for that the checkpoint lacks, and what was read."""

    tensors: dict[str, torch.Tensor]
    missing: list[str]
    keys_read: list[str] = field(default_factory=list)
    files_opened: list[str] = field(default_factory=list)


def _files(path: str) -> dict[str, str]:
    """Key -> file for a checkpoint path; a single file maps every key to itself (read lazily later)."""
    if os.path.isdir(path):
        for index in _INDEXES:
            full = os.path.join(path, index)
            if os.path.exists(full):
                with open(full) as fh:
                    mapping = json.load(fh).get("weight_map")
                if not isinstance(mapping, dict):
                    raise WeightsError(f"{full} has no 'weight_map': not a sharded checkpoint index")
                return {k: os.path.join(path, v) for k, v in mapping.items()}
        for single in _SINGLE:
            if os.path.exists(os.path.join(path, single)):
                return {"*": os.path.join(path, single)}
        raise WeightsError(f"{path} holds no checkpoint: expected one of {', '.join(_INDEXES + _SINGLE)}")
    if not os.path.exists(path):
        raise WeightsError(f"no checkpoint at {path}")
    return {"*": path}


def read_weights(path: str | os.PathLike, keys: Iterable[str], cuts: dict[str, Cut] | None = None) -> LocalWeights:
    """Read the tensors named ``keys`` (and no other) from the checkpoint at ``path``; of a key in ``cuts``, only
    that part. See the module docstring."""
    path = os.fspath(path)
    cuts = cuts or {}
    wanted = sorted(set(keys))
    where = _files(path)
    by_file: dict[str, list[str]] = {}
    missing: list[str] = []
    for k in wanted:
        f = where.get(k, where.get("*"))
        if f is None:
            missing.append(k)
        else:
            by_file.setdefault(f, []).append(k)
    out = LocalWeights({}, missing)
    for f, ks in sorted(by_file.items()):
        out.files_opened.append(f)
        got = _read(f, ks, cuts)
        out.tensors.update(got)
        out.keys_read.extend(sorted(got))
        out.missing.extend(k for k in ks if k not in got)
    out.missing.sort()
    return out


def _check_cut(file: str, key: str, shape: Any, cut: Cut) -> None:
    if len(shape) <= cut.dim or shape[cut.dim] != cut.size:
        raise WeightsError(f"{key} has shape {tuple(shape)} in {file}, but this rank reads a shard of a tensor "
                           f"{cut.size} long along dim {cut.dim}: the checkpoint is of another model or config")


def _sliced(file: str, key: str, fh: Any, cut: Cut) -> torch.Tensor:
    """This rank's part of safetensors tensor ``key``: one ``get_slice`` read per range."""
    part = fh.get_slice(key)
    _check_cut(file, key, part.get_shape(), cut)
    lead = (slice(None),) * cut.dim
    pieces = [part[lead + (slice(a, b),)] for a, b in cut.ranges]
    return torch.cat(pieces, cut.dim) if len(pieces) > 1 else pieces[0]


def _narrowed(file: str, key: str, whole: torch.Tensor, cut: Cut) -> torch.Tensor:
    """This rank's part of an mmap'd tensor, copied (only the pages of the slice are read)."""
    _check_cut(file, key, whole.shape, cut)
    pieces = [whole.narrow(cut.dim, a, b - a) for a, b in cut.ranges]
    return (torch.cat(pieces, cut.dim) if len(pieces) > 1 else pieces[0]).clone()


def _read(file: str, keys: list[str], cuts: dict[str, Cut]) -> dict[str, torch.Tensor]:
    try:
        if file.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(file, framework="pt", device="cpu") as fh:
                present = set(fh.keys())
                return {k: _sliced(file, k, fh, cuts[k]) if k in cuts else fh.get_tensor(k)
                        for k in keys if k in present}
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise WeightsError(f"cannot read checkpoint file {file}: {exc}") from None
    if not isinstance(state, dict):
        raise WeightsError(f"{file} holds a {type(state).__name__}, not a state dict of tensors")
    return {k: _narrowed(file, k, state[k], cuts[k]) if k in cuts else state[k] for k in keys if k in state}


def load_local(module: torch.nn.Module, path: str | os.PathLike, local: set[int], strict: bool = True,
               cuts: dict[str, Cut] | None = None) -> LocalWeights:
    """Copy from the checkpoint at ``path`` into ``module`` the tensors whose ids are in ``local`` (this rank's),
    reading no other; of a key in ``cuts`` (a tensor-parallel shard, :func:`weight_cuts`), only that part. A tied
    tensor is satisfied by any of its names (checkpoints keep one). With ``strict``, a local tensor the checkpoint
    lacks is an error naming it; a shape that differs always is."""
    names: dict[int, list[str]] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in local:
            names.setdefault(id(t), []).append(name)
    got = read_weights(path, (n for ns in names.values() for n in ns), cuts)
    tensors = {name: t for name, t in module.state_dict(keep_vars=True).items() if id(t) in local}
    unmatched = [ns[0] for ns in names.values() if not any(n in got.tensors for n in ns)]
    for name, value in got.tensors.items():
        target = tensors[name]
        if tuple(value.shape) != tuple(target.shape):
            raise WeightsError(f"{name} has shape {tuple(value.shape)} in {os.fspath(path)} but "
                               f"{tuple(target.shape)} in the model: the checkpoint is of another model or config")
    if strict and unmatched:
        raise WeightsError(f"{os.fspath(path)} lacks {len(unmatched)} tensor(s) this rank holds: "
                           f"{', '.join(sorted(unmatched)[:5])}{' ...' if len(unmatched) > 5 else ''}; "
                           "pass strict=False to keep their initial values")
    with torch.no_grad():
        for name, value in got.tensors.items():
            target = tensors[name]
            if isinstance(target, DTensor):  # sharded data parallelism: this rank's shard of the whole value
                shard = shard_of(value.to(target.dtype), target.device_mesh, target.placements)
                target.to_local().copy_(shard.to_local())
            else:
                target.copy_(value)
    got.missing = sorted(unmatched)
    return got
