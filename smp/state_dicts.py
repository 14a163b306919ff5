"""Helpers for the state dicts of a partitioned model and its optimizer: CPU copies to gather or save them,
and the error that names the keys a rank holds when a load does not match them."""
from __future__ import annotations

from typing import Any

import torch

from . import state

__all__ = ["on_cpu", "key_error"]


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


def key_error(missing: list[str], unexpected: list[str]) -> str:
    """The message of a strict ``DistributedModel.load_state_dict`` whose keys do not match this rank's."""
    st = state.get()
    where = f"rank {st.rank} (pp_rank {st.topology.pp_rank(st.rank)})"
    parts = [f"{len(missing)} key(s) that {where} holds are missing: {_some(missing)}"] if missing else []
    if unexpected:
        parts.append(f"{len(unexpected)} key(s) do not belong to {where}: {_some(unexpected)}")
    return ("DistributedModel.load_state_dict: " + "; ".join(parts) + ". Was the model's code changed (a renamed "
            "attribute), or the state saved from another model or pipeline rank? Pass strict=False to load the "
            "matching keys and get the others back as missing_keys / unexpected_keys")


def _some(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return f"[{shown}{', ...' if len(keys) > limit else ''}]"
