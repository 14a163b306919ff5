"""``smp.DistributedModel``: a torch module whose forward and backward run as a pipeline.

The model is partitioned at the first ``@smp.step`` call, traced with that step's first microbatch:
automatically through :func:`partitioner.partition` (honouring ``memory_weight``/``optimize`` and, with
``trace_execution_times``, measured op times), or by hand (``smp.partition(i)`` contexts,
``smp.set_partition``, ``auto_partition=False`` + ``default_partition``). Each rank then keeps its stage
of a :class:`pipeline.PipelineRunner`. The stages hold the user's own parameter tensors, so optimizers
built over ``model.parameters()`` and ``state_dict`` keys work unchanged.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from partitioner import PartitionOptions, PartitionPlan, trace
from partitioner.partition import fixed_plan
from partitioner.trace import flatten_inputs
from pipeline import PipelineRunner

from . import precision, state
from . import step as step_mod
from .planning import shared_plan

__all__ = ["DistributedModel", "partition", "set_partition", "set_activation_checkpointing"]


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
    st = state.get()
    _check_index(index, st.config.pipeline_parallel_degree)
    st.placement[module] = index


def set_activation_checkpointing(module: torch.nn.Module) -> None:
    """Recompute the activations of the stage(s) holding ``module`` in backward instead of keeping them."""
    state.get().checkpointed.add(module)


def _check_index(index: int, pp: int) -> None:
    if not isinstance(index, int) or not 0 <= index < pp:
        raise ValueError(f"partition index {index!r} is out of range: use 0 .. {pp - 1} "
                         f"(pipeline_parallel_degree={pp})")


class DistributedModel(torch.nn.Module):
    # SMP v1 arguments that tune its own gradient reduction or profiling; here they change nothing.
    _SMP_IGNORED = {"backward_passes_per_step", "gradient_as_bucket_view", "broadcast_buffers",
                    "bucket_cap_mb", "find_unused_parameters", "overlapping_allreduce", "trace_memory_usage"}

    def __init__(self, module: torch.nn.Module, trace_device: str = "cpu", trace_execution_times: bool = False,
                 average_grads_across_microbatches: bool = True, **kwargs: Any):
        st = state.get()
        if st.model is not None:
            raise RuntimeError("a DistributedModel already exists in this process: wrap the whole model once "
                               "(SMP supports one DistributedModel per process)")
        unknown = set(kwargs) - self._SMP_IGNORED
        if unknown:
            raise TypeError(f"DistributedModel got unknown argument(s) {sorted(unknown)}")
        if kwargs:
            warnings.warn(f"DistributedModel ignores {sorted(kwargs)}: this engine reduces gradients itself and "
                          "prices memory from the trace")
        super().__init__()
        self.module = module
        self.trace_device = trace_device
        self.trace_execution_times = trace_execution_times
        self.average_grads_across_microbatches = average_grads_across_microbatches
        self.partitioned = False
        self.runner: PipelineRunner | None = None
        self._post_partition_hooks: list[Callable[["DistributedModel", Any], None]] = []
        self._post_step_hooks: OrderedDict[int, Callable[["DistributedModel", Any], None]] = OrderedDict()
        self._resume_plan: str | None = None  # from a partial checkpoint: stages must match what was saved
        st.model = self

    # -- the step interface --------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return step_mod.model_call(self, args, kwargs)

    def backward(self, tensors: Any, grad_tensors: Any = None) -> None:
        step_mod.model_backward(*precision.scaled_for_backward(tensors, grad_tensors))  # fp16: loss scaling

    def is_last_stage_rank(self) -> bool:
        st = state.get()
        return st.topology.pp_rank(st.rank) == st.topology.pp - 1

    @property
    def out_spec(self) -> Any:
        return self.runner.split_model.program.out_spec

    def register_post_partition_hook(self, fn: Callable[["DistributedModel", Any], None]) -> None:
        """``fn(model, optimizer)`` runs once, right after partitioning; ``optimizer`` is the
        DistributedOptimizer (None when there is none yet), as SMP passes it."""
        self._post_partition_hooks.append(fn)

    def get_module(self) -> torch.nn.Module:
        """The module this DistributedModel wraps (SMP: the model without its wrappers)."""
        return self.module

    def register_post_step_hook(self, fn: Callable[["DistributedModel", Any], None]) -> RemovableHandle | None:
        """``fn(model, optimizer)`` runs once, after the step that partitions the model (the first), as in
        SMP -- e.g. to load optimizer state, which exists only then. Registered when the model is already
        partitioned and a DistributedOptimizer exists, it runs at once and None is returned; otherwise the
        returned handle's ``remove()`` cancels it."""
        optimizer = state.get().optimizer
        if self.partitioned and optimizer is not None:
            fn(self, optimizer)
            return None
        handle = RemovableHandle(self._post_step_hooks)
        self._post_step_hooks[handle.id] = fn
        return handle

    def run_post_step_hooks(self) -> None:
        """Called by ``@smp.step`` after each step: the hooks waiting for a partitioned model run, once."""
        if self.partitioned and self._post_step_hooks:
            hooks = list(self._post_step_hooks.values())
            self._post_step_hooks.clear()
            for fn in hooks:
                fn(self, state.get().optimizer)

    def run_step(self, run: "step_mod._StepRun") -> list[Any]:
        st = state.get()
        if not self.partitioned:
            self._partition(run.call_of(0))
        runner = self.runner
        sm = runner.split_model
        runner.train(self.module.training)  # model.eval() turns dropout off and BatchNorm to running statistics
        train = self.module.training and run.call_of(0).grad_enabled
        if run.call_of(0).autocast != self._traced_autocast:
            def name(ac: Any) -> str:
                return f"torch.autocast({ac[0]!r}, dtype={ac[1]})" if ac else "no autocast"
            raise RuntimeError(f"the model was partitioned under {name(self._traced_autocast)} but this step runs "
                               f"under {name(run.call_of(0).autocast)}: the tensors that cross pipeline stages have "
                               "the dtypes of the first step, so call the model under the same autocast setting in "
                               "every step")

        def inputs_of(k: int) -> dict[str, Any]:
            call = run.call_of(k)
            flat = flatten_inputs(sm.program, call.args, call.kwargs)
            sm.check_inputs(flat)
            return {n: (v.to(st.device) if isinstance(v, torch.Tensor) else v)
                    for n, v in zip(sm.program.input_names, flat)}

        last = self.is_last_stage_rank()
        try:
            runner.run_microbatches(inputs_of, run.loss_hook if last else None, train, run.before_forward)
            local = run.results()
            if train and st.topology.dp > 1:
                self._reduce_data_parallel()
            return step_mod.broadcast_results(local if last else None, src=runner.ranks[-1],
                                              group=runner.transport.group)
        except BaseException as exc:
            runner.transport.report_failure(exc)
            raise

    def _reduce_data_parallel(self) -> None:
        """Average gradients over the replicas of this stage (one coalesced all-reduce on the dp group)."""
        st = state.get()
        params = [p for p in self.local_parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=st.dp_group)
        flat /= st.topology.dp
        for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)

    # -- partitioning ------------------------------------------------------------------------------------
    def _partition(self, call: "step_mod._Call") -> None:
        st = state.get()
        cfg = st.config
        pp = cfg.pipeline_parallel_degree
        # Trace under the step's autocast: the dtypes of the tensors that cross stages (the receive buffers)
        # come from the trace, and under autocast they are the low-precision ones.
        self._traced_autocast = call.autocast
        with torch.autocast(call.autocast[0], dtype=call.autocast[1]) if call.autocast else nullcontext():
            plan = self._make_plan(call, pp)
        self.runner = PipelineRunner(
            plan, schedule=cfg.schedule, microbatches=cfg.microbatches,
            max_in_flight=cfg.active_microbatches if cfg.schedule == "1f1b" else None,
            pipelines=st.topology.mp_groups(), device=st.device,
            checkpoint_modules=self._checkpointed_paths())
        self.partitioned = True
        for fn in self._post_partition_hooks:
            fn(self, state.get().optimizer)

    def _make_plan(self, call: "step_mod._Call", pp: int) -> PartitionPlan:
        cfg = state.get().config
        options = PartitionOptions(microbatches=cfg.microbatches, memory_weight=cfg.effective_memory_weight,
                                   pipeline=cfg.schedule)
        if self._resume_plan is not None:
            plan = PartitionPlan.from_json(self._resume_plan)
            plan.graph = trace(self.module, call.args, call.kwargs)
            if plan.num_stages != pp or set(plan.assignment) != set(plan.graph.names):
                raise RuntimeError("the partial checkpoint was saved for a different model or "
                                   "pipeline_parallel_degree: its partition does not fit this one")
        elif cfg.auto_partition:
            plan = shared_plan(self.module, call.args, call.kwargs, pp,
                               PartitionOptions.of(options, measure=self.trace_execution_times))
        else:
            graph = trace(self.module, call.args, call.kwargs)
            plan = fixed_plan(graph, pp, self._manual_stages(graph), options)
            plan.graph = graph
        return plan

    def _checkpointed_paths(self) -> list[str]:
        marked = state.get().checkpointed
        return [name for name, m in self.module.named_modules() if m in marked]

    def _manual_stages(self, graph: Any) -> np.ndarray:
        """Each op goes where its innermost placed module is; an op of no placed module goes to
        ``default_partition``, or to its latest producer's partition when that comes later (so glue code
        in an unplaced parent, e.g. the root module's forward, never sends a tensor backwards)."""
        st = state.get()
        placed = {name: st.placement[m] for name, m in self.module.named_modules() if m in st.placement}
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

    # -- what this rank holds ----------------------------------------------------------------------------
    def _local_ids(self) -> set[int]:
        if not self.partitioned:
            return {id(t) for t in list(self.module.parameters()) + list(self.module.buffers())}
        return {id(t) for st in self.runner.local_stages
                for t in list(st.module.parameters()) + list(st.module.buffers())}

    def local_named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        ids = self._local_ids()
        return ((n, p) for n, p in self.module.named_parameters() if id(p) in ids)

    def local_parameters(self) -> Iterator[torch.nn.Parameter]:
        return (p for _, p in self.local_named_parameters())

    def local_buffers(self) -> Iterator[torch.Tensor]:
        ids = self._local_ids()
        return (b for b in self.module.buffers() if id(b) in ids)

    def local_modules(self) -> Iterator[torch.nn.Module]:
        ids = self._local_ids()
        return (m for m in self.module.modules()
                if any(id(t) in ids for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))))

    # -- state dicts -------------------------------------------------------------------------------------
    def local_state_dict(self) -> dict[str, Any]:
        """This rank's parameters and buffers, marked partial (``smp.save(..., partial=True)``)."""
        ids = self._local_ids()
        out = {k: v for k, v in self.module.state_dict(keep_vars=True).items() if id(v) in ids}
        out = {k: v.detach() for k, v in out.items()}
        out["_smp_partial"] = True
        if self.partitioned:  # a restart must cut the model the same way for these tensors to fit
            out["_smp_plan"] = self.runner.plan.to_json()
        return out

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The full model, gathered from every stage of this replica (on every mp rank)."""
        if not self.partitioned:
            return self.module.state_dict(*args, **kwargs)
        st = state.get()
        parts: list[Any] = [None] * st.topology.pp
        local = {k: v.cpu() for k, v in self.local_state_dict().items() if isinstance(v, torch.Tensor)}
        dist.all_gather_object(parts, local, group=st.mp_group)
        full: dict[str, Any] = {}
        for part in parts:
            full.update(part)
        own = self.module.state_dict()
        return {k: full.get(k, own[k]) for k in own}

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:  # type: ignore[override]
        """Full or partial (from ``local_state_dict``) dicts; tensors are copied into the model's own."""
        sd = dict(state_dict)
        partial = bool(sd.pop("_smp_partial", False))
        plan = sd.pop("_smp_plan", None)
        if plan is not None:
            if not self.partitioned:
                self._resume_plan = plan
            elif PartitionPlan.from_json(plan).assignment != self.runner.plan.assignment:
                raise RuntimeError("this partial checkpoint was saved under a different partition of the model; "
                                   "load it before the first step so the model is partitioned the same way")
        return self.module.load_state_dict(sd, strict=strict and not partial)
