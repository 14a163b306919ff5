"""Stepping a torch optimizer without a temporary the size of a whole parameter group.

torch's foreach implementations (its default on CUDA) update a list of tensors at once, so their intermediates
take "~ sizeof(params) more peak memory than the for-loop version" (``torch.optim.Adam``'s documentation, on
``foreach``); the for-loop implementation (its default on CPU) makes them one parameter at a time, two of that
parameter's size for Adam's denominator. :func:`step_in_chunks` steps the optimizer once per chunk of at most
:data:`CHUNK_BYTES` of one group's parameters, with the foreach implementation: the intermediates are one chunk,
or one parameter when a parameter is larger than a chunk (an embedding), half the for-loop's.

It is exact. A foreach update of part of a group computes, per tensor, what the update of the whole group
computes; every optimizer of :data:`PER_PARAMETER` updates each parameter from its own gradient and state only;
and those of :data:`FOREACH_EQUALS_LOOP` compute the same bits with either implementation
(``tests/smp/test_optimizer_step.py`` checks every one against its own ``step``), so only they are switched to
foreach. Left as they are, in one ``step`` call: a closure (it evaluates the whole model), a group with
``fused=True`` (no intermediates at all: the way to avoid even one parameter's), ``foreach=False`` (the user's
choice), ``differentiable=True`` or parameters that are not plain tensors (DTensor shards), any other optimizer
class (LAMB's trust ratio or a global clip may read every parameter), and an optimizer whose groups each fit in
one chunk. Step hooks registered on the wrapped optimizer run once per ``step`` call, so once per chunk.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["step_in_chunks", "chunks", "CHUNK_BYTES", "PER_PARAMETER", "FOREACH_EQUALS_LOOP"]

CHUNK_BYTES = 32 << 20  # small beside any stage worth a pipeline, large enough for foreach kernels to pay off

FOREACH_EQUALS_LOOP: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.Adamax, torch.optim.RMSprop, torch.optim.Rprop)
PER_PARAMETER: tuple[type[torch.optim.Optimizer], ...] = FOREACH_EQUALS_LOOP + (
    torch.optim.ASGD, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adafactor)

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def step_in_chunks(optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None,
                   chunk_bytes: int = CHUNK_BYTES) -> Any:
    """``optimizer.step(closure)``, with the same parameters and state after it, but each chunkable group
    stepped in chunks of at most ``chunk_bytes`` of parameters with gradients (see the module docstring);
    returns what ``step`` returns (the closure's loss, else None)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive number of bytes, got {chunk_bytes!r}")
    plan = [(group, chunks(group["params"], chunk_bytes) if _chunkable(optimizer, group) else None)
            for group in optimizer.param_groups]
    if closure is not None or all(parts is None or len(parts) <= 1 for _, parts in plan):
        return optimizer.step(closure)
    for group, parts in plan:
        # A chunkable group runs foreach: it asked to, or its class computes the same bits either way.
        runs, foreach = (parts, True) if parts is not None else ([group["params"]], group.get("foreach"))
        for part in runs:
            with _only(optimizer, group, part, foreach):
                optimizer.step()
    return None


def chunks(params: list[torch.Tensor], chunk_bytes: int) -> list[list[torch.Tensor]]:
    """``params`` in order, cut into runs whose gradients hold at most ``chunk_bytes`` (a larger parameter
    alone); parameters without a gradient, which an optimizer skips, count nothing."""
    out: list[list[torch.Tensor]] = [[]]
    held = 0
    for p in params:
        size = p.numel() * p.element_size() if p.grad is not None else 0
        if out[-1] and held + size > chunk_bytes:
            out.append([])
            held = 0
        out[-1].append(p)
        held += size
    return out


def _chunkable(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether chunks of ``group`` step exactly as the group does, with the foreach implementation."""
    kind = type(optimizer)
    if kind not in PER_PARAMETER or group.get("fused") or group.get("differentiable"):
        return False
    if group.get("foreach") is False or (group.get("foreach") is None and kind not in FOREACH_EQUALS_LOOP):
        return False
    return all(type(p) in _PLAIN for p in group["params"])


@contextmanager
def _only(optimizer: torch.optim.Optimizer, group: dict[str, Any], params: list[torch.Tensor],
          foreach: bool | None) -> Iterator[None]:
    """``optimizer`` sees ``group`` alone, holding ``params``, with ``foreach``; all three restored after, so
    the group's other keys (and anything the step writes into them) stay the group's own."""
    groups, whole, before = optimizer.param_groups, group["params"], group.get("foreach")
    optimizer.param_groups = [group]
    group["params"], group["foreach"] = params, foreach
    try:
        yield
    finally:
        group["params"], group["foreach"] = whole, before
        optimizer.param_groups = groups
