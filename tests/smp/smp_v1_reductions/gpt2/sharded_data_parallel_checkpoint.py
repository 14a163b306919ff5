"""A reduction of ``sharded_data_parallel_checkpoint.py`` beside SageMaker's public SMP v1 GPT-2 script of 2022-10:
the two helpers the script calls when ``sharded_data_parallel_degree`` is above 1 (its notebook leaves it at 1), which
read ``model.module``'s buffers and parameter names and SMP's sharded optimizer's ``fp16_groups`` (not reduced: a
DeepSpeed structure this engine does not have)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

__all__ = ["get_buffer_names", "get_param_shapes"]


def get_param_shapes(model: Any, optimizer: Any) -> list[OrderedDict]:
    """Name -> shape of the parameters of each of the sharded optimizer's groups, in its order."""
    names = {param: name for name, param in model.module.named_parameters()}
    return [OrderedDict((names[p], p.shape) for p in group) for group in optimizer.fp16_groups]


def get_buffer_names(model: Any) -> list[str]:
    """The persistent buffers of ``model.module``, by name."""
    out: list[str] = []

    def walk(module: Any, prefix: str) -> None:
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                out.append(prefix + name)
        for name, child in module.named_children():
            walk(child, prefix + name + ".")

    walk(model.module, "")
    return out
