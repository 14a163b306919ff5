"""The low-level pipeline API for users who bring their own training loop.

    plan = partitioner.partition(model, 2, example_inputs=(x_microbatch,), microbatches=8)
    runner = PipelineRunner(plan, schedule="1f1b", microbatches=8)
    result = runner.step((x,), target=y, loss_fn=F.cross_entropy)   # on every rank, same batch
    optimizer.step()   # over model.parameters(); each rank's stages have their .grad filled

Every rank of the pipeline calls the same code with the same batch (as with SageMaker model parallelism:
all ranks of a model-parallel group read the same data); model inputs are taken from it locally by the
stages that read them, so only activations and gradients travel. ``step`` splits the batch into
microbatches, walks this rank's schedule and leaves in each local parameter's ``.grad`` the gradient of
the mean microbatch loss — the same as ``loss_fn(model(x), y).backward()`` on one device for a mean
loss. Parameters used on several stages (tied embeddings) have their gradients summed across the ranks
that hold them.
"""
from __future__ import annotations

import datetime
import os
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from partitioner import PartitionPlan
from partitioner.capture.program import flatten_inputs, set_device
from partitioner.capture.stage_modules import MODEL_INPUT, SplitModel, Stage, split
from partitioner.capture.tracing import trace
from partitioner.cost.throughput import Throughput, measure
from pipeline import microbatch, shape_classes
from pipeline.executor import Executor
from pipeline.lowering import lower
from pipeline.offload import DEFAULT_HORIZON, activation_offload
from pipeline.p2p import Transport, close_groups, named_failures
from pipeline.param_gather import GatheredParams
from pipeline.profile_description import run_description
from pipeline.profiler import ProfileOptions, Profiler
from pipeline.row_grads import RowGradients
from pipeline.schedule import make_schedule
from pipeline.simulate import validate
from pipeline.tensorboard import TensorBoardWriter

__all__ = ["PipelineRunner", "StepResult", "stage_deps"]


@dataclass
class StepResult:
    """What :meth:`PipelineRunner.step` returns: the losses on every rank of the pipeline, and on the last
    stage's rank the model's outputs per microbatch, merged into one batch when ``outputs`` is first read (a
    training loop that reads only the loss never pays for concatenating the logits of every microbatch)."""

    losses: list[float]                          # per microbatch, on every rank of the pipeline
    microbatch_outputs: list[Any] | None = None  # the model's outputs per microbatch (last stage's rank only)
    throughput: Throughput | None = None  # the step's figures, the same on every rank (partitioner.cost.throughput)
    _merged: Any = field(default=None, init=False, repr=False)

    @property
    def outputs(self) -> Any:
        """The model's outputs merged over microbatches (None except on the last stage's rank)."""
        if self._merged is None and self.microbatch_outputs:
            self._merged = microbatch.merge(self.microbatch_outputs)
        return self._merged

    @property
    def loss(self) -> float:
        """The mean microbatch loss (NaN without a loss function)."""
        return sum(self.losses) / len(self.losses) if self.losses else float("nan")


def stage_deps(sm: SplitModel) -> list[tuple[int, int]]:
    """Edges (producer stage, consumer stage) of the stage graph, skips included."""
    return sorted({(src, s.index) for s in sm.stages for src in s.sources.values() if src != MODEL_INPUT})


class PipelineRunner:
    """Runs this rank's stages of ``plan`` as a pipeline of microbatches across ``ranks``."""

    def __init__(self, plan: PartitionPlan, *, schedule: str = "1f1b", microbatches: int = 1,
                 virtual_stages: int = 1, max_in_flight: int | None = None, ranks: list[int] | None = None,
                 pipelines: list[list[int]] | None = None, timeout_s: float = 60.0,
                 device: str | torch.device | None = None, record: bool = False,
                 average_grads_across_microbatches: bool = True, checkpoint_modules: Sequence[str] = (),
                 autocast: tuple[str, torch.dtype] | None = None, tp_groups: list[list[int]] | None = None,
                 tp_seed: int = 0, tensorboard: str | os.PathLike[str] | None = None,
                 model: torch.nn.Module | None = None, shape_cache_size: int = shape_classes.DEFAULT_SHAPE_CACHE_SIZE,
                 offload_activations: bool = False, activation_loading_horizon: int = DEFAULT_HORIZON,
                 gather: GatheredParams | None = None):
        """``ranks``: the global ranks of this pipeline, stage order (default: all ranks). With several
        pipelines side by side (data parallelism), pass them all as ``pipelines`` instead: process groups
        are created collectively, so every rank must name every pipeline in the same order. ``timeout_s``
        bounds every wait and collective of the runner (its process groups are created with it). ``record``:
        True keeps every pass's span in memory (``events``); a directory or
        :class:`pipeline.profiler.ProfileOptions` profiles the steps (see :meth:`write_profile`). ``autocast``:
        ``(device type, dtype)`` when the plan was traced under ``torch.autocast`` (run the steps under it too).
        ``tp_groups``: with a plan of a tensor-parallel graph (:func:`partitioner.tp.shard_program.shard_graph`), the
        tp groups of every rank, all of them on every rank, like ``pipelines``; ``tp_seed`` seeds the dropout
        streams of the sharded graph (the same on every rank of a tp group). ``tensorboard``: a directory to write
        every step's loss, throughput and memory to (:class:`pipeline.tensorboard.TensorBoardWriter`). ``model``: the
        model the plan cuts (tensor degree 1): a step whose microbatches have other shapes (another sequence length,
        a smaller last batch) runs the same plan on stages traced for them, up to ``shape_cache_size`` shape
        classes kept (:mod:`pipeline.shape_classes`); without it, every step has the traced shapes.
        ``offload_activations``: the inputs checkpointed stages keep go to host memory after their forward and come
        back ``activation_loading_horizon`` backward passes ahead (:mod:`pipeline.offload`; ``offload``). ``gather``:
        the model's parameters that are DTensor shards are gathered where each stage reads them
        (:mod:`pipeline.param_gather`; their gradients wait in it for ``gather.reduce_gradients``)."""
        if not dist.is_initialized():
            raise RuntimeError("PipelineRunner needs torch.distributed: call dist.init_process_group (torchrun or "
                               "`smp launch` sets up the environment) before creating it")
        me = dist.get_rank()
        pipelines = [list(p) for p in pipelines] if pipelines else [list(ranks) if ranks is not None
                                                                     else list(range(dist.get_world_size()))]
        mine = [p for p in pipelines if me in p]
        if len(mine) != 1:
            raise ValueError(f"rank {me} must be in exactly one pipeline, got pipelines {pipelines}")
        self.ranks = mine[0]
        self.pipelines = pipelines
        p = len(self.ranks)
        if plan.num_stages != p * virtual_stages:
            raise ValueError(f"the plan has {plan.num_stages} stages but {p} ranks x {virtual_stages} virtual "
                             f"stage(s) = {p * virtual_stages} are needed: partition into {p * virtual_stages} stages")
        self.plan = plan
        self.microbatches = microbatches
        self.average = average_grads_across_microbatches
        self.model, self.autocast, self.shapes = model, autocast, shape_classes.ShapeCache(shape_cache_size)
        self.training = plan.traced_graph().fx.training  # the stages' mode (train/eval), in every shape class
        home = split(plan.traced_graph(), plan.assignment, plan.num_stages)
        deps = stage_deps(home)
        self.schedule = lower(make_schedule(schedule, p, microbatches, virtual_stages=virtual_stages,
                                            max_in_flight=max_in_flight), deps)
        validate(self.schedule, deps)
        self.rank = self.ranks.index(me)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._checkpointed = _stages_running(plan, checkpoint_modules)
        self.gather = gather
        self.offload = activation_offload(offload_activations, activation_loading_horizon, self.device,
                                          self._checkpointed)
        self.timeout_s = timeout_s
        self.tensorboard = TensorBoardWriter(tensorboard, me, self.device) if tensorboard is not None else None
        group, _ = dist.new_subgroups_by_enumeration(pipelines, timeout=self._timeout)  # ours: a failure closes it
        self.transport = Transport(group=group, rank=me, timeout_s=timeout_s)
        options = ProfileOptions.of(record)
        self.profiler = None if options is None else Profiler(me, options, describe=lambda: run_description(self),
                                                              device=self.device)
        self.recorder = self.profiler.recorder if self.profiler is not None else None
        self._own_profiler = self.profiler  # record=: this runner's to stop (smp hands runners profilers of its own)
        self.tp_group = _bind_tp(home, tp_groups, self._timeout, self.device, tp_seed)
        self.data_replicas = len(pipelines) // max((len(g) for g in tp_groups or []), default=1)  # the job's samples
        self.current = self._stage_set(plan, home)
        self._shared = self._shared_groups()

    def _stage_set(self, plan: PartitionPlan, sm: SplitModel) -> shape_classes.StageSet:
        """The stage set of ``sm`` (split from ``plan``'s graph): this rank's stages on its device, in the runner's
        mode, and their executor; kept in the shape cache."""
        local = [sm.stages[s] for s in self.schedule.stages_of(self.rank)]
        rows = RowGradients(defer=not self.schedule.split_backward)
        for st in local:
            st.module.to(self.device).train(self.training)
            set_device(st.module, self.device)
            rows.insert(st.module, st.index)  # before the gathers: it reads the get_attr of the weight
            if self.gather is not None:
                self.gather.insert(st.module)
        executor = Executor(sm, self.schedule, self.rank, self.ranks, self.transport,
                            shape_classes.boundary_requires_grad(sm, self.autocast), self.device, self.recorder,
                            self._checkpointed, offload=self.offload, gather=self.gather, row_grads=rows)
        key = shape_classes.shape_key(sm.program, list(sm.program.input_meta))
        return self.shapes.put(shape_classes.StageSet(key, plan, sm, local, executor))

    @property
    def split_model(self) -> SplitModel:
        """The stages of the current shape class (the traced shapes until a step of other shapes ran)."""
        return self.current.split_model

    @property
    def local_stages(self) -> list[Stage]:
        """This rank's stages of the current shape class."""
        return self.current.local_stages

    @property
    def executor(self) -> Executor:
        """The executor of the current shape class."""
        return self.current.executor

    def specialise(self, args: tuple, kwargs: dict | None = None, loss: tuple[Any, Any] | None = None) -> SplitModel:
        """Make the stages of the shape class of one microbatch ``(args, kwargs)`` current (traced for it from
        ``model`` the first time, :func:`pipeline.shape_classes.retrace`; ``loss``: ``(loss_fn, its target)``) and
        return them. Every rank of the pipeline calls it with microbatches of the same shapes."""
        program = self.current.split_model.program
        key = shape_classes.shape_key(program, flatten_inputs(program, tuple(args), dict(kwargs or {})))
        found = self.shapes.get(key)
        if found is None:
            model = shape_classes.check_retraceable(program, key, self.current.key, self.model)
            plan = shape_classes.retrace(self.plan, model, tuple(args), dict(kwargs or {}), self.autocast, loss)
            found = self._stage_set(plan, split(plan.traced_graph(), plan.assignment, plan.num_stages))
        self.current = found
        return found.split_model

    @property
    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    def _shared_groups(self) -> list[tuple[Any, list[int], list[torch.Tensor]]]:
        """One process group per set of ranks that share parameters; replicas start from the first's values."""
        stage_rank = self.schedule.stage_to_rank
        by_positions: dict[tuple[int, ...], list[str]] = {}  # pipeline positions holding a replica -> names
        for name, stages in sorted(self.plan.shared_params.items()):
            positions = tuple(sorted({stage_rank[s] for s in stages}))
            if len(positions) > 1:
                by_positions.setdefault(positions, []).append(name)
        local: dict[str, torch.Tensor | None] = {}
        for st in self.local_stages:
            params = dict(st.module.named_parameters(remove_duplicate=False))  # param_names also names buffers
            for path, canonical in st.param_names.items():
                local.setdefault(canonical, params.get(path))
        out = []
        for positions, names in sorted(by_positions.items()):
            group, _ = dist.new_subgroups_by_enumeration([[p[i] for i in positions] for p in self.pipelines],
                                                         timeout=self._timeout)
            holders = [self.ranks[i] for i in positions]
            if dist.get_rank() in holders:
                tensors = [t for t in map(local.get, names) if t is not None]
                with torch.no_grad(), self._named("receiving shared parameters", holders[:1]):
                    for t in tensors:
                        dist.broadcast(t, src=holders[0], group=group)
                out.append((group, holders, tensors))
        return out

    def step(self, args: tuple = (), kwargs: dict | None = None, *, target: Any = None,
             loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, return_outputs: bool = True) -> StepResult:
        """One pipelined pass over the batch: forward (and backward when ``loss_fn`` is given and grad
        mode is on). ``return_outputs=False``: keep no model outputs (``StepResult.outputs`` is None), only the
        losses; a training loop that reads only the loss runs faster so. Raises
        :class:`pipeline.p2p.PeerError` naming the rank if another rank fails."""
        try:
            with self.profiler.stepping() if self.profiler is not None else nullcontext():
                result = self._step(tuple(args), dict(kwargs or {}), target, loss_fn, return_outputs)
            if self.tensorboard is not None:
                self.tensorboard.log(result.loss, result.throughput)
            return result
        except BaseException as exc:
            self.report_failure(exc)
            raise

    def _step(self, args: tuple, kwargs: dict, target: Any, loss_fn: Any, return_outputs: bool) -> StepResult:
        m, start = self.microbatches, time.perf_counter()
        mbs = microbatch.split(args, kwargs, m)
        targets = [t[0][0] for t in microbatch.split((target,), {}, m)] if target is not None else [None] * m
        sm = self.specialise(*mbs[0], loss=(loss_fn, targets[0]) if loss_fn is not None else None)
        mb_inputs = []
        for a, kw in mbs:
            flat = flatten_inputs(sm.program, a, kw)
            sm.check_inputs(flat)
            mb_inputs.append({n: (v.to(self.device) if isinstance(v, torch.Tensor) else v)
                              for n, v in zip(sm.program.input_names, flat)})
        train = loss_fn is not None and torch.is_grad_enabled()
        losses = torch.zeros(m, dtype=torch.float64)

        def loss_hook(k: int, flat_out: tuple) -> torch.Tensor | None:
            if loss_fn is None:
                return None
            loss = loss_fn(pytree.tree_unflatten(list(flat_out), sm.program.out_spec), targets[k])
            losses[k] = float(loss.detach())
            return loss / m if self.average else loss

        results = self.run_microbatches(mb_inputs, loss_hook, train, keep_outputs=return_outputs)
        if loss_fn is not None:
            last_rank = self.ranks[self.schedule.stage_to_rank[-1]]
            with self._named("receiving the losses", [last_rank]):
                dist.broadcast(losses, src=last_rank, group=self.transport.group)
        outputs = [pytree.tree_unflatten(list(results[k]), sm.program.out_spec) for k in range(m)] if results else None
        return StepResult(losses=losses.tolist() if loss_fn is not None else [], microbatch_outputs=outputs,
                          throughput=self.throughput(time.perf_counter() - start, mb_inputs, train))

    def throughput(self, seconds: float, mb_inputs: list[dict[str, Any]], train: bool) -> Throughput:
        """The job's :class:`partitioner.cost.throughput.Throughput` of the step, from this rank's ``seconds``: the
        slowest rank's time (one all-reduce over the pipeline), so that every rank returns the same figures."""
        slowest = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        with self._named("agreeing on the step's time", self.ranks):
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.transport.group)
        figures = measure(self.current.plan, float(slowest.item()), mb_inputs, train, len(self.ranks),
                          len(self.pipelines), self.data_replicas)
        if self.profiler is not None and self.profiler.recording is not None:  # for the report (smp report)
            self.profiler.recording.counter("throughput", figures.counts())
        return figures

    def run_microbatches(self, mb_inputs: Any, loss_hook: Any, train: bool,
                         before_forward: Any = None, keep_outputs: bool = True) -> dict[int, tuple]:
        """Walk this rank's schedule once (see :meth:`pipeline.executor.Executor.run`), then sum the gradients
        of parameters replicated on several stages. The building block of ``step`` and of ``@smp.step``."""
        self.executor.recorder = self.profiler.recording if self.profiler is not None else None
        try:
            results = self.executor.run(mb_inputs, loss_hook, train, before_forward, keep_outputs)
            if train:
                for group, holders, tensors in self._shared:
                    with self._named("summing the gradients of shared parameters", holders):
                        for t in tensors:
                            if t.grad is None:
                                t.grad = torch.zeros_like(t)
                            dist.all_reduce(t.grad, group=group)
            return results
        except BaseException as exc:
            self.report_failure(exc)
            raise

    def _named(self, what: str, peers: list[int]) -> Any:
        """Failures of a collective on one of the runner's groups, as :class:`PeerError` naming the rank."""
        me = dist.get_rank()
        return named_failures(what, [r for r in peers if r != me], me, self.timeout_s, self.transport.store)

    def report_failure(self, exc: BaseException, also: Any = ()) -> None:
        """Tell the other ranks that this one failed (see :mod:`pipeline.p2p`): a note in the store, and the
        runner's process groups (and ``also``, the caller's) closed so that nobody waits on them."""
        shared, self._shared = self._shared, []
        self.transport.report_failure(exc, also=[g for g, _, _ in shared] + list(also))

    def close(self) -> None:
        """Destroy the runner's process groups (a runner replaced by another, e.g. after re-partitioning, would
        otherwise keep its connections open for the life of the process) and stop the profiler ``record=`` made.
        The runner cannot step afterwards."""
        groups = [self.transport.group, *(g for g, _, _ in self._shared), *filter(None, [self.tp_group])]
        self.transport.group, self._shared = None, []
        close_groups(groups)
        if self._own_profiler is not None:  # and its system monitor's thread, if one samples
            self._own_profiler.stop()

    def train(self, mode: bool = True) -> "PipelineRunner":
        """Put this rank's stages in training or evaluation mode (dropout, BatchNorm), as ``nn.Module.train``.
        Stages start in the mode the model was traced in."""
        self.training = mode
        for stage_set in self.shapes.sets.values():
            for st in stage_set.local_stages:
                st.module.train(mode)
        return self

    def eval(self) -> "PipelineRunner":
        """``train(False)``."""
        return self.train(False)

    @property
    def events(self) -> list:
        """The recorded action spans (with ``record=True``), for :mod:`pipeline.timeline`."""
        return self.recorder.events if self.recorder else []

    def write_profile(self) -> str | None:
        """Profiled with ``record=DIR`` and no step window: stop and write the profile (a collective: every
        rank calls it); returns the directory on rank 0. A window (``ProfileOptions(steps=...)``) is written
        when it ends."""
        if self.profiler is None or self.profiler.options.dir is None:
            raise ValueError("write_profile() needs a runner made with record=DIR (or ProfileOptions(dir=...))")
        return self.profiler.write()

    @classmethod
    def from_plan_file(cls, path: str | os.PathLike[str], model: torch.nn.Module, args: tuple = (),
                       kwargs: dict | None = None, **runner_kwargs: Any) -> "PipelineRunner":
        """A runner of the plan in the JSON file ``path`` (``plan.to_json(path)``, ``smp replan -o``) for
        ``model``, traced on the example inputs ``args``/``kwargs``: one microbatch, of the shapes the plan was made
        from. A plan of another model, or example inputs of other shapes (the whole batch, say), is a
        :class:`partitioner.cut.plan.PlanMismatchError` naming what differs, raised before any process group is made."""
        graph = trace(model, tuple(args), dict(kwargs or {}))
        plan = PartitionPlan.from_json(os.fspath(path)).bind(graph, source=f"plan file {os.fspath(path)}",
                                                             microbatches=runner_kwargs.get("microbatches", 1))
        return cls(plan, **{"model": model, **runner_kwargs})

    def local_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters of this rank's stages, each once."""
        return list({id(p): p for st in self.local_stages for p in st.module.parameters()}.values())


def _bind_tp(sm: SplitModel, tp_groups: list[list[int]] | None, timeout: datetime.timedelta,
             device: torch.device, seed: int) -> Any:
    """This rank's tp process group, bound to the sharded graph's collectives (None without tensor parallelism)."""
    comm = sm.program.tp_comm
    if comm is None and all(len(g) == 1 for g in tp_groups or []):
        return None
    me = dist.get_rank()
    mine = [g for g in tp_groups or [] if me in g]
    if comm is None or len(mine) != 1 or len(mine[0]) != comm.size:
        raise ValueError(f"rank {me}: the plan's graph is sharded for tensor parallelism of degree "
                         f"{comm.size if comm else 1}, but tp_groups={tp_groups}: pass every rank's tp group, each "
                         "of that many ranks, with a plan of a graph sharded for that degree")
    group, _ = dist.new_subgroups_by_enumeration([list(g) for g in tp_groups or []], timeout=timeout)
    comm.bind(group, device, seed)
    return group


def _stages_running(plan: PartitionPlan, module_paths: Any) -> set[int]:
    """Stages that run some op of one of ``module_paths`` (or of their submodules)."""
    paths = tuple(module_paths)
    if not paths:
        return set()
    g = plan.traced_graph()
    return {plan.assignment[n] for n, m in zip(g.names, g.modules)
            if any(m == p or m.startswith(p + ".") for p in paths)}
