"""Pipeline runtime: schedules as data, an executor over torch.distributed P2P, a simulator and timelines.

    plan = partitioner.partition(model, 2, example_inputs=(x_microbatch,), microbatches=8)
    runner = pipeline.PipelineRunner(plan, microbatches=8, schedule="1f1b")
    result = runner.step((x,), target=y, loss_fn=loss_fn)

One concept per file: ``schedule`` (the IR and its generators), ``lowering`` (sends and receives as actions),
``simulate`` (replay: validation and timing), ``microbatch`` (split and merge), ``p2p`` (the transport), ``sends``
(sends in flight, each freed once it has gone), ``zero_bubble`` (the split backward), ``row_grads`` (the gradients
of weights read by rows, summed over the step's microbatches), ``offload`` (checkpointed stages' inputs to host
memory and back), ``executor`` (walking one rank's actions), ``runner`` (:class:`PipelineRunner`), ``timeline``
(recording and drawing), ``clock`` (the ranks' clock offsets), ``profiler`` (:class:`~pipeline.profiler.Profiler`:
which steps to record, one merged trace) and ``profile_description`` (what a profile directory's ``profile.json``
says of the run, and the simulator's prediction of it).
"""
from partitioner.errors import EngineError
from pipeline.lowering import fifo_violations, lower
from pipeline.microbatch import BatchSplitError, merge, split
from pipeline.p2p import PeerError
from pipeline.runner import PipelineRunner, StepResult
from pipeline.schedule import Action, Schedule, ScheduleError, make_schedule
from pipeline.simulate import simulate, validate
from pipeline.tensorboard import TensorBoardWriter
from pipeline.timeline import to_text

__all__ = ["PipelineRunner", "StepResult", "PeerError", "Action", "Schedule", "ScheduleError", "make_schedule",
           "lower", "fifo_violations", "validate", "simulate", "split", "merge", "BatchSplitError", "EngineError",
           "TensorBoardWriter", "to_text"]
