"""Manual partitioning, as SMP v1 offers it: ``smp.partition(i)`` blocks and ``smp.set_partition`` place
modules on pipeline stages (with ``auto_partition`` off, ``default_partition`` takes the rest), and
``smp.set_activation_checkpointing`` marks modules whose stages recompute activations in backward.
:func:`manual_stages` turns the placement into a stage per traced op for :func:`partitioner.cut.portfolio.fixed_plan`.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch

from smp.runtime import state
from smp.runtime.compat import warn_no_effect

__all__ = ["partition", "set_partition", "set_activation_checkpointing", "manual_stages"]


@contextmanager
def partition(index: int) -> Iterator[None]:
    """Modules assigned to a parent inside this block go to pipeline stage ``index`` (manual placement)."""
    st = state.get()
    _check_index(index, st.config.pipeline_parallel_degree)

    block = object()

    def hook(parent: torch.nn.Module, name: str, sub: torch.nn.Module | None) -> None:
        # Every open block's hook sees the registration; the innermost block places the module.
        if sub is not None and st.partition_blocks[-1] is block:
            st.placement.setdefault(sub, index)

    st.partition_blocks.append(block)
    handle = torch.nn.modules.module.register_module_module_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()
        st.partition_blocks.remove(block)


def set_partition(module: torch.nn.Module, index: int) -> None:
    """Place ``module`` on pipeline stage ``index`` (SMP v1's manual partitioning, with ``auto_partition`` off)."""
    st = state.get()
    _check_index(index, st.config.pipeline_parallel_degree)
    st.placement[module] = index


def set_activation_checkpointing(module: torch.nn.Module, preserve_rng_state: bool = True,
                                 pack_args_as_tuple: bool = False, strategy: str = "each") -> None:
    """Recompute the activations of the stage(s) holding ``module`` in backward instead of keeping them.

    SMP v1's keywords are accepted. Recomputation here is per pipeline stage and always replays the forward's
    random numbers, and the engine traces whatever arguments a module takes: so ``preserve_rng_state=False``,
    ``pack_args_as_tuple=True`` and a ``strategy`` other than ``"each"`` (``"contiguous"``, ``"group_N"``: how
    SMP grouped an ``nn.Sequential``'s children into segments) change nothing, and say so."""
    if strategy not in ("each", "contiguous") and not re.fullmatch(r"group_[1-9][0-9]*", str(strategy)):
        raise ValueError(f"set_activation_checkpointing(strategy={strategy!r}): use 'each', 'contiguous' or "
                         "'group_N' (N a positive integer), as SMP v1")
    if strategy != "each" and not isinstance(module, torch.nn.Sequential):
        raise ValueError(f"set_activation_checkpointing(strategy={strategy!r}) applies to an nn.Sequential, as in "
                         f"SMP v1; {type(module).__name__} is not one")
    for name, value, default in (("preserve_rng_state", preserve_rng_state, True),
                                 ("pack_args_as_tuple", pack_args_as_tuple, False), ("strategy", strategy, "each")):
        if value != default:
            warn_no_effect(f"set_activation_checkpointing({name}={value!r})", "recomputation here is per pipeline "
                           "stage, replays the forward's random numbers and traces any arguments", 3)
    state.get().checkpointed.add(module)


def _check_index(index: int, pp: int) -> None:
    if not isinstance(index, int) or not 0 <= index < pp:
        raise ValueError(f"partition index {index!r} is out of range: use 0 .. {pp - 1} "
                         f"(pipeline_parallel_degree={pp})")


def manual_stages(module: torch.nn.Module, graph: Any) -> np.ndarray:
    """The stage of every op of ``graph`` (traced from ``module``) under manual placement: each op goes where
    its innermost placed module is; an op of no placed module goes to ``default_partition``, or to its latest
    producer's partition when that comes later (so glue code in an unplaced parent, e.g. the root module's
    forward, never sends a tensor backwards)."""
    st = state.get()
    placed = {name: st.placement[m] for name, m in module.named_modules() if m in st.placement}
    stage = np.full(graph.num_nodes, -1, np.int64)
    for i, path in enumerate(graph.modules):
        parts = path.split(".") if path else []
        for cut in range(len(parts), -1, -1):
            prefix = ".".join(parts[:cut])
            if prefix in placed:
                stage[i] = placed[prefix]
                break
    order = np.argsort(graph.dst, kind="stable")
    src, starts = graph.src[order], np.searchsorted(graph.dst[order], np.arange(graph.num_nodes + 1))
    default = st.config.default_partition or 0
    for i in range(graph.num_nodes):  # index order is topological: producers are settled first
        if stage[i] < 0:
            preds = src[starts[i]:starts[i + 1]]
            stage[i] = max(default, int(stage[preds].max())) if len(preds) else default
    stage[[i for i, k in enumerate(graph.kinds) if k == "output"]] = st.config.pipeline_parallel_degree - 1
    return stage
