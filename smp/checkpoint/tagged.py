"""``smp.save_checkpoint`` / ``smp.resume_from_checkpoint``: SMP (>= 1.10)'s tagged checkpoints, committed as
a unit.

Layout under ``path`` (the names are SMP's where SMP has them)::

    newest                       committed partial checkpoints, oldest first, one "<tag>_partial" a line
    <tag>_partial/               one committed partial checkpoint: its staging folder, renamed when complete
        manifest.json            the commit marker: every file's size and SHA-256, the layout, the smp config
        model_<pp_rank>.pt       model.local_state_dict() of each pipeline rank (written on rdp_rank 0); with
                                 tensor parallelism model_<pp_rank>_<tp_rank>.pt, each tp rank's shards
        optimizer_<pp_rank>.pt   optimizer.local_state_dict() (rdp_rank 0; optimizer_<pp_rank>_<tp_rank>.pt
                                 with tensor parallelism); with sharded optimizer state instead
        optimizer_<pp_rank>_<rdp_rank>.pt   each replica's shard (optimizer_<pp_rank>_<tp_rank>_<rdp_rank>.pt)
        model_<pp_rank>_<rdp_rank>.pt       with sharded data parallelism, each replica's parameter shards (and
                                 its optimizer shards as above): every rank writes, the manifest says sharded_model
        user_content.pt          user_content (rank 0)
    .<tag>_partial.staging/      a partial save in flight (removed when it fails, or by the next save)
    <tag>                        full checkpoint: model.state_dict() gathered; a plain torch state dict (rank 0)
    optimizer_<tag>              optimizer.state_dict() gathered (ours: SMP kept no optimizer in full checkpoints)
    user_content_<tag>           user_content of the full checkpoint
    <tag>.manifest.json          the full checkpoint's commit marker, with the plan the model was cut by

A partial save writes every rank's files into the staging folder. The ranks agree, over all ranks, that every
one of them succeeded, and then rank 0 writes the manifest, renames the folder to ``<tag>_partial`` and appends
it to ``newest``. If any rank fails, the folder is dropped and the older checkpoints stay as they were.
``resume_from_checkpoint`` loads only committed checkpoints (by default the last one in ``newest``), and each
rank verifies the files it reads against the manifest. Resuming before the first step is the usual case. The
model is partitioned at the first step, so the state is applied right after partitioning. A partial
checkpoint's model is cut by the plan it was saved with, and it resumes only under the pipeline and
tensor-parallel degrees it was saved with. A full checkpoint holds whole tensors (tensor-parallel shards
gathered), so it loads under any layout; it reuses its plan when the layout allows it, so that a resumed run
computes exactly what the uninterrupted one would have.
"""
from __future__ import annotations

import os
import shutil
import warnings
from typing import Any, Callable

from smp.checkpoint.commit import (
    CheckpointError,
    agree,
    load_file,
    publish,
    read_manifest,
    stage,
    write_file,
    write_manifest,
    write_text,
)
from smp.checkpoint.save_load import check_degrees, rank_suffix
from smp.checkpoint.state_dicts import PARTIAL_KEY, ZERO_KEY, CheckpointModel, CheckpointOptimizer, to_hf_keys
from smp.runtime import state

__all__ = ["save_checkpoint", "resume_from_checkpoint"]

_NEWEST = "newest"
_MANIFEST = "manifest.json"


def save_checkpoint(path: str | os.PathLike, tag: str, partial: bool = True, model: CheckpointModel | None = None,
                    optimizer: CheckpointOptimizer | None = None, user_content: Any = None,
                    translate_if_full: bool = True, num_kept_partial_checkpoints: int | None = None) -> None:
    """Save a checkpoint under ``path`` (created if needed) as ``tag``; every rank calls it with the same tag.

    ``partial=True``: each rank writes what it holds into ``<tag>_partial/``, and the checkpoint becomes the
    newest one. ``num_kept_partial_checkpoints=N`` then deletes the oldest partial checkpoints until N are
    left. ``partial=False``: the model and optimizer state are gathered, and rank 0 writes them as ``<tag>``
    and ``optimizer_<tag>``; these load on any layout. ``translate_if_full`` (SMP's switch) writes a full model
    under Hugging Face's keys, through the ``smp_to_hf`` translators of ``smp.state.module_manager.translate_functions``
    (none without tensor parallelism: the module's own keys are Hugging Face's); False writes it under this
    model's keys, marked so (SMP's ``_smp_is_partial: False``). ``user_content`` is any picklable object, and
    ``resume_from_checkpoint`` returns it.
    """
    st = state.get()
    if model is None and optimizer is None:
        warnings.warn("smp.save_checkpoint got neither a model nor an optimizer: nothing was saved", stacklevel=2)
        return
    if model is not None and not isinstance(model, CheckpointModel):
        raise TypeError(f"smp.save_checkpoint saves an smp.DistributedModel, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, CheckpointOptimizer):
        raise TypeError(f"smp.save_checkpoint saves an smp.DistributedOptimizer, got {type(optimizer).__name__}")
    if num_kept_partial_checkpoints is not None and num_kept_partial_checkpoints <= 0:
        warnings.warn(f"num_kept_partial_checkpoints={num_kept_partial_checkpoints} is not positive: every partial "
                      "checkpoint is kept", stacklevel=2)
        num_kept_partial_checkpoints = None
    path = os.fspath(path)
    what = f"smp.save_checkpoint({path!r}, tag={tag!r})"
    tags = agree(lambda: tag, None, what)
    if not isinstance(tag, str) or any(t != tag for t in tags):
        raise CheckpointError(f"{what}: the tag must be one string, the same on every rank; got {tags}")
    if partial:
        _save_partial(st, path, tag, model, optimizer, user_content, num_kept_partial_checkpoints, what)
    else:
        _save_full(st, path, tag, model, optimizer, user_content, translate_if_full, what)


def _layout(st: state.State) -> dict[str, Any]:
    return {"pipeline_parallel_degree": st.topology.pp, "tensor_parallel_degree": st.topology.tp,
            "data_parallel_degree": st.topology.dp, "smp_config": st.config.to_dict()}


def _save_partial(st: state.State, path: str, tag: str, model: CheckpointModel | None,
                  optimizer: CheckpointOptimizer | None, user_content: Any, keep: int | None, what: str) -> None:
    name = f"{tag}_partial"
    final, staging = os.path.join(path, name), os.path.join(path, f".{name}.staging")
    rdp, sdp = st.topology.rdp_rank(st.rank), st.sdp_mesh is not None
    mine, per_replica = rank_suffix(st.topology, st.rank), rank_suffix(st.topology, st.rank, per_replica=True)

    def prepare() -> None:
        if st.rank == 0:
            os.makedirs(path, exist_ok=True)
            for entry in os.listdir(path):  # leftovers of saves that were cut off
                if entry.startswith(".") and entry.endswith((".staging", ".old")):
                    shutil.rmtree(os.path.join(path, entry), ignore_errors=True)
            os.makedirs(staging)

    def write() -> dict[str, Any]:
        files: dict[str, Any] = {}
        if model is not None and (rdp == 0 or sdp):  # sharded data parallelism: every replica its own shards
            files[f"model{per_replica if sdp else mine}.pt"] = model.local_state_dict()
        if optimizer is not None:
            local = optimizer.local_state_dict()
            if local.get(ZERO_KEY) or sdp:
                files[f"optimizer{per_replica}.pt"] = local
            elif rdp == 0:
                files[f"optimizer{mine}.pt"] = local
        if user_content is not None and st.rank == 0:
            files["user_content.pt"] = user_content
        return {os.path.join(staging, n): write_file(obj, os.path.join(staging, n)) for n, obj in files.items()}

    agree(prepare, None, what)
    try:
        digests = agree(write, None, what)
    except CheckpointError:
        if st.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise

    def commit() -> None:
        if st.rank == 0:
            sharded = optimizer is not None and (optimizer.state_sharded or sdp)
            write_manifest(os.path.join(staging, _MANIFEST), {k: v for d in digests for k, v in d.items()},
                           tag=tag, partial=True, sharded_optimizer=sharded, sharded_model=sdp, **_layout(st))
            if os.path.exists(final):  # the same tag saved again: swap the folders, then drop the old one
                old = os.path.join(path, f".{name}.old")
                os.replace(final, old)
                os.replace(staging, final)
                shutil.rmtree(old)
            else:
                os.replace(staging, final)
            _append_newest(path, name, keep)
    agree(commit, None, what)


def _append_newest(path: str, name: str, keep: int | None) -> None:
    """Make ``name`` the newest partial checkpoint, then delete the oldest beyond ``keep``."""
    entries = [e for e in _read_newest(path) if e != name] + [name]
    dropped = entries[:-keep] if keep else []
    write_text(os.path.join(path, _NEWEST), "".join(f"{e}\n" for e in entries[len(dropped):]))
    for entry in dropped:
        shutil.rmtree(os.path.join(path, entry), ignore_errors=True)


def _read_newest(path: str) -> list[str]:
    newest = os.path.join(path, _NEWEST)
    if not os.path.exists(newest):
        return []
    with open(newest) as fh:
        return [line.strip() for line in fh if line.strip()]


def _save_full(st: state.State, path: str, tag: str, model: CheckpointModel | None,
               optimizer: CheckpointOptimizer | None, user_content: Any, translate: bool, what: str) -> None:
    rdp, sdp = st.topology.rdp_rank(st.rank), st.sdp_mesh is not None
    # Gathers: the model over each model-parallel group (replica 0's is enough), sharded optimizer state over all
    # ranks; under sharded data parallelism both over all ranks (each sharding group puts its shards together).
    model_sd = model.state_dict() if model is not None and (rdp == 0 or sdp) else None
    if model_sd is not None:  # under Hugging Face's keys, or marked as under this model's (SMP v1)
        model_sd = to_hf_keys(model_sd, st.translate_functions) if translate else {**model_sd, PARTIAL_KEY: False}
    sharded = optimizer is not None and (optimizer.state_sharded or sdp)
    opt_sd = optimizer.state_dict() if optimizer is not None and (sharded or rdp == 0) else None
    files = {os.path.join(path, tag): model_sd, os.path.join(path, f"optimizer_{tag}"): opt_sd,
             os.path.join(path, f"user_content_{tag}"): user_content}
    files = {k: v for k, v in files.items() if v is not None} if st.rank == 0 else {}

    def write() -> dict[str, Any]:
        os.makedirs(path, exist_ok=True)
        return stage(files)
    digests = agree(write, None, what)[0]  # rank 0's

    def commit() -> None:
        if st.rank == 0:
            publish(digests)
            plan = model.partition_plan() if model is not None else None
            plan = plan.to_json() if plan is not None else None
            write_manifest(os.path.join(path, f"{tag}.manifest.json"), digests, tag=tag, partial=False, plan=plan,
                           **_layout(st))
    agree(commit, None, what)


def resume_from_checkpoint(path: str | os.PathLike, tag: str | None = None, partial: bool = True,
                           strict: bool = True, load_optimizer: bool = True, load_sharded_optimizer_state: bool = True,
                           translate_function: Callable[[dict], dict] | None = None) -> Any:
    """Load a checkpoint written by :func:`save_checkpoint` into the DistributedModel and DistributedOptimizer
    of this process (create both first), on every rank; returns the saved ``user_content`` (or None).

    ``tag=None`` takes the newest committed partial checkpoint; a full checkpoint (``partial=False``) needs its
    tag. ``strict`` is the model's ``load_state_dict(strict=...)``. ``load_optimizer=False`` leaves the optimizer
    as it is. ``load_sharded_optimizer_state=False`` skips sharded optimizer state, for example to resume with
    another data-parallel degree. ``translate_function`` maps a full checkpoint's state dict to this model's
    keys before loading; without it, one not marked as under this model's keys goes through SMP's ``hf_to_smp``
    translators, as in SMP v1 (a Hugging Face ``pytorch_model.bin`` loads as it is). Before the first step, the
    state is applied right after the model is partitioned.
    """
    st = state.get()
    if st.model is None:
        raise CheckpointError("smp.resume_from_checkpoint loads into the smp.DistributedModel: create it (and the "
                              "smp.DistributedOptimizer) before resuming")
    path = os.fspath(path)
    what = f"smp.resume_from_checkpoint({path!r}, tag={tag!r})"
    if partial:
        newest = agree(lambda: _committed(path, tag) if st.rank == 0 else None, None, what)[0]
        assert newest is not None  # rank 0's answer (it raises when there is none)
        folder = os.path.join(path, newest)
        manifest = read_manifest(os.path.join(folder, _MANIFEST), folder)
        return _resume_partial(st, folder, manifest, strict, load_optimizer, load_sharded_optimizer_state)
    if tag is None:
        raise CheckpointError(f"{what}: a full checkpoint (partial=False) is loaded by its tag, the name of its "
                              "file in path")
    return _resume_full(st, path, tag, strict, load_optimizer, translate_function)


def _committed(path: str, tag: str | None) -> str:
    """The folder name of the partial checkpoint to resume: ``tag``'s, or the newest committed one."""
    listed = _read_newest(path)
    if tag is not None:
        name = f"{tag}_partial"
        if not os.path.exists(os.path.join(path, name, _MANIFEST)):
            raise CheckpointError(f"{path} holds no committed partial checkpoint {tag!r} (committed, oldest first: "
                                  f"{listed}); a save that failed or was cut off commits nothing")
        return name
    if not listed:
        raise CheckpointError(f"{path} holds no partial checkpoint to resume: {os.path.join(path, _NEWEST)} is "
                              "missing or empty; save with smp.save_checkpoint, or pass tag=")
    for name in reversed(listed):
        if os.path.exists(os.path.join(path, name, _MANIFEST)):
            return name
    raise CheckpointError(f"none of the partial checkpoints listed in {os.path.join(path, _NEWEST)} ({listed}) "
                          "is committed in its folder")


def _resume_partial(st: state.State, folder: str, manifest: dict[str, Any], strict: bool, load_optimizer: bool,
                    load_sharded: bool) -> Any:
    topo = st.topology
    files = manifest["files"]
    sharded = manifest["sharded_optimizer"] and load_optimizer and load_sharded
    sharded_model = manifest.get("sharded_model", False)  # sharded data parallelism: each replica's shards
    check_degrees(manifest, topo, folder, sharded or sharded_model, "; or pass load_sharded_optimizer_state=False "
                  "to leave its sharded optimizer state out" if sharded and not sharded_model else "")
    model_file = f"model{rank_suffix(topo, st.rank, per_replica=sharded_model)}.pt"
    if model_file in files:
        st.model.load_state_dict(load_file(os.path.join(folder, model_file), manifest), strict=strict)
    opt_file = f"optimizer{rank_suffix(topo, st.rank, per_replica=manifest['sharded_optimizer'])}.pt"
    if load_optimizer and opt_file in files and (load_sharded or not manifest["sharded_optimizer"]):
        _optimizer(st).load_state_dict(load_file(os.path.join(folder, opt_file), manifest))
    return load_file(os.path.join(folder, "user_content.pt"), manifest) if "user_content.pt" in files else None


def _resume_full(st: state.State, path: str, tag: str, strict: bool, load_optimizer: bool,
                 translate_function: Callable[[dict], dict] | None) -> Any:
    manifest_file = os.path.join(path, f"{tag}.manifest.json")
    # A full checkpoint written by another tool (torch.save, SMP itself) has no manifest and loads unverified.
    manifest = read_manifest(manifest_file, os.path.join(path, tag)) if os.path.exists(manifest_file) else None
    if manifest is None and not os.path.exists(os.path.join(path, tag)):
        raise CheckpointError(f"{path} holds no full checkpoint {tag!r}: neither {tag} nor {tag}.manifest.json exists")

    def listed(name: str) -> bool:
        return name in manifest["files"] if manifest is not None else os.path.exists(os.path.join(path, name))
    if listed(tag):  # mmap: each rank pages in only the tensors it keeps, not the other stages' weights
        model_sd = load_file(os.path.join(path, tag), manifest, mmap=True)
        if manifest is not None and manifest.get("plan"):
            st.model.use_saved_plan(manifest["plan"])
        st.model.load_state_dict(model_sd, strict=strict, translate_function=translate_function)
    if load_optimizer and listed(f"optimizer_{tag}"):
        _optimizer(st).load_state_dict(load_file(os.path.join(path, f"optimizer_{tag}"), manifest, mmap=True))
    uc = f"user_content_{tag}"
    return load_file(os.path.join(path, uc), manifest) if listed(uc) else None


def _optimizer(st: state.State) -> CheckpointOptimizer:
    if st.optimizer is None:
        raise CheckpointError("this checkpoint holds optimizer state: create the smp.DistributedOptimizer before "
                              "smp.resume_from_checkpoint, or pass load_optimizer=False")
    return st.optimizer
