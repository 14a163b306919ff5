"""State dicts across expert-parallel layouts: whole expert weights (and their optimizer state) gathered from the ep
ranks' experts, and a rank's experts cut back out of whole tensors.

Under expert parallelism each ep rank holds ``experts / ep`` consecutive rows of every stacked expert weight
(:mod:`partitioner.ep.expert_program`) under the model's own names, and its optimizer keeps state of the same shapes.
A *full* state dict holds whole tensors, so it loads under any expert-parallel degree (or none): gathering
concatenates the ep group's rows in rank order (a collective over the ep group: every rank of it calls the full
``state_dict()``), and loading keeps this rank's rows. A *partial* state dict holds one ep rank's experts, so it
loads only into that ep rank under that degree (:func:`check_experts` refuses any other).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from smp.checkpoint.commit import CheckpointError

__all__ = ["EP_KEY", "gather_rows", "cut_rows", "check_experts"]

EP_KEY = "_smp_ep"  # a partial state dict saved under expert parallelism: {"degree": ep, "rank": ep rank}


def gather_rows(value: Any, spec: tuple[int, int, int], group: Any) -> Any:
    """The whole tensor of which ``value`` holds rows ``spec`` = ``(start, stop, whole)``, gathered from every rank
    of the ep ``group`` (each holding as many rows); anything that is not such a slice comes back as it is."""
    start, stop, whole = spec
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != stop - start:
        return value
    pieces = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, value.detach().contiguous(), group=group)
    out = torch.cat(pieces)
    if out.shape[0] != whole:
        raise CheckpointError(f"gathering experts: the ep group's {len(pieces)} ranks hold {out.shape[0]} rows of a "
                              f"weight of {whole} experts")
    return out


def cut_rows(value: Any, spec: tuple[int, int, int]) -> Any:
    """This rank's rows ``spec`` of ``value`` when it is whole (as many rows as experts); as it is otherwise (already
    this rank's rows, or not a stacked tensor)."""
    start, stop, whole = spec
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == whole and whole != stop - start:
        return value[start:stop].clone()
    return value


def check_experts(saved: dict[str, int] | None, degree: int, rank: int, what: str) -> None:
    """Refuse a partial state dict whose experts are another ep rank's, or of another degree."""
    got = (int(saved["degree"]), int(saved["rank"])) if saved else (1, 0)
    if got != (degree, rank):
        raise CheckpointError(f"{what} holds the experts of ep rank {got[1]} of expert_parallel_degree={got[0]}, but "
                              f"this rank is ep rank {rank} of {degree}: load each rank's own partial file under the "
                              "degrees it was saved with, or save a full state_dict() to change them")
