"""A reduction of ``sdp_utils.py`` beside SageMaker's public SMP v1 GPT-2 script of 2023: helpers the script calls
only with sharded data parallelism on a Hugging Face model (not SMP's distributed transformer, which its notebooks
use) or with ``--log_param_norms``; they read DeepSpeed's structures inside SMP's sharded optimizer
(``ds_tensor``, ``fp32_partitioned_groups_flat``), which this engine does not have, and are not reduced further."""
from __future__ import annotations

from typing import Any

import smdistributed.modelparallel.torch as smp
import torch

__all__ = ["build_param_id_to_offset", "build_param_id_to_buffer", "log_param_norms"]


def build_param_id_to_offset(param_groups: list[dict]) -> list[dict[int, tuple[int, int]]]:
    """Per group: parameter id -> (offset, size) of its shard in the group's flat buffer."""
    out = []
    for group in param_groups:
        offset, offsets = 0, {}
        for p in group["params"]:
            offsets[id(p)] = (offset, p.ds_tensor.ds_numel)
            offset += p.ds_tensor.ds_numel
        out.append(offsets)
    return out


def build_param_id_to_buffer(optimizer: Any, param_id_to_offset: list[dict]) -> dict[int, torch.Tensor]:
    """Parameter id -> its slice of the optimizer's flat fp32 shard."""
    return {i: optimizer.fp32_partitioned_groups_flat[g].narrow(0, off, size)
            for g, offsets in enumerate(param_id_to_offset) for i, (off, size) in offsets.items()}


def log_param_norms(model: Any, optimizer: Any, param_id_to_buffer: dict[int, torch.Tensor]) -> None:
    """Print each parameter's norm, over its sharding group."""
    for name, param in model.named_parameters():
        norm = torch.linalg.norm(param_id_to_buffer[id(param)]) ** 2
        torch.distributed.all_reduce(norm, group=optimizer.ds_param_shard_group)
        if smp.rank() == 0:
            print(f"{name}: {torch.sqrt(norm).item()}")
