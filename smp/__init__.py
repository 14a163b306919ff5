"""The SageMaker-model-parallel-compatible API: ``import smp`` where a script had
``import smdistributed.modelparallel.torch as smp``.

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4})
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters()))

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    loss = train_step(model, x, y).reduce_mean()
    optimizer.step()

The names below are imported on first use (PEP 562, :mod:`partitioner.lazy`): ``import smp`` and the ``smp``
command's ``--help`` do not import torch.

The package by concern (each subpackage's docstring says what it owns and what it may import; ``tests/test_layout.py``
holds them to it). At the top level, the SMP surface a user types, kept thin: ``distributed_model``,
``distributed_optimizer``, ``optimizers`` (FusedLAMB), ``ranks`` (rank helpers, groups, messages), ``placement``,
``delayed_init``, ``amp``, ``nn``, ``tensor_parallel``, ``utils``; with ``zoo`` (built-in models) and ``testing``
(``run_ranks``, N local ranks for tests and benchmarks). Below it: :mod:`smp.runtime` (what ``smp.init`` builds),
:mod:`smp.engine` (one ``@smp.step`` from call to results), :mod:`smp.checkpoint`, :mod:`smp.profiling`,
:mod:`smp.health` (training-health rules, ``smp.debug``) and
:mod:`smp.cli` (the ``smp`` command). For code written against SMP v1 that cannot be edited:
``smp.state`` (SMP's state object, read-only), ``model`` (SMP's module path of ``DistributedModel``) and
``smdistributed_alias`` (``smp.alias_smdistributed()``: ``import smdistributed.modelparallel.torch`` imports
smp). The one global state (:func:`smp.runtime.state.get`) is read where a user's call enters (``smp.rank()``,
``@smp.step``, ``smp.save_checkpoint``, ``smp.profile``, ...); the code those calls run receives what it needs as
arguments.
"""
from typing import TYPE_CHECKING

from partitioner.lazy import lazy_exports

if TYPE_CHECKING:
    from . import amp, nn, optimizers, utils
    from .checkpoint.commit import CheckpointError
    from .checkpoint.save_load import load, save
    from .checkpoint.tagged import resume_from_checkpoint, save_checkpoint
    from .delayed_init import delay_param_initialization
    from .distributed_model import DistributedModel
    from .distributed_optimizer import DistributedOptimizer
    from .engine.planning import pipeline_runner
    from .engine.step_function import StepOutput, StepTimeoutError, step
    from .health.session import TrainingHealthWarning, TrainingStopped, debug
    from .placement import partition, set_activation_checkpointing, set_partition
    from .profiling.session import annotate, profile
    from .ranks import (
        DP_GROUP,
        MP_GROUP,
        PP_GROUP,
        RDP_GROUP,
        TP_GROUP,
        WORLD,
        CommGroup,
        RankType,
        allgather,
        barrier,
        broadcast,
        dp_rank,
        dp_size,
        get_dp_group,
        get_dp_process_group,
        get_mp_group,
        get_mp_process_group,
        get_pp_group,
        get_pp_process_group,
        get_rdp_group,
        get_rdp_process_group,
        get_tp_group,
        get_tp_process_group,
        get_world_process_group,
        local_rank,
        local_size,
        mp_rank,
        mp_size,
        pp_rank,
        pp_size,
        rank,
        rdp_rank,
        rdp_size,
        recv_from,
        send,
        size,
        tp_rank,
        tp_size,
    )
    from .runtime.call_log import CollectiveError
    from .runtime.compat import NoEffectWarning
    from .runtime.config import Config, ConfigError
    from .runtime.state import init, is_initialized
    from .runtime.state_view import state
    from .smdistributed_alias import SMP_V1_VERSION, alias_smdistributed
    from .tensor_parallel import model_creation, set_tensor_parallelism, tensor_parallelism
    from .tp_registry import tp_register, tp_register_with_module

__version__ = "0.1.0"  # pyproject.toml reads it from here

__all__ = [
    "init", "is_initialized", "Config", "ConfigError", "DistributedModel", "DistributedOptimizer", "step",
    "StepOutput", "StepTimeoutError", "CollectiveError", "partition", "set_partition", "set_activation_checkpointing",
    "save", "load", "save_checkpoint", "resume_from_checkpoint", "CheckpointError", "amp",
    "rank", "size", "local_rank", "local_size", "pp_rank", "pp_size", "mp_rank", "mp_size", "dp_rank", "dp_size",
    "rdp_rank", "rdp_size", "tp_rank", "tp_size", "get_mp_group", "get_dp_group", "get_pp_group", "get_rdp_group",
    "get_tp_group", "get_pp_process_group", "get_dp_process_group", "get_mp_process_group", "get_rdp_process_group",
    "get_tp_process_group", "get_world_process_group", "barrier", "broadcast", "allgather", "send", "recv_from",
    "CommGroup", "RankType",
    "WORLD", "MP_GROUP", "PP_GROUP", "DP_GROUP", "RDP_GROUP", "TP_GROUP",
    "nn", "optimizers", "utils", "tensor_parallelism", "set_tensor_parallelism", "tp_register",
    "tp_register_with_module", "NoEffectWarning", "__version__",
    "profile", "annotate", "delay_param_initialization", "model_creation",
    "debug", "TrainingHealthWarning", "TrainingStopped", "state", "alias_smdistributed", "SMP_V1_VERSION",
    "pipeline_runner",
]

__getattr__, __dir__ = lazy_exports(__name__)
