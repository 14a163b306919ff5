"""``@smp.step``: the user's function runs once per microbatch, and its ``model(x)`` / ``model.backward(loss)``
calls drive the pipeline schedule.

The difficulty is 1F1B: microbatch k's backward must run before microbatch k+p's forward, yet the loss
code between ``model(x)`` and ``model.backward(loss)`` needs the real output, which exists only on the
last stage. So each microbatch's call of the user function runs in its own thread (a suspended context):

* ``model(*args)`` records the microbatch's model inputs and blocks. The executor (main thread) takes the
  inputs when the schedule first needs that microbatch, and on the last stage hands the real outputs back
  when the forward of the last stage is done; the thread then computes the loss and calls
  ``model.backward(loss)``, which hands the loss to the executor for the backward the schedule runs later.
* On earlier stages nothing downstream of ``model(...)`` is needed: the thread stops there and the
  function's return values come from the last stage, broadcast over the model-parallel group
  (:mod:`smp.engine.step_values`).

Grad mode and autocast are thread-local in torch, so both are captured at ``model(...)`` and re-entered
around the stage forwards. Returned tensors come back as :class:`StepOutput`, Python values as lists, one
per returned leaf.

As in SMP v1, the arguments of pp_rank 0 are the truth: this rank splits its own into microbatches only when
it is pp_rank 0; elsewhere :mod:`smp.engine.execution` replaces them with pp_rank 0's first
(:mod:`smp.engine.step_values`).

Every wait of the main thread for a microbatch's thread is bounded by the config's ``timeout_s``: user code
that stalls inside the step (before ``model(...)``, in the loss, after ``model.backward``) ends the step
with :class:`StepTimeoutError` on its rank, and the other ranks with an error naming that rank.
"""
from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from partitioner.cost.throughput import Throughput
from pipeline import microbatch
from smp.engine.execution import run_step
from smp.engine.step_run import StepRun, StepTimeoutError
from smp.engine.step_values import detach
from smp.runtime import state

__all__ = ["step", "StepOutput", "StepTimeoutError"]


class StepOutput:
    """One returned value of a step, per microbatch, with SMP's reductions. ``throughput``: the step's samples/s,
    tokens/s, model FLOP/s per device and MFU (:class:`partitioner.cost.throughput.Throughput`), the same on every
    rank."""

    def __init__(self, outputs: list[Any], throughput: Throughput | None = None):
        self.outputs = list(outputs)
        self.throughput = throughput

    def _tensors(self) -> list[torch.Tensor]:
        return [o if isinstance(o, torch.Tensor) else torch.as_tensor(o) for o in self.outputs]

    def reduce_mean(self) -> torch.Tensor:
        """The mean over microbatches (elementwise for tensors)."""
        return torch.stack(self._tensors()).mean(dim=0)

    def reduce_sum(self) -> torch.Tensor:
        """The sum over microbatches."""
        return torch.stack(self._tensors()).sum(dim=0)

    def concat(self) -> torch.Tensor:
        """The microbatches' values joined along dimension 0 (the batch, for per-sample outputs)."""
        return torch.cat(self._tensors())

    def stack(self) -> torch.Tensor:
        """The microbatches' values stacked along a new dimension 0."""
        return torch.stack(self._tensors())

    def detach(self) -> StepOutput:
        """The same values with every tensor detached from its autograd graph, as a new StepOutput (SMP's
        ``StepOutput.detach()``; Hugging Face's ``Trainer`` calls ``.detach().concat()`` on evaluation outputs)."""
        return StepOutput(detach(self.outputs), self.throughput)

    def __len__(self) -> int:
        return len(self.outputs)

    def __repr__(self) -> str:
        return f"StepOutput({self.outputs!r})"


def _wrap(results: list[Any], throughput: Throughput | None = None) -> Any:
    """Per-microbatch results -> the same structure with, at every leaf, a StepOutput where the leaf is a
    tensor and a plain list (one value per microbatch) where it is a Python value, as in SMP v1, so that
    ``sum(loss_batch)`` works on a returned ``loss.item()``."""
    flat = [pytree.tree_flatten(r) for r in results]
    spec = flat[0][1]
    for _, s in flat[1:]:
        if s != spec:
            raise RuntimeError(f"the @smp.step function returned differently shaped values across microbatches: "
                               f"{spec} vs {s}")
    if not flat[0][0] and results[0] is None:
        return None
    columns = [[leaves[i] for leaves, _ in flat] for i in range(len(flat[0][0]))]
    wrapped = [StepOutput(c, throughput) if any(isinstance(v, torch.Tensor) for v in c) else c for c in columns]
    return pytree.tree_unflatten(wrapped, spec)


def step(fn: Callable | None = None, *, non_split_inputs: list[str] | tuple[str, ...] = (),
         input_split_axes: dict[str, int] | None = None, detach_outputs: bool = True) -> Callable:
    """Decorate a training/eval step; see the module docstring."""
    if fn is None:
        return functools.partial(step, non_split_inputs=non_split_inputs, input_split_axes=input_split_axes,
                                 detach_outputs=detach_outputs)
    arg_names = [p.name for p in inspect.signature(fn).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    memo: dict = {}  # across calls of this function: how its return values travel (broadcast_results), warnings

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        st = state.get()
        model = st.model
        if model is None:
            raise RuntimeError("create smp.DistributedModel(model) before calling an @smp.step function")
        if st.in_step is not None:
            raise RuntimeError("@smp.step functions cannot be nested or run concurrently")
        split = functools.partial(microbatch.split, num_microbatches=st.config.microbatches,
                                  non_split_inputs=non_split_inputs, input_split_axes=input_split_axes,
                                  arg_names=arg_names)
        run = StepRun(st, fn, (args, kwargs), split, model, memo, detach_results=detach_outputs)
        if st.topology.pp_rank(st.rank) == 0:  # elsewhere pp_rank 0's arguments replace these (smp.engine.execution)
            run.use_inputs(args, kwargs)  # a batch that does not split fails here, before any communication
        st.in_step = run
        try:
            results = run_step(st, model, run)
        finally:
            st.in_step = None
        model.run_post_step_hooks()
        if run.backward_missing and not memo.get("warned_backward"):
            memo["warned_backward"] = True
            warnings.warn(f"the @smp.step function {run.name} ran in training mode (model.train(), gradients "
                          "enabled) but did not call model.backward(loss), so gradients were not computed; call "
                          "model.backward(loss) in it, or run it under model.eval() or torch.no_grad() if it only "
                          "evaluates", UserWarning, stacklevel=2)
        return _wrap(results, run.throughput)  # detached per microbatch by the run when detach_outputs

    return wrapper
