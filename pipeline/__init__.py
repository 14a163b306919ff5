"""Pipeline runtime: schedules as data, an executor over torch.distributed P2P, a simulator and timelines.

    runner = pipeline.PipelineRunner.from_model(model, (x,), microbatches=8, schedule="1f1b")
    result = runner.step((x,), target=y, loss_fn=loss_fn)
"""
from .microbatch import BatchSplitError, merge, split
from .p2p import PeerError
from .runner import PipelineRunner, StepResult
from .schedule import Action, Schedule, ScheduleError, make_schedule, validate

__all__ = ["PipelineRunner", "StepResult", "PeerError", "Action", "Schedule", "ScheduleError", "make_schedule",
           "validate", "split", "merge", "BatchSplitError"]
