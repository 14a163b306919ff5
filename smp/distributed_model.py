"""``smp.DistributedModel``: a torch module whose forward and backward run as a pipeline.

The model is partitioned at the first ``@smp.step`` call, traced with that step's first microbatch:
automatically through :func:`partitioner.partition` (honouring ``memory_weight``/``optimize``; with
``trace_execution_times``, op times measured on rank 0: :mod:`partitioner.cost.op_times`), or by hand
(``smp.partition(i)`` contexts, ``smp.set_partition``, ``auto_partition=False`` + ``default_partition``). Each rank
then keeps its stage of a :class:`pipeline.PipelineRunner`. The stages hold the user's own parameter tensors, so
optimizers built over ``model.parameters()`` and ``state_dict`` keys work unchanged.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from contextlib import nullcontext
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from partitioner import PartitionOptions, PartitionPlan, trace
from partitioner.cut.plan import PlanMismatchError
from partitioner.cut.portfolio import fixed_plan
from pipeline import PipelineRunner
from pipeline.grad_buckets import DEFAULT_BUCKET_CAP_MB
from pipeline.p2p import named_failures
from smp.checkpoint.commit import CheckpointError
from smp.checkpoint.expert_state import EP_KEY, check_experts, cut_rows, gather_rows
from smp.checkpoint.sdp_state import check_shards, load_into, local_shards, marker, whole_values
from smp.checkpoint.state_dicts import PARTIAL_KEY, PLAN_KEY, SDP_KEY, TP_KEY, key_error, on_cpu, unmarked
from smp.checkpoint.tp_state import TPLayout, check_partial, cut_model_state, whole_model_state
from smp.engine import mixed_precision as precision
from smp.engine import step_run
from smp.engine.grad_averaging import GradAveraging
from smp.engine.materialize import tensor_ids
from smp.engine.planning import RankProgram, bind_to, own_tensors, plan_ranks, rank_graph, shared_plan, smp_runner
from smp.engine.tp_shards import expert_specs, shard_specs
from smp.engine.weights import load_local, weight_cuts
from smp.model_hooks import ModelHooks
from smp.module_view import module_view
from smp.placement import manual_stages
from smp.runtime import state
from smp.runtime.compat import accept_no_effect
from smp.tensor_parallel import distribute

__all__ = ["DistributedModel"]


class DistributedModel(ModelHooks, torch.nn.Module):
    """SMP v1's ``smp.DistributedModel``: wraps the whole model; partitioned into pipeline stages on the first
    ``@smp.step`` call, after which this rank holds and trains only its own stages' parameters."""
    # SMP v1 arguments that tune its own gradient reduction or profiling; here they change nothing.
    _SMP_IGNORED = {"backward_passes_per_step", "gradient_as_bucket_view", "broadcast_buffers",
                    "find_unused_parameters", "trace_memory_usage"}

    def __init__(self, module: torch.nn.Module, trace_device: str = "cpu", trace_execution_times: bool = False,
                 average_grads_across_microbatches: bool = True, overlapping_allreduce: bool = True,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, **kwargs: Any):
        st = state.get()
        if st.model is not None:
            raise RuntimeError("a DistributedModel already exists in this process: wrap the whole model once "
                               "(SMP supports one DistributedModel per process)")
        accept_no_effect(kwargs, self._SMP_IGNORED, "DistributedModel",
                         "this engine reduces gradients itself and prices memory from the trace", 3)
        super().__init__()
        # SMP's substitution of the modules marked for tensor parallelism, and what tensor parallelism may split;
        # 16-bit weights kept in fp32 under fp16/bf16; model.module is SMP's face of the module (model.module.module)
        distributed, self.shardable = distribute(module)
        self.module = module_view(precision.fp32_weights(distributed, st.config))
        self.trace_device = trace_device
        self.trace_execution_times = trace_execution_times
        self.average_grads_across_microbatches = average_grads_across_microbatches
        # SMP v1's DDP arguments: average over the replicas in buckets of bucket_cap_mb during the backward
        self.grad_averaging = GradAveraging(overlapping_allreduce, bucket_cap_mb)
        self.partitioned = False
        self.runner: PipelineRunner | None = None
        self.traced_autocast: tuple[str, torch.dtype] | None = None  # the autocast the model was partitioned under
        self._post_partition_hooks: list[Callable[["DistributedModel", Any], None]] = []
        self._post_step_hooks: OrderedDict[int, Callable[["DistributedModel", Any], None]] = OrderedDict()
        self._resume_plan: tuple[str, bool] | None = None  # a checkpoint's plan (JSON) and whether it is required
        self._weights: tuple[str, bool] | None = None  # a checkpoint on disk to read after partitioning, strict?
        st.model = self

    # -- the step interface --------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Inside an ``@smp.step`` function: run this microbatch through the pipeline (the last stage's outputs)."""
        return step_run.model_call(state.get().in_step, self, args, kwargs)

    def backward(self, tensors: Any, grad_tensors: Any = None) -> None:
        """Inside an ``@smp.step`` function, in place of ``loss.backward()``: the pipeline runs the backward pass
        (scaled by the loss scaler when fp16 is on)."""
        st = state.get()
        scaler = getattr(st.optimizer, "loss_scaler", None)  # fp16: the DistributedOptimizer's
        step_run.model_backward(st.in_step, *precision.scaled_for_backward(scaler, tensors, grad_tensors))

    def is_last_stage_rank(self) -> bool:
        """Does this rank run the last pipeline stage (where the step's loss and outputs are computed)?"""
        st = state.get()
        return st.topology.pp_rank(st.rank) == st.topology.pp - 1

    @property
    def out_spec(self) -> Any:
        """The pytree structure of the model's outputs, as traced."""
        return self._pipeline().split_model.program.out_spec

    # -- partitioning ------------------------------------------------------------------------------------
    def partition(self, call: step_run.MicrobatchCall) -> None:
        """Partition the model, traced with ``call`` (the first microbatch of the first step, which makes this
        call: :func:`smp.engine.execution.run_step`), and build this rank's pipeline stage."""
        st = state.get()
        cfg = st.config
        pp = cfg.pipeline_parallel_degree
        # Trace under the step's autocast: the dtypes of the tensors that cross stages (the receive buffers)
        # come from the trace, and under autocast they are the low-precision ones.
        self.traced_autocast = call.autocast
        with torch.autocast(call.autocast[0], dtype=call.autocast[1]) if call.autocast else nullcontext():
            plan = self._make_plan(call, pp)
        self.runner = smp_runner(st, self, plan, self.checkpointed_paths(), initialise=self._weights is None)
        self.partitioned = True
        if self._weights is not None:
            self.load_weights(*self._weights)
        for fn in self._post_partition_hooks:
            fn(self, state.get().optimizer)

    def _make_plan(self, call: step_run.MicrobatchCall, pp: int) -> PartitionPlan:
        st = state.get()
        cfg = st.config
        options = PartitionOptions(microbatches=cfg.microbatches, memory_weight=cfg.effective_memory_weight,
                                   pipeline=cfg.schedule, time_prices=st.device.type == "cpu")
        plan = self._saved_plan(call, pp)
        if plan is not None:
            return plan
        if cfg.partition_file is not None:  # a plan from `smp replan` (or PartitionPlan.to_json): it must fit
            return bind_to(PartitionPlan.from_json(cfg.partition_file), self._trace(call),
                           f"partition_file {cfg.partition_file!r}", pp)
        if cfg.auto_partition:
            plan = shared_plan(self.module, call.args, call.kwargs, pp,
                               PartitionOptions.of(options, measure=self.trace_execution_times),
                               st.world_group, cfg.timeout_s, program=self._rank_program(), step=True, ranks=pp)
        else:
            graph = self._trace(call)
            plan = fixed_plan(graph, pp, manual_stages(self.module, graph), options)
            plan.graph = graph
        return plan

    def _trace(self, call: step_run.MicrobatchCall) -> Any:
        """The model traced on ``call``, as this rank's tp rank runs it (:mod:`partitioner.tp.sharding`)."""
        return rank_graph(trace(self.module, call.args, call.kwargs), self._rank_program())

    def _rank_program(self) -> RankProgram:
        """How this rank writes its program, as the smp config and its place in the grid say."""
        st = state.get()
        return RankProgram(tp=(st.topology.tp, st.topology.tp_rank(st.rank)), shardable=self.shardable,
                           sequence_parallel=st.config.sequence_parallel,
                           defer_weights=st.config.sharded_data_parallel_degree == 1, cp=st.cp_coordinates(),
                           ep=st.ep_coordinates())

    def _saved_plan(self, call: step_run.MicrobatchCall, pp: int) -> PartitionPlan | None:
        """The partition of a loaded checkpoint: required for partial state (its tensors are cut that way), a
        hint for full state (the same cut makes a resumed run compute exactly what the saved run would have;
        with another ``pipeline_parallel_degree`` or model the model is partitioned afresh)."""
        if self._resume_plan is None:
            return None
        text, required = self._resume_plan
        plan = PartitionPlan.from_json(text)
        try:  # bind re-applies the plan's column chunks (split_ops) to this trace, as for a partition_file
            return bind_to(plan, self._trace(call), "the checkpoint's partition", pp)
        except PlanMismatchError:
            pass
        if required:
            raise CheckpointError("the partial checkpoint was saved for a different model or pipeline_parallel_degree "
                                  f"(a partition into {plan.num_stages} stages of another graph): load it into the "
                                  "model and layout it was saved from, or save a full state_dict() to change them")
        return None

    def checkpointed_paths(self) -> list[str]:
        """Paths of the submodules ``smp.set_activation_checkpointing`` marked."""
        marked = state.get().checkpointed
        return [name for name, m in self.module.named_modules() if m in marked]

    # -- what this rank holds ----------------------------------------------------------------------------
    def _local_ids(self) -> set[int]:
        """Ids of the parameters and buffers this rank holds (all of them before partitioning)."""
        if not self.partitioned:
            return tensor_ids(self.module)
        st = state.get()
        return tensor_ids(self.module, own_tensors(self._pipeline().plan, st.topology.pp_rank(st.rank), st.topology.pp))

    def expert_shards(self) -> dict[str, tuple[int, int, int]]:
        """Under expert parallelism, each stacked expert weight this rank holds a slice of -> the experts it holds
        ``(start, stop, whole)``; empty without it (or before partitioning)."""
        return expert_specs(self._pipeline().plan.traced_graph()) if self.partitioned else {}

    def local_named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """(name, parameter) pairs of the parameters this rank's stages own."""
        ids = self._local_ids()
        return ((n, p) for n, p in self.module.named_parameters() if id(p) in ids)

    def local_parameters(self) -> Iterator[torch.nn.Parameter]:
        """The parameters this rank's stages own."""
        return (p for _, p in self.local_named_parameters())

    def local_buffers(self) -> Iterator[torch.Tensor]:
        """The buffers this rank's stages own."""
        ids = self._local_ids()
        return (b for b in self.module.buffers() if id(b) in ids)

    def local_modules(self) -> Iterator[torch.nn.Module]:
        """The submodules holding at least one parameter or buffer this rank's stages own."""
        ids = self._local_ids()
        return (m for m in self.module.modules()
                if any(id(t) in ids for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))))

    # -- state dicts -------------------------------------------------------------------------------------
    def _local_state(self) -> dict[str, torch.Tensor]:
        """Key -> tensor of every state_dict entry this rank holds (tied keys each, sharing their tensor)."""
        ids = self._local_ids()
        return {k: v for k, v in self.module.state_dict(keep_vars=True).items() if id(v) in ids}

    def load_weights(self, path: str | os.PathLike, strict: bool = True) -> list[str]:
        """Load this rank's parameters and buffers from a checkpoint on disk, reading no other tensor: a
        ``torch.save`` file, a safetensors file, or a ``save_pretrained`` directory (sharded or not); see
        :mod:`smp.engine.weights`. Before the first step it is applied right after partitioning (a model built
        without weights then skips random initialisation). Returns the local keys the checkpoint lacked (an
        error with ``strict``); shapes that differ are always an error."""
        if not self.partitioned:
            self._weights = (os.fspath(path), strict)
            return []
        layout = self.tensor_parallel_layout()
        return load_local(self.module, path, self._local_ids(), strict,
                          weight_cuts(layout.shards, layout.degree, layout.rank)).missing

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's parameters and buffers, marked partial (``smp.save(..., partial=True)``). Once the model
        is partitioned it carries the plan, so that a restart cuts the model the same way."""
        out: dict[str, Any] = {k: v.detach() for k, v in local_shards(self._local_state()).items()}
        out[PARTIAL_KEY] = True
        if self.partitioned:
            out[PLAN_KEY] = self._pipeline().plan.to_json()
            if state.get().topology.tp > 1:  # this tp rank's shards: they load into this tp rank only
                out[TP_KEY] = self.tensor_parallel_layout().marker()
            if state.get().sdp_mesh is not None:  # this rank's sdp shards: likewise
                out[SDP_KEY] = marker(state.get().sdp_mesh)
            if state.get().ep_ranks:  # this ep rank's experts: likewise
                degree, rank = state.get().ep_coordinates()
                out[EP_KEY] = {"degree": degree, "rank": rank}
        return out

    def tensor_parallel_layout(self) -> TPLayout:
        """This rank's tensor-parallel degree and tp rank, and the shard of every sharded state-dict key (none
        before partitioning, or without tensor parallelism)."""
        st = state.get()
        shards = shard_specs(self._pipeline().plan.traced_graph()) if self.partitioned and st.topology.tp > 1 else {}
        return TPLayout(st.topology.tp, st.topology.tp_rank(st.rank), shards)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The full model, gathered from every stage of this replica and, under tensor parallelism, from every
        tp rank's shards (whole tensors under the module's own keys): a collective over the model-parallel group
        (pp x tp ranks), so every mp rank calls it, and every one gets the whole dict (on the CPU). Before
        partitioning it is the module's own ``state_dict(*args, **kwargs)``. Tied parameters stay tied: their
        keys share one tensor, as in ``nn.Module.state_dict``. Under expert parallelism an ep rank's experts are
        gathered over its ep group first, so every rank of that group calls it too."""
        if not self.partitioned:
            return self.module.state_dict(*args, **kwargs)
        st = state.get()
        pg = st.enter("model-parallel", "model.state_dict()")  # collective: every rank of the replica calls it
        layout = self.tensor_parallel_layout()
        parts: list[Any] = [None] * st.topology.mp
        local = whole_values(self._local_state())
        if st.ep_ranks:  # an ep rank's experts: gathered whole over its ep group, which calls this too
            specs = self.expert_shards()
            with named_failures("gathering the experts over the expert-parallel group for model.state_dict() (every "
                                "rank of it calls state_dict())", [r for r in st.ep_ranks if r != st.rank], st.rank,
                                st.config.timeout_s):
                local = {k: gather_rows(v, specs[k], st.ep_group) if k in specs else v for k, v in local.items()}
        dist.all_gather_object(parts, (layout.rank, on_cpu(local)), group=pg)
        gathered = whole_model_state(parts, layout)
        keys_of: dict[int, list[str]] = {}  # the module's tensors (by id) -> their keys, in state_dict order
        own = self.module.state_dict(keep_vars=True)
        for k, v in own.items():
            keys_of.setdefault(id(v), []).append(k)
        out: dict[str, Any] = {}
        for keys in keys_of.values():
            # A tensor no stage holds (a parameter the forward never uses) keeps this process's value.
            value = next((gathered[k] for k in keys if k in gathered), own[keys[0]].detach())
            out.update(dict.fromkeys(keys, value))
        return {k: out[k] for k in own}

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True,  # type: ignore[override]
                        same_partition_load: bool = False,
                        translate_function: Callable[[dict], dict] | None = None) -> Any:
        """Load a full dict (``state_dict()``, or a plain model's) or a partial one (``local_state_dict()``).

        Each rank loads the keys it holds. With ``strict`` a key of this rank missing from the dict, or a key
        that does not belong here, is an error that names them (a renamed attribute must not silently leave
        random weights); ``strict=False`` loads the rest and returns this rank's ``missing_keys`` and
        ``unexpected_keys``. A partial dict loaded before the first step makes the model partition as it was
        saved (its plan), and is applied right after partitioning (then this returns None and a key error
        is raised by the first step). ``same_partition_load=True`` (SMP's argument) states that the dict is
        this rank's part of the same partition; without it, a partial dict saved under another partition of
        an already partitioned model is rebuilt from every pipeline rank's part, which makes this call a
        collective over the pipeline.

        Under tensor parallelism a full dict's whole tensors are cut to this rank's shards (loaded before the first
        step, it is applied right after partitioning, and this returns None), so a full state dict loads under any
        tensor-parallel degree; a partial dict holds one tp rank's shards and loads only into that tp rank of the
        degree it was saved with (anything else is a :class:`CheckpointError`). A full dict loaded before the first
        step into a model built without weights (delayed initialisation) is also applied after partitioning.
        SMP's marker ``_smp_is_partial`` is read (and ours): an unmarked full dict goes through ``translate_function``
        or SMP's translators (:func:`~smp.checkpoint.state_dicts.unmarked`).
        """
        st = state.get()
        sd, partial = unmarked(state_dict, translate_function, st.translate_functions)
        plan, saved_tp, saved_sdp, saved_ep = (sd.pop(k, None) for k in (PLAN_KEY, TP_KEY, SDP_KEY, EP_KEY))
        if not partial or plan is None:  # full, or partial but saved before partitioning: the whole model
            if self.partitioned:
                return self._load_held(sd, strict, part=False, whole=True)
            if st.topology.tp == 1 and not any(p.is_meta for p in self.module.parameters()):  # delayed init: later
                return self.module.load_state_dict(sd, strict=strict)
            self.after_partition(lambda: self._load_held(sd, strict, part=False, whole=True))
            return None
        saved = PartitionPlan.from_json(plan)
        check_partial(int(saved.tensor_parallel.get("degree", 1)), None if saved_tp is None else int(saved_tp["rank"]),
                      TPLayout(st.topology.tp, st.topology.tp_rank(st.rank)), "this partial state dict")
        check_shards(saved_sdp, st.sdp_mesh, "this partial state dict")
        check_experts(saved_ep, *st.ep_coordinates(), "this partial state dict")
        pp = st.topology.pp
        if not self.partitioned:
            if (saved_pp := plan_ranks(saved)) != pp:
                raise CheckpointError(f"this partial state dict was saved with pipeline_parallel_degree="
                                      f"{saved_pp}, this run has {pp}: partial checkpoints load on the "
                                      "layout they were saved with (save a full state_dict() to change it)")
            unknown = sorted(set(sd) - set(self.module.state_dict(keep_vars=True)))
            if strict and unknown:
                raise CheckpointError(key_error([], unknown, *self._where()))
            self._resume_plan = (plan, True)
            self.after_partition(lambda: self._load_held(sd, strict, part=True))
            return None
        if saved.assignment == self._pipeline().plan.assignment:
            return self._load_held(sd, strict, part=True)
        if same_partition_load:
            raise CheckpointError("load_state_dict(same_partition_load=True) got a partial state dict saved under "
                                  "another partition of the model: load it before the first step (the model is "
                                  "then partitioned as it was saved), or pass same_partition_load=False")
        parts: list[Any] = [None] * pp
        dist.all_gather_object(parts, on_cpu(sd), group=state.get().mp_group)
        return self._load_held({k: v for part in parts for k, v in part.items()}, strict, part=False)

    def _load_held(self, sd: dict[str, Any], strict: bool, part: bool, whole: bool = False) -> Any:
        """Copy the entries of the keys this rank holds into its tensors. ``part``: ``sd`` is one rank's part,
        so every key in it must be one of ours; otherwise only keys the model does not have are unexpected.
        ``whole``: ``sd`` holds whole tensors (a full dict), cut to this rank's tensor-parallel shards."""
        held = set(self._local_state())
        missing = sorted(held - set(sd))
        unexpected = sorted(set(sd) - (held if part else set(self.module.state_dict(keep_vars=True))))
        if strict and (missing or unexpected):
            raise CheckpointError(key_error(missing, unexpected, *self._where()))
        mine = {k: v for k, v in sd.items() if k in held}
        if whole:  # this rank's tensor-parallel shards and expert-parallel experts of the whole tensors
            specs = self.expert_shards()
            mine = {k: cut_rows(v, specs[k]) if k in specs else v
                    for k, v in cut_model_state(mine, self.tensor_parallel_layout()).items()}
        self.module.load_state_dict(load_into(self.module, mine, whole), strict=False)  # sdp shards, then the rest
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    def partition_plan(self) -> PartitionPlan | None:
        """The plan this model is partitioned by (None before the first step)."""
        return self.runner.plan if self.runner is not None else None

    def _pipeline(self) -> PipelineRunner:
        if self.runner is None:
            raise RuntimeError("the DistributedModel is not partitioned yet: it is, at the first @smp.step call")
        return self.runner

    def _where(self) -> tuple[int, int]:
        """This rank and its pp_rank, for messages."""
        st = state.get()
        return st.rank, st.topology.pp_rank(st.rank)

    def after_partition(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` now if the model is partitioned, else right after partitioning (before the first step's
        pipeline). A failure there is reported to the other ranks of the pipeline, so they stop at once instead
        of waiting for this rank in the first step."""
        if self.partitioned:
            fn()
            return

        def hook(model: "DistributedModel", optimizer: Any) -> None:
            try:
                fn()
            except BaseException as exc:
                self._pipeline().transport.report_failure(exc)
                raise
        self._post_partition_hooks.append(hook)

    def use_saved_plan(self, plan_json: str) -> None:
        """Partition as a full checkpoint's run did when the layout allows it (see :meth:`_saved_plan`);
        ``smp.resume_from_checkpoint`` calls it before the first step."""
        if not self.partitioned and self._resume_plan is None:
            self._resume_plan = (plan_json, False)
