"""The one piece of global state: what ``smp.init`` set up (config, rank grid, process groups) and the
DistributedModel of this process. Everything else in the package reads it through :func:`get`."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .config import Config, load_config
from .spawn import free_port
from .topology import Topology

__all__ = ["State", "get", "init", "is_initialized", "reset"]


@dataclass
class State:
    config: Config
    topology: Topology
    rank: int
    mp_group: Any
    dp_group: Any
    device: torch.device
    model: Any = None          # the DistributedModel, once created
    optimizer: Any = None      # the DistributedOptimizer, once created (handed to post-partition hooks)
    in_step: Any = field(default=None, repr=False)  # the running step (smp.step), if any
    placement: dict = field(default_factory=dict)    # module -> partition, from smp.partition / set_partition
    partition_blocks: list = field(default_factory=list)  # open smp.partition(i) blocks, innermost last
    checkpointed: set = field(default_factory=set)   # modules marked by smp.set_activation_checkpointing
    profiling: Any = None      # the profiling session (smp.profile), once a step or smp.profile needed it


_state: State | None = None


def is_initialized() -> bool:
    return _state is not None


def get() -> State:
    if _state is None:
        raise RuntimeError("smp is not initialised: call smp.init(config) before using smp")
    return _state


def init(config: dict | str | None = None) -> State:
    """Read the config, join the process group torchrun set up (or a world of one), build the grid."""
    global _state
    cfg = load_config(config)
    if _state is not None:
        raise RuntimeError("smp.init() was already called in this process; call it once, before anything else")
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        timeout = datetime.timedelta(seconds=float(os.environ.get("SMP_TIMEOUT_S", "300")))
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            if cfg.pipeline_parallel_degree > 1:
                raise RuntimeError(f"pipeline_parallel_degree={cfg.pipeline_parallel_degree} needs that many "
                                   f"processes: launch with `smp launch -n {cfg.pipeline_parallel_degree} script.py`")
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                    world_size=1, timeout=timeout)
    world = dist.get_world_size()
    topo = Topology(world, cfg.pipeline_parallel_degree, cfg.placement_strategy)
    if topo.dp > 1 and not cfg.ddp:
        raise RuntimeError(f"{world} processes with pipeline_parallel_degree={topo.pp} make {topo.dp} data-parallel "
                           "replicas: set 'ddp': True in the smp config, or launch "
                           f"{topo.pp} processes")
    mp_group, _ = dist.new_subgroups_by_enumeration(topo.mp_groups())
    dp_group, _ = dist.new_subgroups_by_enumeration(topo.dp_groups())
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    _state = State(config=cfg, topology=topo, rank=dist.get_rank(), mp_group=mp_group, dp_group=dp_group,
                   device=device)
    return _state


def reset() -> None:
    """Forget the state (tests and scripts that run several configurations in one process)."""
    global _state
    _state = None
