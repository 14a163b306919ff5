"""``smp.save`` / ``smp.load``: SMP v1's checkpoint files, saved as a unit and verified on load.

File names are SMP v1's. A partial object (``model.local_state_dict()``, ``optimizer.local_state_dict()``,
or a dict holding them) goes to ``PATH_<pp_rank>``, one file per pipeline rank, or with tensor parallelism to
``PATH_<pp_rank>_<tp_rank>``, one per pipeline and tp rank (each holds its tp rank's shards), under the same name
on every reduced-data-parallel replica. The replicas hold the same state, so replica 0 (``rdp_rank() == 0``)
writes the file and the other replicas' calls write nothing. A script that saves only on ``rdp_rank() == 0``
and loads on every replica therefore works. State that differs between replicas (optimizer state sharded with
``shard_optimizer_state``, the shards of sharded data parallelism) goes to ``PATH_<pp_rank>_<rdp_rank>``
(``PATH_<pp_rank>_<tp_rank>_<rdp_rank>``), which every rank writes. ``partial=False`` writes ``PATH`` from global
rank 0; other ranks' calls write nothing, as in SMP v1. A partial save loads only under the pipeline and
tensor-parallel degrees it was saved with.

The files form a unit (see :mod:`smp.checkpoint.commit`). ``PATH.manifest.json`` beside them lists every file with its
size and SHA-256. The ranks that write stage their files under hidden temporary names. They agree that all
of them succeeded: one ``all_gather_object`` over the model-parallel group of replica 0, or over all ranks for
sharded state. Then they rename the files, and the first of them writes the manifest. If a rank fails while
writing, nothing is renamed and the older checkpoint stays loadable. ``smp.load`` reads only files that the
manifest lists, and it verifies them. One window remains: a crash between the renames and the manifest. A
load then reports the files that do not match instead of mixing them; ``smp.save_checkpoint`` has no such
window.
"""
from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from smp.checkpoint.commit import (
    CheckpointError,
    agree,
    discard,
    load_file,
    publish,
    read_manifest,
    stage,
    write_manifest,
)
from smp.checkpoint.state_dicts import SDP_KEY, ZERO_KEY
from smp.runtime import state
from smp.runtime.topology import Topology

__all__ = ["save", "load", "partial_path", "rank_suffix", "manifest_path", "check_degrees"]


def manifest_path(path: str | os.PathLike) -> str:
    """The commit manifest of ``smp.save(obj, path)``."""
    return f"{os.fspath(path)}.manifest.json"


def rank_suffix(topology: Topology, rank: int, per_replica: bool = False) -> str:
    """How global ``rank``'s files of a partial checkpoint are told apart: ``_<pp_rank>``, with tensor parallelism
    ``_<pp_rank>_<tp_rank>``, and ``_<rdp_rank>`` after either for state that differs between replicas."""
    suffix = f"_{topology.pp_rank(rank)}"
    if topology.tp > 1:
        suffix += f"_{topology.tp_rank(rank)}"
    return suffix + (f"_{topology.rdp_rank(rank)}" if per_replica else "")


def partial_path(path: str | os.PathLike, topology: Topology, rank: int, per_replica: bool = False) -> str:
    """The file of global ``rank`` in a partial save: ``PATH`` and its :func:`rank_suffix`."""
    return f"{os.fspath(path)}{rank_suffix(topology, rank, per_replica)}"


def check_degrees(manifest: dict[str, Any], topology: Topology, what: str, per_replica: bool, hint: str = "") -> None:
    """Refuse a partial checkpoint (its ``manifest``) saved under other pipeline or tensor-parallel degrees, or,
    when it holds ``per_replica`` state, another number of replicas; ``what`` names it in the error, which ends
    with ``hint``."""
    saved_pp, saved_tp = manifest["pipeline_parallel_degree"], manifest.get("tensor_parallel_degree", 1)
    saved_dp = manifest["data_parallel_degree"]
    if (saved_pp, saved_tp) != (topology.pp, topology.tp) or (per_replica and saved_dp != topology.dp):
        replicas = f" x {saved_dp // saved_tp} replicas" if per_replica else ""
        raise CheckpointError(f"{what} was saved with pipeline_parallel_degree={saved_pp} x tensor_parallel_degree="
                              f"{saved_tp}{replicas}, but this run has {topology.pp} x {topology.tp}"
                              f"{f' x {topology.rdp} replicas' if per_replica else ''}: a partial checkpoint holds "
                              "each rank's part (its stages, its tp shards) and loads only on the layout it was "
                              "saved with; save a full checkpoint (partial=False, a full state_dict()) to change it"
                              + hint)


def _per_replica(obj: Any) -> bool:
    """Does ``obj`` hold sharded state (a ``local_state_dict`` of a sharded DistributedOptimizer, or of a model or
    optimizer under sharded data parallelism), at the top level or inside the dicts and lists of a user's
    checkpoint dict?"""
    if isinstance(obj, dict):
        return bool(obj.get(ZERO_KEY) or obj.get(SDP_KEY)) or _per_replica(list(obj.values()))
    if isinstance(obj, (list, tuple)):
        return any(_per_replica(v) for v in obj if isinstance(v, (dict, list, tuple)))
    return False


def _layout(topo: Topology, partial: bool, per_replica: bool) -> dict[str, Any]:
    return {"partial": partial, "per_replica": per_replica, "pipeline_parallel_degree": topo.pp,
            "tensor_parallel_degree": topo.tp, "data_parallel_degree": topo.dp}


def save(obj: Any, path: str | os.PathLike, partial: bool = True, v3: bool = False, **torch_save_kwargs: Any) -> None:
    """Save ``obj`` as SMP v1 does (see the module docstring for the names and for which ranks write).

    With ``partial=True`` every pipeline and tp rank of replica 0 must call it (every rank for sharded optimizer
    state): the save is committed only when all of them have written their file. ``v3`` is SMP's switch to its
    per-replica files for sharded optimizer state (Hugging Face's ``Trainer`` passes
    ``v3=smp.state.cfg.shard_optimizer_state``); here the files follow what ``obj`` holds (sharded state always
    goes to per-replica files), so it is accepted and changes nothing. Other keyword arguments go to ``torch.save``.
    """
    st = state.get()
    topo = st.topology
    if not partial:
        if st.rank == 0:
            digests = stage({os.fspath(path): obj}, **torch_save_kwargs)
            publish(digests)
            write_manifest(manifest_path(path), digests, **_layout(topo, False, False))
        return
    per_replica = _per_replica(obj)
    if not per_replica and topo.rdp_rank(st.rank) != 0:
        return  # replica 0 writes the file every replica loads
    group = None if per_replica else st.group("model-parallel")
    target = partial_path(path, topo, st.rank, per_replica)
    what = f"smp.save of {os.fspath(path)}_*"
    try:
        per_rank = agree(lambda: stage({target: obj}, **torch_save_kwargs), group, what)
        agree(lambda: publish([target]), group, what)
    except BaseException:
        discard([target])
        raise

    def commit() -> None:
        if dist.get_rank(group) == 0:  # mp_rank 0 of replica 0, or rank 0
            write_manifest(manifest_path(path), {k: v for d in per_rank for k, v in d.items()},
                           **_layout(topo, True, per_replica))
    agree(commit, group, what)


def load(path: str | os.PathLike, partial: bool = True, back_compat: bool = False, **torch_load_kwargs: Any) -> Any:
    """Load what :func:`save` wrote: this rank's file of a partial save, verified against the manifest.

    A file that has no manifest loads only with ``partial=False`` (a plain ``torch.save`` file, unverified).
    ``back_compat`` is SMP's switch for optimizer state saved by SMP before 1.10; files written here have one
    format, so it is accepted and changes nothing. Other keyword arguments go to ``torch.load``.
    """
    manifest_file = manifest_path(path)
    if not partial:
        manifest = read_manifest(manifest_file, os.fspath(path)) if os.path.exists(manifest_file) else None
        if manifest is not None and manifest.get("partial"):
            raise CheckpointError(f"{os.fspath(path)} was saved with partial=True (one file per pipeline rank): "
                                  "load it with smp.load(path, partial=True)")
        return load_file(os.fspath(path), manifest, **torch_load_kwargs)
    manifest = read_manifest(manifest_file, f"{os.fspath(path)}_*")
    if not manifest.get("partial"):
        raise CheckpointError(f"{os.fspath(path)} was saved with partial=False (one file): load it with "
                              "smp.load(path, partial=False)")
    st = state.get()
    topo = st.topology
    check_degrees(manifest, topo, f"{os.fspath(path)}_*", manifest["per_replica"])
    return load_file(partial_path(path, topo, st.rank, manifest["per_replica"]), manifest, **torch_load_kwargs)
