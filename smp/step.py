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
  (:mod:`smp.step_values`).

Grad mode and autocast are thread-local in torch, so both are captured at ``model(...)`` and re-entered
around the stage forwards. Returned tensors come back as :class:`StepOutput`, Python values as lists, one
per returned leaf.

As in SMP v1, the arguments of pp_rank 0 are the truth: this rank splits its own into microbatches only when
it is pp_rank 0; elsewhere :mod:`smp.execution` replaces them with pp_rank 0's first (:mod:`smp.step_values`).

Every wait of the main thread for a microbatch's thread is bounded by the config's ``timeout_s``: user code
that stalls inside the step (before ``model(...)``, in the loss, after ``model.backward``) ends the step
with :class:`StepTimeoutError` on its rank, and the other ranks with an error naming that rank.
"""
from __future__ import annotations

import functools
import inspect
import threading
import warnings
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from partitioner.errors import EngineError
from pipeline import microbatch

from . import precision, profiling, state
from .step_values import detach

__all__ = ["step", "StepOutput", "StepTimeoutError"]


class _Abandon(BaseException):
    """Ends the user's function on ranks that do not hold the last stage, or when the step failed
    (BaseException: user code that catches Exception must not swallow it)."""


class StepTimeoutError(EngineError, TimeoutError):
    """The ``@smp.step`` function did not get to its next hand-over with the pipeline within ``timeout_s``."""


@dataclass
class _Call:
    args: tuple
    kwargs: dict
    grad_enabled: bool
    autocast: tuple[str, torch.dtype] | None


@dataclass
class _Micro:
    index: int
    cond: threading.Condition = field(default_factory=threading.Condition)
    call: _Call | None = None
    outputs: Any = None
    have_outputs: bool = False
    loss: torch.Tensor | None = None
    backward_called: bool = False
    backward_outside: bool = False
    finished: bool = False
    abandoned: bool = False    # the step failed: a thread waiting in model(...) gives up
    result: Any = None
    error: BaseException | None = None

    def wait(self, ready: Callable[[], bool], timeout_s: float | None = None) -> bool:
        with self.cond:
            return self.cond.wait_for(ready, timeout_s)

    def update(self, **changes: Any) -> None:
        with self.cond:
            for k, v in changes.items():
                setattr(self, k, v)
            self.cond.notify_all()


class StepOutput:
    """One returned value of a step, per microbatch, with SMP's reductions."""

    def __init__(self, outputs: list[Any]):
        self.outputs = list(outputs)

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

    def __len__(self) -> int:
        return len(self.outputs)

    def __repr__(self) -> str:
        return f"StepOutput({self.outputs!r})"


def _current() -> _Micro | None:
    """The microbatch the calling thread runs in the running step, if any."""
    run = state.get().in_step
    return None if run is None else run.threads.get(threading.get_ident())


def model_call(model: Any, args: tuple, kwargs: dict) -> Any:
    """``DistributedModel.__call__`` inside a step thread."""
    micro = _current()
    if micro is None:
        raise RuntimeError("smp.DistributedModel was called outside an @smp.step function: put the forward "
                           "and model.backward(loss) inside a function decorated with @smp.step")
    if micro.call is not None:
        raise RuntimeError("the DistributedModel was called twice in one @smp.step microbatch; call it once per "
                           "step (run other modules, such as a frozen teacher, as plain torch modules)")
    micro.update(call=_Call(args, kwargs, torch.is_grad_enabled(), precision.active_autocast()))
    if not model.is_last_stage_rank():
        raise _Abandon()
    micro.wait(lambda: micro.have_outputs or micro.abandoned)
    if micro.abandoned:
        raise _Abandon()
    return micro.outputs


def model_backward(tensors: Any, grad_tensors: Any = None) -> None:
    """``DistributedModel.backward`` inside a step thread: hand the loss to the schedule."""
    micro = _current()
    if micro is None:
        raise RuntimeError("model.backward() was called outside an @smp.step function")
    if micro.backward_called:
        raise RuntimeError("model.backward() was called twice for one microbatch")
    if grad_tensors is None:
        loss = tensors if isinstance(tensors, torch.Tensor) else sum(t.sum() for t in tensors)
        if loss.numel() != 1:
            raise RuntimeError(f"model.backward(loss) needs a scalar loss, got shape {tuple(loss.shape)}; pass "
                               "model.backward(tensors, grad_tensors) for non-scalar outputs")
    else:  # d/dθ Σ <t, g> = Σ J_tᵀ g: the same gradients as autograd.backward(tensors, grads)
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        gs = [grad_tensors] if isinstance(grad_tensors, torch.Tensor) else list(grad_tensors)
        loss = sum((t * g.detach()).sum() for t, g in zip(ts, gs))
    micro.update(loss=loss, backward_called=True)


class _StepRun:
    """One call of a step function: its microbatch threads and the hooks the executor calls."""

    def __init__(self, fn: Callable, inputs: tuple[tuple, dict], split: Callable[[tuple, dict], list],
                 model: Any, timeout_s: float, memo: dict):
        self.fn = fn
        self.name = getattr(fn, "__name__", repr(fn))
        self.inputs = inputs  # this rank's (args, kwargs); on a pipeline pp_rank 0's replace them (use_inputs)
        self.split = split
        self.mbs: list[tuple[tuple, dict]] = []
        self.model = model
        self.timeout_s = timeout_s
        self.memo = memo  # per step function, across calls: how arguments and results travel, warnings given
        n = state.get().config.microbatches
        self.micros = [_Micro(k) for k in range(n)]
        self.started = [False] * n
        self.threads: dict[int, _Micro] = {}  # thread id -> the microbatch it runs
        self.backward_missing = False  # set by the model: a training step that never called model.backward
        # Grad mode and autocast are thread-local: the caller's (``with torch.no_grad(): step(...)``) must
        # hold in the microbatch threads too.
        self.grad_enabled = torch.is_grad_enabled()
        self.autocast = precision.active_autocast() or precision.configured_autocast()  # config fp16/bf16

    def use_inputs(self, args: tuple, kwargs: dict) -> None:
        """Run the step on these arguments, split into microbatches."""
        self.inputs = (args, kwargs)
        self.mbs = self.split(args, kwargs)

    def _thread(self, micro: _Micro) -> None:
        self.threads[threading.get_ident()] = micro
        a, kw = self.mbs[micro.index]
        ac = self.autocast
        try:
            with torch.set_grad_enabled(self.grad_enabled), \
                    (torch.autocast(ac[0], dtype=ac[1]) if ac is not None else nullcontext()):
                result = self.fn(*a, **kw)
            micro.update(result=result)
        except _Abandon:
            pass
        except BaseException as exc:  # handed to the main thread, which raises it
            micro.update(error=exc)
        finally:
            del self.threads[threading.get_ident()]
            micro.update(finished=True)

    def _wait(self, micro: _Micro, ready: Callable[[], bool], doing: str) -> None:
        if not micro.wait(ready, self.timeout_s):
            if doing == "did not return" and micro.backward_called:
                doing += " after model.backward(loss)"
            raise StepTimeoutError(
                f"rank {state.get().rank}: the @smp.step function {self.name} (microbatch {micro.index}) {doing} "
                f"within {self.timeout_s:g} s, and the pipeline cannot go on without it; if it is only slow, raise "
                "timeout_s in the smp config (or the SMP_TIMEOUT_S environment variable)")

    def call_of(self, k: int) -> _Call:
        """Start microbatch k's call if needed and wait until it reaches ``model(...)``."""
        micro = self.micros[k]
        if not self.started[k]:
            self.started[k] = True
            state.get().workers.submit(lambda: self._thread(micro))
        self._wait(micro, lambda: micro.call is not None or micro.finished, "did not reach model(...)")
        if micro.call is None:
            if micro.error is not None:
                raise micro.error
            raise RuntimeError("the @smp.step function returned without calling the DistributedModel")
        return micro.call

    def before_forward(self, k: int) -> Any:
        call = self.call_of(k)  # microbatch k's thread may not have reached model(...) yet: its autocast is there
        if call.autocast is not None:
            return torch.autocast(call.autocast[0], dtype=call.autocast[1])
        return nullcontext()

    def loss_hook(self, k: int, flat_outputs: tuple) -> torch.Tensor | None:
        """On the last stage: give microbatch k its outputs, wait for its loss (or for it to finish)."""
        self.call_of(k)  # the last stage may read no model input, so its thread may not have started
        micro = self.micros[k]
        outputs = pytree.tree_unflatten(list(flat_outputs), self.model.out_spec)
        # The hook lives on as long as the output's grad_fn, which holds it from C++, out of the garbage
        # collector's sight: a strong reference to the microbatch (which holds the outputs) would make a cycle
        # that is never freed, and with it every step's outputs and activations. Hence a weak one.
        ref = weakref.ref(micro)

        def hook(grad: torch.Tensor) -> torch.Tensor:  # fires if the user runs autograd themselves
            m = ref()
            if m is not None and not m.backward_called:
                m.backward_outside = True
            return grad

        for t in flat_outputs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(hook)
        micro.update(outputs=outputs, have_outputs=True)
        self._wait(micro, lambda: micro.backward_called or micro.finished,
                   "got the model's outputs but neither called model.backward(loss) nor returned")
        if micro.error is not None:
            raise micro.error
        if micro.backward_outside:
            raise RuntimeError("loss.backward() was called inside an @smp.step function: call "
                               "model.backward(loss) instead, so the pipeline runs the backward pass")
        if micro.loss is None:
            return None
        return micro.loss / len(self.micros) if self.model.average_grads_across_microbatches else micro.loss

    def results(self) -> list[Any]:
        for k, started in enumerate(self.started):
            if not started:  # microbatches this rank never needed (no local stage reads model inputs)
                self.call_of(k)
        for micro in self.micros:
            self._wait(micro, lambda m=micro: m.finished, "did not return")
            if micro.error is not None:
                raise micro.error
            if micro.backward_outside:
                raise RuntimeError("loss.backward() was called inside an @smp.step function: call "
                                   "model.backward(loss) instead, so the pipeline runs the backward pass")
        return [m.result for m in self.micros]

    def without_backward(self) -> bool:
        """Did some microbatch's call return without calling ``model.backward`` (last stage only)?"""
        return any(m.finished and m.error is None and not m.backward_called for m in self.micros)

    def abandon(self) -> None:
        """The step failed: threads still waiting in ``model(...)`` give up (they would wait forever)."""
        for micro in self.micros:
            micro.update(abandoned=True)


def _wrap(results: list[Any]) -> Any:
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
    columns = [StepOutput(c) if any(isinstance(v, torch.Tensor) for v in c) else c for c in columns]
    return pytree.tree_unflatten(columns, spec)


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
        run = _StepRun(fn, (args, kwargs), split, model, st.config.timeout_s, memo)
        if st.topology.pp_rank(st.rank) == 0:  # elsewhere pp_rank 0's arguments replace these (smp.execution)
            run.use_inputs(args, kwargs)  # a batch that does not split fails here, before any communication
        st.in_step = run
        try:
            results = profiling.run_step(model, run)  # model.run_step(run), profiled (smp.profile)
        finally:
            st.in_step = None
        model.run_post_step_hooks()
        if run.backward_missing and not memo.get("warned_backward"):
            memo["warned_backward"] = True
            warnings.warn(f"the @smp.step function {run.name} ran in training mode (model.train(), gradients "
                          "enabled) but did not call model.backward(loss), so gradients were not computed; call "
                          "model.backward(loss) in it, or run it under model.eval() or torch.no_grad() if it only "
                          "evaluates", UserWarning, stacklevel=2)
        if detach_outputs:
            results = detach(results)
        return _wrap(results)

    return wrapper
