"""Checkpoint files as a unit: staged writes with checksums, a commit manifest, verified loads.

A checkpoint is several files written by several ranks. Writing each file atomically (temporary name, then
rename) is not enough: if one rank fails halfway through a save over an older checkpoint, the others have
already replaced their files and a resume silently mixes two steps. So every save has three phases:

1. each saving rank writes its files where no reader looks (hidden temporary names, or a staging
   directory) and records each file's size and SHA-256 while writing;
2. the saving ranks agree, with one ``all_gather_object`` over exactly those ranks, that every one of them
   succeeded. A rank that failed still joins and reports its error, so the others abort at once and the
   older checkpoint stays untouched;
3. the files move to their final names and one rank writes the *manifest*, the commit marker: JSON that
   lists every file with its size and checksum, written atomically after everything else.

A reader trusts only files that a manifest lists. It checks their size and checksum before unpickling, so a
torn, truncated or bit-flipped file raises an error that names the file.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
from typing import Any, BinaryIO, Callable, TypeVar

import torch
import torch.distributed as dist

from partitioner.errors import EngineError

__all__ = ["CheckpointError", "MANIFEST_FORMAT", "agree", "write_file", "stage", "publish", "discard",
           "write_text", "write_manifest", "read_manifest", "load_file", "fsync_dir"]

MANIFEST_FORMAT = "smp-checkpoint/1"
_CHUNK = 1 << 22

T = TypeVar("T")


class CheckpointError(EngineError, RuntimeError):
    """A checkpoint that cannot be saved or loaded as asked; the message names the files and the fix."""


class _HashingWriter:
    """A write-only file object that hashes and counts what passes through it (torch.save streams into it)."""

    def __init__(self, fh: BinaryIO):
        self.fh, self.sha, self.size = fh, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        self.sha.update(data)
        self.size += memoryview(data).nbytes
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


def write_file(obj: Any, path: str, **torch_save_kwargs: Any) -> dict[str, Any]:
    """``torch.save(obj)`` to ``path`` and fsync it; returns ``{"bytes", "sha256"}`` of what was written.
    The file is created by ``open``, so its permissions follow the process umask (not mkstemp's 0600)."""
    with open(path, "wb") as fh:
        writer = _HashingWriter(fh)
        torch.save(obj, writer, **torch_save_kwargs)  # type: ignore[arg-type]  # a write-only file object
        fh.flush()
        os.fsync(fh.fileno())
    return {"bytes": writer.size, "sha256": writer.sha.hexdigest()}


def fsync_dir(directory: str) -> None:
    """Make renames and new entries in ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temporary(path: str) -> str:
    """The hidden name ``path`` is staged under: one per target, so a leftover from a crash is overwritten
    by the next save of that file instead of piling up."""
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{base}.smp-tmp")


def stage(files: dict[str, Any], **torch_save_kwargs: Any) -> dict[str, dict[str, Any]]:
    """Write each ``final path -> object`` under its temporary name; returns the digests by final path.
    On failure the temporary files written so far are removed before the error propagates."""
    digests: dict[str, dict[str, Any]] = {}
    try:
        for path, obj in files.items():
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            digests[path] = write_file(obj, _temporary(path), **torch_save_kwargs)
    except BaseException:
        discard(files)
        raise
    return digests


def publish(paths: Any) -> None:
    """Move staged files to their final names (each rename is atomic; the manifest commits the set)."""
    for path in paths:
        os.replace(_temporary(path), path)
    for directory in {os.path.dirname(os.path.abspath(p)) for p in paths}:
        fsync_dir(directory)


def discard(paths: Any) -> None:
    """Remove the temporary files of an aborted save."""
    for path in paths:
        try:
            os.unlink(_temporary(path))
        except FileNotFoundError:
            pass


def write_text(path: str, text: str) -> None:
    """Write a small text file atomically: temporary name, fsync, rename, fsync the directory."""
    tmp = _temporary(path)
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_manifest(path: str, files: dict[str, dict[str, Any]], **info: Any) -> None:
    """The commit marker: ``files`` (path -> digest) are recorded by name relative to the manifest's folder."""
    base = os.path.dirname(os.path.abspath(path))
    entries = {os.path.relpath(os.path.abspath(p), base): d for p, d in files.items()}
    write_text(path, json.dumps({"format": MANIFEST_FORMAT, "files": entries, **info}, indent=1, sort_keys=True) + "\n")


def read_manifest(path: str, what: str) -> dict[str, Any]:
    """The manifest at ``path``; ``what`` names the checkpoint in the error when there is none."""
    if not os.path.exists(path):
        raise CheckpointError(f"{what} is not a committed checkpoint: its manifest {path} is missing (the save did "
                              "not finish on every rank, or the files were written by another tool)")
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"truncated or corrupt checkpoint {path}: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT or not isinstance(data.get("files"), dict):
        raise CheckpointError(f"truncated or corrupt checkpoint {path}: not an smp checkpoint manifest "
                              f"(format {MANIFEST_FORMAT})")
    return data


def _verify(path: str, digest: dict[str, Any]) -> None:
    size = os.path.getsize(path)
    if size != digest["bytes"]:
        raise CheckpointError(f"truncated or corrupt checkpoint {path}: {size} bytes, but {digest['bytes']} were "
                              "committed; restore it or resume from another checkpoint")
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            sha.update(block)
    if sha.hexdigest() != digest["sha256"]:
        raise CheckpointError(f"truncated or corrupt checkpoint {path}: its SHA-256 differs from the one committed "
                              "in the manifest (the file changed after the save); restore it or resume from another "
                              "checkpoint")


def load_file(path: str, manifest: dict[str, Any] | None, **torch_load_kwargs: Any) -> Any:
    """``torch.load`` a checkpoint file, verified against ``manifest`` (the dict of :func:`read_manifest`
    for the folder holding ``path``) when given. Files are the engine's own, so ``weights_only`` defaults
    to False (optimizer state and user content hold more than tensors)."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    if manifest is not None:
        digest = manifest["files"].get(os.path.basename(path))
        if digest is None:
            raise CheckpointError(f"checkpoint file {path} is not listed in its manifest: it was not part of the "
                                  "committed save")
        _verify(path, digest)
    torch_load_kwargs.setdefault("weights_only", False)
    try:
        return torch.load(path, **torch_load_kwargs)
    except (RuntimeError, EOFError, ValueError, OSError, pickle.UnpicklingError) as exc:
        raise CheckpointError(f"truncated or corrupt checkpoint {path}: {exc}") from exc


def agree(action: Callable[[], T], group: Any, what: str) -> list[T]:
    """Run ``action`` here and share its outcome with every rank of ``group`` (None: all ranks).

    Returns every rank's result, in group order. If ``action`` failed on any rank, every rank raises one
    :class:`CheckpointError` naming the failed ranks and their errors. A rank that fails still takes part,
    so the others never wait for it. Every rank of ``group`` must call this.
    """
    error: Exception | None = None
    try:
        mine: tuple[bool, Any] = (True, action())
    except Exception as exc:
        error, mine = exc, (False, f"{type(exc).__name__}: {exc}")
    outcomes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, mine, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(outcomes))
    failed = [f"rank {r}: {value}" for r, (ok, value) in zip(ranks, outcomes) if not ok]
    if failed:
        raise CheckpointError(f"{what} failed; " + "; ".join(failed)) from error
    return [value for _, value in outcomes]
