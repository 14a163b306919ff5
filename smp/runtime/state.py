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
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipeline.p2p import PeerError, close_groups, default_store, report_failure
from smp.runtime import sagemaker_env
from smp.runtime.call_log import CallLog, CollectiveError
from smp.runtime.config import Config, load_config
from smp.runtime.rank_env import free_port
from smp.runtime.topology import Topology
from smp.runtime.workers import Workers

__all__ = ["State", "get", "init", "is_initialized", "reset", "GROUP_KINDS"]

GROUP_KINDS = ("world", "pipeline", "data-parallel", "model-parallel", "tensor-parallel", "reduced-data-parallel")
# The grid axes (smp.runtime.topology) along which each kind of group varies: SMP's WORLD, PP_GROUP, DP_GROUP,
# MP_GROUP, TP_GROUP and RDP_GROUP.
GROUP_AXES = {"world": "DPT", "pipeline": "P", "data-parallel": "DT", "model-parallel": "PT", "tensor-parallel": "T",
              "reduced-data-parallel": "D"}
_DERIVED = ("model-parallel", "tensor-parallel", "reduced-data-parallel")  # may be the same groups as another kind
_FIELDS = {"model-parallel": "model_group", "tensor-parallel": "tp_group", "reduced-data-parallel": "rdp_group"}


def group_aliases(topology: Topology) -> dict[str, str]:
    """Kinds of group whose groups are exactly those of an earlier kind (not the world), which they share: with
    tp = 1 the model-parallel group is the pipeline and the reduced-data-parallel group the data-parallel one;
    with pp = 1 the tensor-parallel group is the model-parallel one."""
    out: dict[str, str] = {}
    kinds = ("pipeline", "data-parallel", *_DERIVED)
    groups = {kind: topology.groups(GROUP_AXES[kind]) for kind in kinds}
    for i, kind in enumerate(kinds[2:], start=2):
        same = next((k for k in kinds[:i] if k not in out and groups[k] == groups[kind]), None)
        if same is not None:
            out[kind] = same
    return out


@dataclass
class State:
    """Everything ``smp.init`` set up in this process, and what the engine learns later (model, optimizer)."""

    config: Config
    topology: Topology
    rank: int
    mp_group: Any              # this rank's pipeline (SMP's PP_GROUP; its MP_GROUP too when tp = 1)
    dp_group: Any              # this rank's stage in every replica and tp rank (SMP's DP_GROUP)
    device: torch.device
    world_group: Any = None    # all ranks, with smp's timeout (the default group may have the user's)
    calls: dict[str, CallLog] = field(default_factory=dict)  # group kind -> this rank's collective calls
    failed: BaseException | None = None  # the failure that closed smp's groups, if any
    model: Any = None          # the DistributedModel, once created
    optimizer: Any = None      # the DistributedOptimizer, once created (handed to post-partition hooks)
    in_step: Any = field(default=None, repr=False)  # the running step (smp.step), if any
    workers: Workers = field(default_factory=Workers, repr=False)  # the threads that run steps' microbatches
    tp_group: Any = None       # SMP's TP_GROUP; a group of one (tp = 1) is made on first use (smp.get_tp_process_group)
    rdp_group: Any = None      # SMP's RDP_GROUP (the data-parallel group when tp = 1)
    model_group: Any = None    # SMP's MP_GROUP: pp x tp ranks holding one replica (the pipeline when tp = 1)
    aliases: dict[str, str] = field(default_factory=dict)  # kind -> an earlier kind with the very same groups
    placement: dict = field(default_factory=dict)    # module -> partition, from smp.partition / set_partition
    partition_blocks: list = field(default_factory=list)  # open smp.partition(i) blocks, innermost last
    checkpointed: set = field(default_factory=set)   # modules marked by smp.set_activation_checkpointing
    tp_marks: Any = field(default_factory=weakref.WeakKeyDictionary)  # module -> TPMark (smp.tensor_parallelism)
    tp_context: list = field(default_factory=list)  # open smp.tensor_parallelism() contexts' marks, innermost last
    messages: dict = field(default_factory=dict)     # (src, dst) -> objects sent so far (smp.send/recv_from)
    profiling: Any = None      # the profiling session (smp.profile), once a step or smp.profile needed it
    health: Any = None         # the training-health session (smp.debug, smp.health), once a step needed it
    # SMP's module_manager.translate_functions: (smp_to_hf, hf_to_smp) state-dict key translators, one pair per
    # kind of distributed module substituted (tensor parallelism appends them); full checkpoints pass through them.
    translate_functions: list = field(default_factory=list)
    # Sharded data parallelism (sharded_data_parallel_degree > 1): the DeviceMesh of this rank's replicas, (replica
    # rows x) sharding group, and its process groups (smp.runtime.topology.Topology.sdp_grid).
    sdp_mesh: Any = None
    sdp_groups: tuple = ()
    # Expert parallelism (expert_parallel_degree > 1): this rank's ep group (its stage's replicas that split the
    # experts), the ranks holding the same experts (which average their gradients), and this rank's place in each.
    ep_group: Any = None
    edp_group: Any = None
    ep_ranks: tuple = ()
    edp_ranks: tuple = ()
    # Context parallelism (context_parallel_degree > 1): this rank's cp group (its stage's replicas that split each
    # sequence of the batch they share) and its ranks.
    cp_group: Any = None
    cp_ranks: tuple = ()

    def __post_init__(self) -> None:
        if not self.aliases:
            self.aliases = group_aliases(self.topology)

    def ranks(self, kind: str) -> list[int]:
        """Global ranks of this rank's group of ``kind`` (one of GROUP_KINDS), in ascending order: the pipeline in
        stage order, the others in the order of the ranks SMP numbers them by (``tp_rank``, ``dp_rank``, ...)."""
        if kind not in GROUP_AXES:
            raise ValueError(f"unknown group kind {kind!r}; one of {GROUP_KINDS}")
        return self.topology.group_of(self.rank, GROUP_AXES[kind])

    def group(self, kind: str) -> Any:
        """The process group of ``kind``; raises if an earlier failure closed smp's groups. A tensor-parallel
        group of this rank alone (tp = 1) is made on first use, by this rank only."""
        if self.failed is not None:
            raise PeerError(f"rank {self.rank}: smp stopped after an earlier failure ({self.failed}); restart the job")
        kind = self.aliases.get(kind, kind)
        pg = self._groups()[kind]
        if pg is None and kind in _DERIVED and len(self.ranks(kind)) == 1:
            pg = dist.new_group([self.rank], timeout=datetime.timedelta(seconds=self.config.timeout_s),
                                use_local_synchronization=True)
            setattr(self, _FIELDS[kind], pg)
        return pg

    def ep_coordinates(self) -> tuple[int, int]:
        """(expert-parallel degree, this rank's index in its ep group): (1, 0) without expert parallelism."""
        return (len(self.ep_ranks), self.ep_ranks.index(self.rank)) if self.ep_ranks else (1, 0)

    def cp_coordinates(self) -> tuple[int, int]:
        """(context-parallel degree, this rank's index in its cp group): (1, 0) without context parallelism."""
        return (len(self.cp_ranks), self.cp_ranks.index(self.rank)) if self.cp_ranks else (1, 0)

    def _groups(self) -> dict[str, Any]:
        return {"world": self.world_group, "pipeline": self.mp_group, "data-parallel": self.dp_group,
                "model-parallel": self.model_group, "tensor-parallel": self.tp_group,
                "reduced-data-parallel": self.rdp_group}

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
        groups = _distinct(self._groups().values())
        # gloo closes a group's connections once nothing holds it; a placeholder (not None, which torch reads
        # as the default group) makes any later collective on it fail at once
        self.world_group, self.mp_group, self.dp_group = (_Closed(kind) for kind in GROUP_KINDS[:3])
        self.model_group, self.tp_group, self.rdp_group = (_Closed(kind) for kind in GROUP_KINDS[3:])
        groups += [g for g in self.sdp_groups if not any(g is o for o in groups)]
        self.sdp_groups = ()
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
        close_groups([g for g in _distinct([*self._groups().values(), *self.sdp_groups]) if not isinstance(g, _Closed)])
        if default_group and dist.is_initialized():
            dist.destroy_process_group()


def _distinct(groups: Any) -> list[Any]:
    """The process groups made so far, each once (kinds with the same ranks share one)."""
    out: list[Any] = []
    for g in groups:
        if g is not None and not any(g is o for o in out):
            out.append(g)
    return out


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
    smp's process groups, all with the config's ``timeout_s``. In a SageMaker job (``SM_HP_MP_PARAMETERS`` set) the
    config may be left out, and a second call is ignored with a warning, as in SMP v1
    (:mod:`smp.runtime.sagemaker_env`); elsewhere a second call is an error."""
    global _state
    if _state is not None and sagemaker_env.in_sagemaker_job():
        warnings.warn("smp.init() was already called in this process: this call is ignored, as SMP v1 ignores it in "
                      f"a SageMaker job ({sagemaker_env.MP_PARAMETERS_ENV} is set)", UserWarning, stacklevel=2)
        return _state
    cfg = load_config(config)
    if _state is not None:
        raise RuntimeError("smp.init() was already called in this process; call it once, before anything else")
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    sagemaker_env.check_processes_per_host(int(local_world) if local_world else None)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    made_default = not dist.is_initialized()
    if made_default:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            n = cfg.pipeline_parallel_degree * cfg.tensor_parallel_degree
            if n > 1:
                raise RuntimeError(f"{_degrees(cfg.pipeline_parallel_degree, cfg.tensor_parallel_degree)} needs {n} "
                                   f"processes: launch with `smp launch -n {n} script.py`")
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                    world_size=1, timeout=timeout)
    world = dist.get_world_size()
    topo = Topology(world, cfg.pipeline_parallel_degree, cfg.tensor_parallel_degree, cfg.placement_strategy)
    if topo.dp > 1 and not cfg.ddp:
        raise RuntimeError(f"{world} processes with {_degrees(topo.pp, topo.tp)} make {topo.rdp} data-parallel "
                           f"replicas: set 'ddp': True in the smp config, or launch {topo.mp} processes")
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
    st.calls = {kind: CallLog(kind, st.ranks(kind), st.rank, store, cfg.timeout_s)
                for kind in GROUP_KINDS if kind not in st.aliases}
    st.calls.update({kind: st.calls[same] for kind, same in st.aliases.items()})
    st.world_group = dist.new_group(timeout=timeout)
    st.mp_group, _ = dist.new_subgroups_by_enumeration(topo.pipelines(), timeout=timeout)
    st.dp_group, _ = dist.new_subgroups_by_enumeration(topo.dp_groups(), timeout=timeout)
    for kind in _DERIVED:  # in this order on every rank; groups of one rank are made on first use (State.group)
        if kind in st.aliases:
            setattr(st, _FIELDS[kind], st.group(st.aliases[kind]))
        elif len(st.ranks(kind)) > 1:
            pg, _ = dist.new_subgroups_by_enumeration(topo.groups(GROUP_AXES[kind]), timeout=timeout)
            setattr(st, _FIELDS[kind], pg)
    if cfg.sharded_data_parallel_degree > 1:
        st.sdp_mesh, st.sdp_groups = _sdp_mesh(topo, cfg.sharded_data_parallel_degree, st.rank, timeout, device)
    if cfg.expert_parallel_degree > 1:
        grids = topo.ep_grid(cfg.expert_parallel_degree)
        columns = [[row[i] for row in grid] for grid in grids for i in range(cfg.expert_parallel_degree)]
        st.ep_group, _ = dist.new_subgroups_by_enumeration([row for grid in grids for row in grid], timeout=timeout)
        st.edp_group, _ = dist.new_subgroups_by_enumeration(columns, timeout=timeout)
        st.ep_ranks = tuple(next(r for grid in grids for r in grid if st.rank in r))
        st.edp_ranks = tuple(next(c for c in columns if st.rank in c))
    if cfg.context_parallel_degree > 1:
        rows = [row for grid in topo.cp_grid(cfg.context_parallel_degree) for row in grid]
        st.cp_group, _ = dist.new_subgroups_by_enumeration(rows, timeout=timeout)
        st.cp_ranks = tuple(next(row for row in rows if st.rank in row))
    _state = st
    atexit.register(st.close, made_default)
    return st


def _sdp_mesh(topo: Topology, sdp: int, rank: int, timeout: datetime.timedelta,
              device: torch.device) -> tuple[Any, tuple]:
    """This rank's sharded-data-parallel DeviceMesh (1-D over its sharding group, or 2-D replica rows x sharding
    group when ``sdp`` < rdp) made from groups every rank creates in the same order, and those groups."""
    from torch.distributed.device_mesh import DeviceMesh

    grids = topo.sdp_grid(sdp)
    shard, _ = dist.new_subgroups_by_enumeration([row for grid in grids for row in grid], timeout=timeout)
    mine = next(grid for grid in grids if any(rank in row for row in grid))
    if len(mine) == 1:
        return DeviceMesh.from_group(shard, device.type, mesh_dim_names=("shard",)), (shard,)
    columns = [[row[i] for row in grid] for grid in grids for i in range(sdp)]
    replicas, _ = dist.new_subgroups_by_enumeration(columns, timeout=timeout)
    mesh = DeviceMesh.from_group([replicas, shard], device.type, mesh=torch.tensor(mine),
                                 mesh_dim_names=("replicate", "shard"))
    return mesh, (shard, replicas)


def _degrees(pp: int, tp: int) -> str:
    """How init's errors name the degrees that make one model replica."""
    return f"pipeline_parallel_degree={pp} x tensor_parallel_degree={tp}"


def shutdown() -> None:
    """Close the state now, as its exit handler would at exit, and forget it: for a process that ends without
    running exit handlers (a rank forked by :func:`smp.testing.run_ranks` leaves through ``os._exit``)."""
    global _state
    if _state is not None:
        atexit.unregister(_state.close)
        st, _state = _state, None
        st.close(False)  # the default group is the caller's to destroy


def reset() -> None:
    """Forget the state (tests and scripts that run several configurations in one process). Its process groups
    stay as they are; its exit handler goes, so the state is not kept alive until exit."""
    global _state
    if _state is not None:
        atexit.unregister(_state.close)
    _state = None
