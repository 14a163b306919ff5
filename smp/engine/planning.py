"""One plan for every rank: trace on each rank, partition on global rank 0, share the plan.

Partitioning prices ops with measured device rates, which differ from one process to the next; if every
rank partitioned on its own they could disagree on the stages. So global rank 0 alone partitions and
broadcasts the plan as JSON, and every rank binds it to its own trace of the model (the stages it builds
hold its own parameters). This is where the ``smp`` layer composes the partitioner and the pipeline
runtime: :func:`pipeline_runner` is the one-call way from a model to a running :class:`pipeline.PipelineRunner`.

A model whose forward calls ``pipe_split()`` k times is cut into its k + 1 stages
(:mod:`partitioner.capture.split_points`) whatever the pipeline's degree p, as torch.distributed.pipelining does: with
k + 1 a multiple of p, each rank runs (k + 1) / p of them (stage s on rank s mod p) under the interleaved virtual
schedule (:func:`stages_per_rank`), and the plan says so (:func:`on_ranks`).
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, replace
from typing import Any, Collection

import torch
import torch.distributed as dist

from partitioner import PartitionOptions, PartitionPlan, partition, trace
from partitioner.capture.graph import OpGraph
from partitioner.capture.split_points import RANKS_KEY, stages_note, stages_on_ranks
from partitioner.capture.tracing import price_loss
from partitioner.cp.context_program import context_parallel_graph
from partitioner.ep.expert_program import expert_parallel_graph
from partitioner.sdp.shards import warn_if_nothing_sharded
from partitioner.tp.sequence import SequenceParallelWarning
from partitioner.tp.shard_program import tensor_parallel_graph
from pipeline import PipelineRunner
from pipeline.p2p import named_failures
from pipeline.param_gather import GatheredParams
from pipeline.schedule import VIRTUAL_SCHEDULE
from smp.engine import mixed_precision as precision
from smp.engine.materialize import keep_own_share, tensor_ids
from smp.engine.pipeline_model import PipelineModel
from smp.engine.sharded_dp import shard_own_share, to_shard
from smp.engine.step_loss import step_loss
from smp.engine.tp_shards import install_shards, shard_owners, shard_specs
from smp.engine.weights import load_local, weight_cuts
from smp.runtime.state import State

__all__ = ["RankProgram", "rank_graph", "shared_plan", "pipeline_runner", "smp_runner", "own_tensors",
           "stages_per_rank", "on_ranks", "plan_ranks", "bind_to"]


@dataclass
class RankProgram:
    """How this rank's program is written from the traced graph: sharded for its tp rank (``tp``: degree, rank;
    ``shardable``: the parameters tensor parallelism may split, None: all; ``sequence_parallel``: the regions between
    tp regions on a slice of the sequence, :mod:`partitioner.tp.sequence`, None: where it applies, quietly, and off
    under context parallelism; ``defer_weights``: their weights' gradients summed once per step), on its cp rank's
    tokens (``cp``: degree, rank; :mod:`partitioner.cp`), then its experts for its ep rank (``ep``;
    :mod:`partitioner.ep`)."""

    tp: tuple[int, int] = (1, 0)
    shardable: Collection[str] | None = None
    sequence_parallel: bool | None = False
    defer_weights: bool = True
    cp: tuple[int, int] = (1, 0)
    ep: tuple[int, int] = (1, 0)


def rank_graph(graph: OpGraph, program: RankProgram | None = None) -> OpGraph:
    """The traced ``graph`` as this rank runs it (:class:`RankProgram`; None: one process's)."""
    p = program or RankProgram()
    with warnings.catch_warnings():
        if p.sequence_parallel is None:
            warnings.simplefilter("ignore", SequenceParallelWarning)
        sequence = p.sequence_parallel is True or (p.sequence_parallel is None and p.cp[0] == 1)
        sharded = tensor_parallel_graph(graph, *p.tp, p.shardable, sequence, p.defer_weights)
    return expert_parallel_graph(context_parallel_graph(sharded, *p.cp), *p.ep)


def shared_plan(model: torch.nn.Module, args: tuple, kwargs: dict, num_stages: int,
                options: PartitionOptions | None = None, group: Any = None,
                timeout_s: float | None = None, loss: tuple[Any, Any] | None = None,
                program: RankProgram | None = None, step: bool = False, ranks: int | None = None) -> PartitionPlan:
    """Every rank traces ``model`` on one microbatch; global rank 0 partitions and sends the plan to all, over
    ``group`` (every rank; default: the default group), whose timeout bounds the other ranks' wait
    (``timeout_s`` names it in the error: raise it when partitioning takes longer). ``loss``: ``(loss_fn, one
    microbatch's target)``, the loss the last stage computes, priced in the plan (``partitioner.trace``).
    ``program``: how each rank writes its program (:class:`RankProgram`): every rank binds the plan to its own
    (global rank 0, tp rank 0, partitions its own).
    ``step``: the model runs in an ``@smp.step`` function, whose loss the plan prices (:mod:`smp.engine.step_loss`).
    ``ranks``: the pipeline's ranks, when a model with ``pipe_split()`` markers is to be cut into the markers' stages
    instead of ``num_stages`` (a multiple of ``ranks``, else an error on every rank: :func:`stages_on_ranks`)."""
    loss_fn, target = loss if loss is not None else (None, None)
    graph = rank_graph(trace(model, args, kwargs, loss_fn=loss_fn, target=target), program)
    if ranks is not None:
        num_stages = stages_on_ranks(graph, ranks) or num_stages
    outside = step_loss(graph) if step and loss is None else None
    if outside is not None:
        price_loss(graph, *outside)
    # Rank 0 times the ops (and this CPU's rates) once every rank has traced: a peer still tracing (torch.export,
    # seconds of work) would share the host's cores and memory with the timing, and its plan would be priced so.
    rank, world = dist.get_rank(), dist.get_world_size()
    with named_failures("waiting for every rank to trace the model", [r for r in range(world) if r != rank], rank,
                        timeout_s):
        dist.barrier(group=group)
    text = [partition(graph, num_stages, options, example_inputs=args, example_kwargs=kwargs).to_json()
            if rank == 0 else None]
    with named_failures("receiving the partition plan from rank 0", [0], rank, timeout_s):
        dist.broadcast_object_list(text, src=0, group=group)
    assert text[0] is not None  # rank 0's plan arrived
    return PartitionPlan.from_json(text[0]).bind(graph, "the plan from rank 0")


def pipeline_runner(model: torch.nn.Module, args: tuple = (), kwargs: dict | None = None, *,
                    num_stages: int | None = None, microbatches: int = 1, virtual_stages: int | None = None,
                    options: PartitionOptions | None = None, weights: str | None = None,
                    loss_fn: Any = None, target: Any = None, sequence_parallel: bool = False,
                    **runner_kwargs: Any) -> PipelineRunner:
    """Trace ``model`` on the example inputs ``(args, kwargs)``, **one microbatch** (as every API that takes example
    inputs: :mod:`partitioner.capture.plan_inputs`; ``step`` takes the whole batch, ``microbatches`` of them),
    partition on global rank 0, share the plan with every rank and build this rank's :class:`pipeline.PipelineRunner`
    (``runner_kwargs``: ``schedule``, ``ranks``/``pipelines``, ``timeout_s``, ``device``, ...). ``num_stages``
    defaults to the pipeline's ranks times ``virtual_stages`` (1), or, when neither is given, to the stages of the
    model's ``pipe_split()`` markers if it has any: a multiple of the ranks, run as interleaved virtual stages (the
    ``schedule`` then defaults to ``"interleaved-virtual"``, the one that runs them: :func:`stages_per_rank`).
    ``options`` default to ``PartitionOptions(microbatches=...)``. ``loss_fn`` and ``target``, the example
    microbatch's target: the loss ``step`` will compute, priced on the last stage by the plan.
    Steps may change the batch size and sequence length from one to the next (:mod:`pipeline.shape_classes`).
    ``tp_groups`` (with ``pipelines``): tensor parallelism, each layer split over the ranks of a tp group
    (:mod:`partitioner.tp.sharding`); the model's parameters become this rank's shards (:mod:`smp.engine.tp_shards`);
    ``sequence_parallel``: the regions between tp regions run on a slice of the sequence
    (:mod:`partitioner.tp.sequence`).

    The model keeps only this rank's tensors (:mod:`smp.engine.materialize`): built without weights, it gets them
    initialised, or read from the checkpoint ``weights`` (:mod:`smp.engine.weights`: only this rank's keys are read);
    built with weights, it releases the other stages' ones."""
    pipelines = [list(p) for p in runner_kwargs.get("pipelines") or
                 [runner_kwargs.get("ranks") or range(dist.get_world_size())]]
    mine = next(p for p in pipelines if dist.get_rank() in p)
    stages = num_stages or len(mine) * (virtual_stages or 1)
    loss = None if loss_fn is None else (loss_fn, target)
    tp_group = next((g for g in runner_kwargs.get("tp_groups") or [] if dist.get_rank() in g), [dist.get_rank()])
    tp = (len(tp_group), tp_group.index(dist.get_rank()))
    plan = shared_plan(model, tuple(args), dict(kwargs or {}), stages,
                       PartitionOptions.of(options, microbatches=microbatches, time_prices=_on_cpu(runner_kwargs)),
                       loss=loss, ranks=len(mine) if num_stages is None and virtual_stages is None else None,
                       program=RankProgram(tp=tp, sequence_parallel=sequence_parallel,
                                           defer_weights=False))  # no step-level sum here
    v = virtual_stages or stages_per_rank(plan, len(mine), microbatches, runner_kwargs.get("schedule"),
                                          "leave schedule unset or pass schedule='interleaved-virtual', or run on "
                                          "{stages} ranks (one stage each)")
    plan = on_ranks(plan, len(mine))
    if v > 1:
        runner_kwargs.setdefault("schedule", VIRTUAL_SCHEDULE)
    install_shards(model, plan.traced_graph())
    local = own_tensors(plan, mine.index(dist.get_rank()), len(mine))
    keep_own_share(model, local, runner_kwargs.get("device") or "cpu", initialise=weights is None,
                   shard_of=shard_owners(plan.traced_graph(), tp[1]))
    if weights is not None:  # of a tensor-parallel shard, only its slice is read
        load_local(model, weights, tensor_ids(model, local), cuts=weight_cuts(shard_specs(plan.traced_graph()), *tp))
    runner_kwargs.setdefault("autocast", precision.active_autocast())  # traced under it: the stages run under it
    runner_kwargs.setdefault("model", model)  # batches of other shapes run stages traced again from it
    return PipelineRunner(plan, microbatches=microbatches, virtual_stages=v, **runner_kwargs)


def _on_cpu(runner_kwargs: dict[str, Any]) -> bool:
    """Whether the pipeline's stages run on the CPU (``device`` of :class:`pipeline.PipelineRunner`)."""
    return torch.device(runner_kwargs.get("device") or "cpu").type == "cpu"


def own_tensors(plan: PartitionPlan, rank: int, ranks: int) -> set[str]:
    """Names of the parameters and buffers that pipeline rank ``rank`` of ``ranks`` holds: those of the stages of
    ``plan`` it runs (stage s on rank s mod ranks)."""
    return plan.stage_tensors([s for s in range(plan.num_stages) if s % ranks == rank])


def stages_per_rank(plan: PartitionPlan, ranks: int, microbatches: int, schedule: str | None, fix: str) -> int:
    """How many stages of ``plan`` each of a pipeline's ``ranks`` runs: 1, or more (stage s on rank s mod ``ranks``)
    when the plan has a multiple of ``ranks`` stages (a model's ``pipe_split()`` markers'), run under the interleaved
    virtual schedule. ``schedule``, the one the caller chose (None: the default), must then be that one, else an error
    whose ``fix`` says how in the caller's terms (``{stages}``: the plan's stages); and the schedule takes
    ``microbatches`` in rounds of ``ranks``."""
    v, rest = divmod(plan.num_stages, ranks)
    if rest or v <= 1:
        return 1  # one stage per rank, or a count the runner refuses with its own message
    what = stages_note(plan.method, plan.num_stages, ranks)[0]
    if schedule not in (None, VIRTUAL_SCHEDULE):
        raise ValueError(f"the plan has {what}, which run under the {VIRTUAL_SCHEDULE!r} schedule, but the schedule "
                         f"asked for is {schedule!r}, which runs one stage per rank: "
                         f"{fix.format(stages=plan.num_stages)}")
    if microbatches % ranks:
        more = microbatches - microbatches % ranks + ranks
        fewer = f"{microbatches - microbatches % ranks} or " if microbatches > ranks else ""
        raise ValueError(f"the plan has {what}, which take the microbatches in rounds of {ranks}: microbatches="
                         f"{microbatches} is not a multiple of {ranks}; use {fewer}{more} microbatches")
    return v


def on_ranks(plan: PartitionPlan, ranks: int) -> PartitionPlan:
    """``plan`` recording the pipeline's ``ranks`` when they are fewer than its stages (virtual stages), so that its
    summary, and a partial checkpoint that carries it, say how its stages are placed (:func:`plan_ranks`)."""
    if plan.num_stages <= ranks:
        return plan
    return replace(plan, extra={**plan.extra, RANKS_KEY: ranks})


def plan_ranks(plan: PartitionPlan) -> int:
    """The pipeline ranks ``plan`` ran on: those :func:`on_ranks` recorded, else one per stage."""
    return int(plan.extra.get(RANKS_KEY, plan.num_stages))


def bind_to(plan: PartitionPlan, graph: OpGraph, source: str, ranks: int) -> PartitionPlan:
    """``plan`` (from a file or a checkpoint) bound to ``graph``, checked to cut it into the stages a pipeline of
    ``ranks`` ranks runs: the model's ``pipe_split()`` markers' (:func:`stages_on_ranks`), else one per rank."""
    return plan.bind(graph, source, stages_on_ranks(graph, ranks) or ranks)


def smp_runner(st: State, model: PipelineModel, plan: PartitionPlan, checkpoint_modules: list[str],
               initialise: bool = True) -> PipelineRunner:
    """This rank's pipeline of ``plan`` as the smp config sets it up (``smp.DistributedModel`` at partitioning,
    and when re-partitioned in flight, :mod:`smp.engine.migrate`): the model holds only this rank's tensors, initialised
    where they were created without weights (unless weights are about to be loaded), then the runner."""
    cfg = st.config
    pp = st.topology.pp
    v = stages_per_rank(plan, pp, cfg.microbatches, None if cfg.schedule == "1f1b" else cfg.pipeline,
                        "use the config's pipeline 'interleaved' (the default), or pipeline_parallel_degree="
                        "{stages} (one stage per rank)")
    plan = on_ranks(plan, pp)
    schedule = VIRTUAL_SCHEDULE if v > 1 else cfg.schedule
    if v > 1 and st.rank == 0:
        print(f"smp: {stages_note(plan.method, plan.num_stages, pp)[0]}", file=sys.stderr, flush=True)
    install_shards(model.module, plan.traced_graph())
    local = own_tensors(plan, st.topology.pp_rank(st.rank), pp)
    shard_of = shard_owners(plan.traced_graph(), st.topology.tp_rank(st.rank))
    gather = None
    if st.sdp_mesh is not None:  # sharded data parallelism: this rank's shards, made one module at a time
        sharded = to_shard(model.module, local, plan.shared_params, cfg.sdp_param_persistence_threshold)
        if st.rank == 0:  # where the engine first knows the parameters; once for the job: rank 0 writes the console
            warn_if_nothing_sharded(plan, cfg.sharded_data_parallel_degree, cfg.sdp_param_persistence_threshold)
        shard_own_share(model.module, local, sharded, st.sdp_mesh, st.device, initialise, shard_of, st.optimizer,
                        also=[plan.traced_graph().fx.module])
        gather = GatheredParams()
    else:
        keep_own_share(model.module, local, st.device, initialise, shard_of=shard_of)
    runner = PipelineRunner(plan, schedule=schedule, microbatches=cfg.microbatches, virtual_stages=v,
                          max_in_flight=cfg.active_microbatches if schedule == "1f1b" else None,
                          pipelines=st.topology.pipelines(), device=st.device, timeout_s=cfg.timeout_s,
                          checkpoint_modules=checkpoint_modules, autocast=model.traced_autocast,
                          tp_groups=st.topology.tp_groups() if st.topology.tp > 1 else None,
                          model=model.module, shape_cache_size=cfg.shape_cache_size,
                          tensorboard=cfg.tensorboard, offload_activations=cfg.offload_activations,
                          activation_loading_horizon=cfg.activation_loading_horizon, gather=gather)
    if runner.split_model.program.ep_comm is not None:  # the experts' all-to-alls run on this rank's ep group
        runner.split_model.program.ep_comm.bind(st.ep_group)
    if runner.split_model.program.cp_comm is not None:  # the gathers of keys and values run on this rank's cp group
        runner.split_model.program.cp_comm.bind(st.cp_group)
    return runner
