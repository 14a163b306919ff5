"""The one piece of global state: what ``smp.init`` set up (config, rank grid, process groups, the logs of
collective calls) and the DistributedModel of this process. Everything else in the package reads it
through :func:`get`.

Every process group smp creates gets the config's ``timeout_s``, so no collective smp issues waits longer;
a failure closes them all (:meth:`State.report_failure`), so that peers blocked on this rank stop at once.
"""
from __future__ import annotations

import atexit
import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipeline.p2p import PeerError, close_groups, default_store, report_failure
from smp.runtime.call_log import CallLog, CollectiveError
from smp.runtime.config import Config, load_config
from smp.runtime.rank_env import free_port
from smp.runtime.topology import Topology
from smp.runtime.workers import Workers

__all__ = ["State", "get", "init", "is_initialized", "reset", "GROUP_KINDS"]

GROUP_KINDS = ("world", "pipeline", "data-parallel")


@dataclass
class State:
    """Everything ``smp.init`` set up in this process, and what the engine learns later (model, optimizer)."""

    config: Config
    topology: Topology
    rank: int
    mp_group: Any
    dp_group: Any
    device: torch.device
    world_group: Any = None    # all ranks, with smp's timeout (the default group may have the user's)
    calls: dict[str, CallLog] = field(default_factory=dict)  # group kind -> this rank's collective calls
    failed: BaseException | None = None  # the failure that closed smp's groups, if any
    model: Any = None          # the DistributedModel, once created
    optimizer: Any = None      # the DistributedOptimizer, once created (handed to post-partition hooks)
    in_step: Any = field(default=None, repr=False)  # the running step (smp.step), if any
    workers: Workers = field(default_factory=Workers, repr=False)  # the threads that run steps' microbatches
    tp_group: Any = None       # this rank alone (no tensor parallelism), made on first use (smp.get_tp_process_group)
    placement: dict = field(default_factory=dict)    # module -> partition, from smp.partition / set_partition
    partition_blocks: list = field(default_factory=list)  # open smp.partition(i) blocks, innermost last
    checkpointed: set = field(default_factory=set)   # modules marked by smp.set_activation_checkpointing
    messages: dict = field(default_factory=dict)     # (src, dst) -> objects sent so far (smp.send/recv_from)
    profiling: Any = None      # the profiling session (smp.profile), once a step or smp.profile needed it
    health: Any = None         # the training-health session (smp.debug, smp.health), once a step needed it

    def ranks(self, kind: str) -> list[int]:
        """Global ranks of this rank's group of ``kind`` (one of GROUP_KINDS)."""
        if kind == "pipeline":
            groups = self.topology.mp_groups()
        elif kind == "data-parallel":
            groups = self.topology.dp_groups()
        else:
            return list(range(self.topology.world))
        return next(g for g in groups if self.rank in g)

    def group(self, kind: str) -> Any:
        """The process group of ``kind``; raises if an earlier failure closed smp's groups."""
        if self.failed is not None:
            raise PeerError(f"rank {self.rank}: smp stopped after an earlier failure ({self.failed}); restart the job")
        return {"world": self.world_group, "pipeline": self.mp_group, "data-parallel": self.dp_group}[kind]

    def enter(self, kind: str, call: str) -> Any:
        """Start collective ``call`` on this rank's ``kind`` group once every peer has announced it too
        (:meth:`smp.runtime.call_log.CallLog.check`); returns the group's process group. A mismatch is a failure
        of this rank, reported so that peers waiting on it stop too."""
        pg = self.group(kind)
        try:
            self.calls[kind].check(call)
        except (CollectiveError, PeerError) as exc:
            self.report_failure(exc)
            raise
        return pg

    def report_failure(self, exc: BaseException) -> None:
        """Leave the failure note and close every group smp made (see :mod:`pipeline.p2p`)."""
        if self.failed is not None:
            return
        self.failed = exc
        groups = [self.world_group, self.mp_group, self.dp_group]
        # gloo closes a group's connections once nothing holds it; a placeholder (not None, which torch reads
        # as the default group) makes any later collective on it fail at once
        self.world_group, self.mp_group, self.dp_group = (_Closed(kind) for kind in GROUP_KINDS)
        runner = self.model.runner if self.model is not None else None
        if runner is not None:
            runner.report_failure(exc, also=groups)
        else:
            report_failure(exc, self.rank, groups, default_store())


    def close(self, default_group: bool) -> None:
        """At exit: destroy the model's pipeline groups and smp's, and the default group when ``smp.init`` made it.
        Left to the interpreter's teardown, gloo's threads were sometimes still joinable when their objects went,
        and the process aborted after a run that had finished ("terminate called without an active exception")."""
        runner = self.model.runner if self.model is not None else None
        if runner is not None:
            runner.close()
        close_groups([g for g in (self.world_group, self.mp_group, self.dp_group) if not isinstance(g, _Closed)])
        if default_group and dist.is_initialized():
            dist.destroy_process_group()


class _Closed:
    """Stands for a process group smp closed after a failure; torch refuses it at once, naming it."""

    def __init__(self, kind: str):
        self.kind = kind

    def __repr__(self) -> str:
        return f"<smp's {self.kind} group, closed after an earlier failure: restart the job>"


_state: State | None = None


def is_initialized() -> bool:
    """Has ``smp.init`` run in this process?"""
    return _state is not None


def get() -> State:
    """The state ``smp.init`` set up; an error that says to call it first when it has not run."""
    if _state is None:
        raise RuntimeError("smp is not initialised: call smp.init(config) before using smp")
    return _state


def init(config: dict | str | None = None) -> State:
    """Read the config, join the process group torchrun set up (or a world of one), build the grid and
    smp's process groups, all with the config's ``timeout_s``."""
    global _state
    cfg = load_config(config)
    if _state is not None:
        raise RuntimeError("smp.init() was already called in this process; call it once, before anything else")
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    made_default = not dist.is_initialized()
    if made_default:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
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
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    st = State(config=cfg, topology=topo, rank=dist.get_rank(), mp_group=None, dp_group=None, device=device)
    store = default_store()
    # The call logs write their keys before the groups exist: creating a group waits for every member, so
    # afterwards every peer's key can be read.
    st.calls = {kind: CallLog(kind, st.ranks(kind), st.rank, store, cfg.timeout_s) for kind in GROUP_KINDS}
    st.world_group = dist.new_group(timeout=timeout)
    st.mp_group, _ = dist.new_subgroups_by_enumeration(topo.mp_groups(), timeout=timeout)
    st.dp_group, _ = dist.new_subgroups_by_enumeration(topo.dp_groups(), timeout=timeout)
    _state = st
    atexit.register(st.close, made_default)
    return st


def reset() -> None:
    """Forget the state (tests and scripts that run several configurations in one process). Its process groups
    stay as they are; its exit handler goes, so the state is not kept alive until exit."""
    global _state
    if _state is not None:
        atexit.unregister(_state.close)
    _state = None
