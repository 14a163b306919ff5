"""The state dicts of a partitioned model and its optimizer: the keys that mark them, what a checkpoint needs of
the model and the optimizer (:class:`CheckpointModel`, :class:`CheckpointOptimizer`, protocols that
``smp.DistributedModel`` and ``smp.DistributedOptimizer`` satisfy, so that checkpointing never imports them),
CPU copies to gather or save them, and the error that names the keys a rank holds when a load does not match.

The marker keys live here and nowhere else: :data:`PARTIAL_KEY` (SMP v1's ``_smp_is_partial``: True on this rank's
part of a model, False on a full dict already under this engine's keys; :func:`unmarked` reads it, and
:data:`OLD_PARTIAL_KEY`, which this engine wrote before),
:data:`PLAN_KEY` (the partition that part was cut by, as plan JSON), :data:`ZERO_KEY` (optimizer state of one
data-parallel shard, ZeRO-1), :data:`SHARD_KEY` (the parameters of that shard), :data:`TP_KEY` (the
tensor-parallel degree and tp rank whose shards a partial dict holds, :mod:`~smp.checkpoint.tp_state`) and
:data:`SDP_KEY` (the sharded-data-parallel layout whose shards a partial dict holds, :mod:`~smp.checkpoint.sdp_state`)
and :data:`SCALER_KEY` (an optimizer's fp16 loss scaler: its scale and schedule, which a resumed run continues).
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch

__all__ = ["on_cpu", "key_error", "unmarked", "to_hf_keys", "PARTIAL_KEY",
           "OLD_PARTIAL_KEY", "PLAN_KEY", "ZERO_KEY", "SHARD_KEY", "TP_KEY", "SDP_KEY", "SCALER_KEY",
           "CheckpointModel", "CheckpointOptimizer"]

PARTIAL_KEY = "_smp_is_partial"
OLD_PARTIAL_KEY = "_smp_partial"  # this engine's marker before it took SMP's; still read
_SMP_LOAD_INFO = "_smp_load_info"  # SMP v1's partial dicts carry its layout here; this engine reads its own markers
PLAN_KEY = "_smp_plan"
ZERO_KEY = "_smp_zero"
SHARD_KEY = "_smp_shard"
TP_KEY = "_smp_tp"
SDP_KEY = "_smp_sdp"
SCALER_KEY = "_smp_loss_scaler"


@runtime_checkable
class CheckpointModel(Protocol):
    """What saving and resuming a checkpoint needs of the model (``smp.DistributedModel``)."""

    partitioned: bool

    def state_dict(self) -> dict[str, Any]:
        """The full model, gathered from the ranks that hold it."""

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's part, marked with :data:`PARTIAL_KEY` and, once partitioned, :data:`PLAN_KEY`."""

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True,
                        translate_function: Callable[[dict], dict] | None = None) -> Any:
        """Load a full or partial state dict (applied after partitioning when loaded before); an unmarked full dict
        goes through ``translate_function`` (:func:`unmarked`)."""

    def partition_plan(self) -> Any:
        """The :class:`~partitioner.PartitionPlan` the model is partitioned by (None before partitioning)."""

    def use_saved_plan(self, plan_json: str) -> None:
        """Partition as the saved run did, when the layout allows it."""


@runtime_checkable
class CheckpointOptimizer(Protocol):
    """What saving and resuming a checkpoint needs of the optimizer (``smp.DistributedOptimizer``)."""

    @property
    def state_sharded(self) -> bool:
        """Is this rank's optimizer state one data-parallel shard (``shard_optimizer_state``)?"""

    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state (gathered when sharded)."""

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load full or local optimizer state."""


def unmarked(state_dict: dict[str, Any], translate_function: Callable[[dict], dict] | None = None,
             translators: list | tuple = ()) -> tuple[dict[str, Any], bool]:
    """A copy of a model state dict without its partial markers, and whether they marked it as one rank's part.

    Reads :data:`PARTIAL_KEY` (SMP v1's ``_smp_is_partial``) and :data:`OLD_PARTIAL_KEY`, and drops SMP's
    ``_smp_load_info``. As in SMP v1, a full dict that carries no marker may hold Hugging Face's keys: it goes through
    ``translate_function`` when given, else through the ``hf_to_smp`` of every ``(smp_to_hf, hf_to_smp)`` pair in
    ``translators`` (``smp.state.module_manager.translate_functions``: none without tensor parallelism). A full dict
    marked ``_smp_is_partial: False`` (Hugging Face's ``Trainer`` marks one so) is under this model's keys already."""
    out = dict(state_dict)
    found = [bool(out.pop(k)) for k in (PARTIAL_KEY, OLD_PARTIAL_KEY) if k in out]
    out.pop(_SMP_LOAD_INFO, None)
    if not found:
        for translate in [translate_function] if translate_function is not None else [hf for _, hf in translators]:
            out = translate(out)
    return out, any(found)


def to_hf_keys(state_dict: dict[str, Any], translators: list) -> dict[str, Any]:
    """A full state dict under Hugging Face's keys, through the ``smp_to_hf`` of every pair in ``translators``."""
    for translate, _ in translators:
        state_dict = translate(state_dict)
    return state_dict


def on_cpu(value: Any, _copies: dict[int, torch.Tensor] | None = None) -> Any:
    """``value`` with every tensor (inside dicts, lists and tuples) copied to the CPU, one copy per tensor, so
    that keys sharing a tensor (tied weights) still share one after pickling, as ``torch.save`` keeps them."""
    copies = {} if _copies is None else _copies
    if isinstance(value, torch.Tensor):
        if id(value) not in copies:
            copies[id(value)] = value.detach().cpu()
        return copies[id(value)]
    if isinstance(value, dict):
        return {k: on_cpu(v, copies) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_cpu(v, copies) for v in value)
    return value


def key_error(missing: list[str], unexpected: list[str], rank: int, pp_rank: int) -> str:
    """The message of a strict ``DistributedModel.load_state_dict`` whose keys do not match those of global
    rank ``rank`` (``pp_rank`` in its pipeline)."""
    where = f"rank {rank} (pp_rank {pp_rank})"
    parts = [f"{len(missing)} key(s) that {where} holds are missing: {_some(missing)}"] if missing else []
    if unexpected:
        parts.append(f"{len(unexpected)} key(s) do not belong to {where}: {_some(unexpected)}")
    return ("DistributedModel.load_state_dict: " + "; ".join(parts) + ". Was the model's code changed (a renamed "
            "attribute), or the state saved from another model or pipeline rank? Pass strict=False to load the "
            "matching keys and get the others back as missing_keys / unexpected_keys")


def _some(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return f"[{shown}{', ...' if len(keys) > limit else ''}]"
