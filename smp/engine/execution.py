"""One call of an ``@smp.step`` function on this rank, run as a unit.

The step announces itself to the rank's pipeline (:mod:`smp.runtime.call_log`), takes pp_rank 0's arguments
(SMP v1: they are the truth, :func:`smp.engine.step_values.share_inputs`; other pp ranks may pass placeholders) once a
tensor-parallel group's are regrouped or, under ``prescaled_batch``, checked to be one batch on the first call of each
step function (:mod:`smp.engine.tp_batch`), partitions the model on its first call (and gives the data-parallel
replicas the same weights, the first replica's: :mod:`smp.engine.replicas`), walks this rank's schedule while the
microbatches' threads run the user's function (:mod:`smp.engine.step_function`), averages gradients over the
data-parallel replicas in buckets while the backward runs (:mod:`smp.engine.grad_averaging`) and brings the last
stage's return values to every rank (:mod:`smp.engine.step_values`).
Every wait in it is bounded by ``timeout_s``. When anything in it fails — here, or on a peer, seen as a closed
connection or a silence — this rank releases the step's threads, explains a silent peer by the smp call that peer is
in instead, leaves the failure note and closes smp's process groups (:meth:`smp.runtime.state.State.report_failure`),
so that every rank ends the step with an error naming the rank that failed first.

With the config's ``"tensorboard"`` key each step's loss, throughput and memory go to TensorBoard
(:mod:`pipeline.tensorboard`). Around a training step it hands the model and the step to the training-health
checks (:mod:`smp.health.session`), which may end the job between steps. Between steps the step also owns two
decisions a profile informs: it records the step when a profile window is open (:mod:`smp.profiling.session`), and
with ``"auto_repartition"`` it moves the model to a better plan once the re-planner's window is complete
(:mod:`smp.engine.repartition`). A step whose microbatches have other shapes than the last one runs the stages of
its shape class (:mod:`pipeline.shape_classes`).
"""
from __future__ import annotations

import time
from typing import Any

import torch

from partitioner.capture.program import flatten_inputs
from pipeline import PeerError
from pipeline.p2p import named_failures
from smp.engine.materialize import tensor_ids
from smp.engine.pipeline_model import PipelineModel
from smp.engine.repartition import repartition_in_flight
from smp.engine.replicas import sync_replicas
from smp.engine.step_run import StepRun
from smp.engine.step_values import broadcast_values, share_inputs
from smp.engine.tp_batch import check_one_batch, regroup_batch
from smp.engine.tp_shards import sharded_names
from smp.health.session import session_of as health_of
from smp.profiling.session import session_of
from smp.runtime.state import State

__all__ = ["run_step"]


def run_step(st: State, model: PipelineModel, run: StepRun) -> list[Any]:
    """Run ``run`` on ``model`` on this rank, profiled when a profile records, after re-partitioning when
    ``"auto_repartition"`` is due; the per-microbatch return values, on every rank of the pipeline."""
    session = session_of(st)
    due = session.repartition_due()
    if due is not None:
        repartition_in_flight(st, model, *due)
        session.repartition_done(st)
    checks = health_of(st)
    train = model.module.training and run.grad_enabled
    checks.before(st, model, train)  # judges the last check: raises TrainingStopped when a rule stops the job
    session.before(model)
    try:
        results = _guarded(st, model, run)
    except BaseException:
        session.after(ok=False)
        checks.after(st, model, run, train, ok=False)
        raise
    session.after(ok=True)
    checks.after(st, model, run, train, ok=True)
    _log_tensorboard(model, run)
    return results


def _log_tensorboard(model: PipelineModel, run: StepRun) -> None:
    """With the config's ``"tensorboard"`` directory: this rank's scalars of the step (the mean loss handed to
    ``model.backward`` on the last stage's rank, as scaled under fp16; the throughput and memory on every rank)."""
    writer = model.runner.tensorboard if model.runner is not None else None
    if writer is not None:
        losses = run.losses()
        writer.log(float(torch.stack(losses).mean()) if losses else None, run.throughput)


def _guarded(st: State, model: PipelineModel, run: StepRun) -> list[Any]:
    st.group("pipeline")  # after a failure closed the groups, say so rather than fail on a closed group
    call = f"@smp.step {run.name}"
    st.calls["pipeline"].announce(call)
    if not model.partitioned:
        st.calls["world"].announce(call)  # the first step partitions: the plan goes to every rank
    try:
        return _run(st, model, run, call)
    except BaseException as exc:
        run.abandon()
        culprit = exc.culprit if isinstance(exc, PeerError) else None
        why = next((x for x in (st.calls[k].explain(culprit) for k in ("pipeline", "data-parallel")) if x), "") \
            if culprit is not None else ""
        if why:  # a peer that did not answer: say where it is instead
            exc = PeerError(f"{exc}; {why}", culprit=culprit)
        st.report_failure(exc)
        if why:
            raise exc from None
        raise


def _run(st: State, model: PipelineModel, run: StepRun, call: str) -> list[Any]:
    start = time.perf_counter()
    if st.topology.pp_rank(st.rank) == 0:  # pp_rank 0's arguments are the pipeline's
        # A tp group, then a cp group (of tp groups), runs one batch: by SMP v1's default each rank read its own
        # and the group runs on all of them, else (prescaled_batch) the group read one: say so if it did not.
        groups = [("tp", st.group("tensor-parallel"), st.ranks("tensor-parallel"))] if st.topology.tp > 1 else []
        for axis, group, ranks in groups + ([("cp", st.cp_group, st.cp_ranks)] if st.cp_ranks else []):
            if not st.config.prescaled_batch:
                run.use_inputs(*regroup_batch(*run.inputs, group, len(ranks), False, axis))
            elif not run.memo.get(f"one_batch_checked_{axis}"):
                check_one_batch(*run.inputs, group, list(ranks), axis)
                run.memo[f"one_batch_checked_{axis}"] = True
    if st.topology.pp > 1:
        _take_first_stage_inputs(st, run)
    if not model.partitioned:
        model.partition(run.call_of(0))
        sync_replicas(st, model)  # the first replica's weights on every replica, as SMP's broadcast at partitioning
        start = time.perf_counter()  # the first step's figures leave partitioning out
    runner = model.runner
    assert runner is not None  # partitioned
    runner.train(model.module.training)  # model.eval() turns dropout off and BatchNorm to running statistics
    train = model.module.training and run.call_of(0).grad_enabled
    if run.call_of(0).autocast != model.traced_autocast:
        def name(ac: Any) -> str:
            return f"torch.autocast({ac[0]!r}, dtype={ac[1]})" if ac else "no autocast"
        raise RuntimeError(f"the model was partitioned under {name(model.traced_autocast)} but this step runs "
                           f"under {name(run.call_of(0).autocast)}: the tensors that cross pipeline stages have "
                           "the dtypes of the first step, so call the model under the same autocast setting in "
                           "every step")
    # Every rank of the pipeline has pp_rank 0's arguments: each picks the stages of the same shape class.
    sm = runner.specialise(run.call_of(0).args, run.call_of(0).kwargs)

    def inputs_of(k: int) -> dict[str, Any]:
        mb = run.call_of(k)
        flat = flatten_inputs(sm.program, mb.args, mb.kwargs)
        sm.check_inputs(flat)
        return {n: (v.to(st.device) if isinstance(v, torch.Tensor) else v)
                for n, v in zip(sm.program.input_names, flat)}

    last = model.is_last_stage_rank()
    replicas = train and st.topology.dp > 1
    params = [(n, p) for n, p in model.local_named_parameters() if p.requires_grad] if replicas else []
    if replicas:  # gradients averaged over the replicas in buckets, launched as the last backward fills them
        # a tp rank's shards average over the replicas of that shard only; whole parameters over every replica
        shards = tensor_ids(model.module, sharded_names(runner.plan.traced_graph())) if st.topology.tp > 1 else set()
        model.grad_averaging.begin(st, runner, params, shards, call)
    # The step function gets each microbatch's outputs from the loss hook; the runner keeps none.
    runner.run_microbatches(inputs_of, run.loss_hook if last else None, train, run.before_forward,
                            keep_outputs=False)
    local = run.results()
    if replicas:
        model.grad_averaging.end(st, runner, [p for _, p in params])
    src = runner.ranks[-1]
    waiting_on = [src] if not last else [r for r in runner.ranks if r != st.rank]
    with named_failures("receiving the step's results from the last stage" if not last else
                        "sending the step's results", waiting_on, st.rank, st.config.timeout_s):
        results, run.backward_missing = broadcast_values(
            local if last else None, src, runner.transport.group, run.memo.setdefault("results", {}), st.device,
            flag=last and train and run.without_backward())
    calls = [run.call_of(k) for k in range(len(run.micros))]
    batch = [dict(zip(sm.program.input_names, flatten_inputs(sm.program, c.args, c.kwargs))) for c in calls]
    run.throughput = runner.throughput(time.perf_counter() - start, batch, train)
    return results


def _take_first_stage_inputs(st: State, run: StepRun) -> None:
    """Replace this rank's step arguments with those of pp_rank 0 of its pipeline (which sends them)."""
    ranks = st.ranks("pipeline")
    src = ranks[0]
    waiting_on = [src] if st.rank != src else ranks[1:]
    with named_failures("receiving the step's arguments from pp_rank 0" if st.rank != src else
                        "sending the step's arguments to the pipeline", waiting_on, st.rank, st.config.timeout_s):
        inputs = share_inputs(run.inputs, src, st.group("pipeline"), run.memo.setdefault("inputs", {}), st.rank,
                              st.device)
    if st.rank != src:
        run.use_inputs(*inputs)
