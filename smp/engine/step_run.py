"""The threads of one ``@smp.step`` call: each microbatch's call of the user's function runs in its own
thread, and its ``model(x)`` / ``model.backward(loss)`` calls hand over to the pipeline schedule that the
main thread walks (:mod:`smp.engine.execution`). See :mod:`smp.engine.step_function` for why (1F1B with the
loss code between forward and backward).

Grad mode and autocast are thread-local in torch, so both are captured at ``model(...)`` and re-entered
around the stage forwards. Every wait of the main thread for a microbatch's thread is bounded by the config's
``timeout_s``: user code that stalls inside the step (before ``model(...)``, in the loss, after
``model.backward``) ends the step with :class:`StepTimeoutError` on its rank.
"""
from __future__ import annotations

import threading
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from partitioner.errors import EngineError
from smp.engine import mixed_precision as precision
from smp.engine.step_values import detach
from smp.runtime.state import State

__all__ = ["StepRun", "MicrobatchCall", "StepTimeoutError", "model_call", "model_backward"]


class _Abandon(BaseException):
    """Ends the user's function on ranks that do not hold the last stage, or when the step failed
    (BaseException: user code that catches Exception must not swallow it)."""


class StepTimeoutError(EngineError, TimeoutError):
    """The ``@smp.step`` function did not get to its next hand-over with the pipeline within ``timeout_s``."""


@dataclass
class MicrobatchCall:
    args: tuple
    kwargs: dict
    grad_enabled: bool
    autocast: tuple[str, torch.dtype] | None


@dataclass
class _Micro:
    index: int
    cond: threading.Condition = field(default_factory=threading.Condition)
    call: MicrobatchCall | None = None
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


def _current(run: StepRun | None) -> _Micro | None:
    """The microbatch the calling thread runs in ``run`` (the running step, if any)."""
    return None if run is None else run.threads.get(threading.get_ident())


def model_call(run: StepRun | None, model: Any, args: tuple, kwargs: dict) -> Any:
    """``DistributedModel.__call__`` inside a step thread of ``run`` (the running step, if any)."""
    micro = _current(run)
    if micro is None:
        raise RuntimeError("smp.DistributedModel was called outside an @smp.step function: put the forward "
                           "and model.backward(loss) inside a function decorated with @smp.step")
    if micro.call is not None:
        raise RuntimeError("the DistributedModel was called twice in one @smp.step microbatch; call it once per "
                           "step (run other modules, such as a frozen teacher, as plain torch modules)")
    micro.update(call=MicrobatchCall(args, kwargs, torch.is_grad_enabled(), precision.active_autocast()))
    if not model.is_last_stage_rank():
        raise _Abandon()
    micro.wait(lambda: micro.have_outputs or micro.abandoned)
    if micro.abandoned:
        raise _Abandon()
    # The thread holds them from here: kept on the microbatch too, every microbatch's logits would live until the
    # step ends (8 x 51 MB for GPT-2's vocabulary), and the allocator would fetch fresh pages for all that follows.
    outputs, micro.outputs = micro.outputs, None
    return outputs


def model_backward(run: StepRun | None, tensors: Any, grad_tensors: Any = None) -> None:
    """``DistributedModel.backward`` inside a step thread of ``run``: hand the loss to the schedule."""
    micro = _current(run)
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


class StepRun:
    """One call of a step function: its microbatch threads and the hooks the executor calls."""

    def __init__(self, st: State, fn: Callable, inputs: tuple[tuple, dict],
                 split: Callable[[tuple, dict], list], model: Any, memo: dict, detach_results: bool = True):
        self.st = st
        self.fn = fn
        self.name = getattr(fn, "__name__", repr(fn))
        self.inputs = inputs  # this rank's (args, kwargs); on a pipeline pp_rank 0's replace them (use_inputs)
        self.split = split
        self.mbs: list[tuple[tuple, dict]] = []
        self.model = model
        self.timeout_s = st.config.timeout_s
        self.memo = memo  # per step function, across calls: how arguments and results travel, warnings given
        # A microbatch's returned loss (or output) holds its autograd graph, and the graph's AccumulateGrad nodes hold
        # the stage's received inputs: kept to the step's end, every microbatch's (4 x 6.4 MB per microbatch on the
        # last stage of GPT-2's split head) would be alive at once, and later ones would run in fresh pages.
        self.detach_results = detach_results
        n = st.config.microbatches
        self.micros = [_Micro(k) for k in range(n)]
        self.started = [False] * n
        self.threads: dict[int, _Micro] = {}  # thread id -> the microbatch it runs
        self.backward_missing = False  # set by the model: a training step that never called model.backward
        self.throughput: Any = None  # the step's partitioner.cost.throughput.Throughput, set by smp.engine.execution
        # Grad mode and autocast are thread-local: the caller's (``with torch.no_grad(): step(...)``) must
        # hold in the microbatch threads too.
        self.grad_enabled = torch.is_grad_enabled()
        self.autocast = precision.active_autocast() or precision.configured_autocast(st.config, st.device)

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
            micro.update(result=detach(result) if self.detach_results else result)
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
                f"rank {self.st.rank}: the @smp.step function {self.name} (microbatch {micro.index}) {doing} "
                f"within {self.timeout_s:g} s, and the pipeline cannot go on without it; if it is only slow, raise "
                "timeout_s in the smp config (or the SMP_TIMEOUT_S environment variable)")

    def call_of(self, k: int) -> MicrobatchCall:
        """Start microbatch k's call if needed and wait until it reaches ``model(...)``."""
        micro = self.micros[k]
        if not self.started[k]:
            self.started[k] = True
            self.st.workers.submit(lambda: self._thread(micro))
        self._wait(micro, lambda: micro.call is not None or micro.finished, "did not reach model(...)")
        if micro.call is None:
            if micro.error is not None:
                raise micro.error
            raise RuntimeError("the @smp.step function returned without calling the DistributedModel")
        return micro.call

    def before_forward(self, k: int) -> Any:
        """The context the stage forwards of microbatch k run in: its thread's autocast."""
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
        loss = micro.loss
        if loss is None:
            return None
        micro.update(loss=loss.detach())  # the executor holds the graph until its backward, and no longer
        return loss / len(self.micros) if self.model.average_grads_across_microbatches else loss

    def results(self) -> list[Any]:
        """Every microbatch's return value, once all have finished (their errors raised here)."""
        for k, started in enumerate(self.started):
            if not started:  # microbatches this rank never needed (no local stage reads model inputs)
                self.call_of(k)
        for micro in self.micros:
            self._wait(micro, lambda m=micro: m.finished, "did not return")  # type: ignore[misc]
            if micro.error is not None:
                raise micro.error
            if micro.backward_outside:
                raise RuntimeError("loss.backward() was called inside an @smp.step function: call "
                                   "model.backward(loss) instead, so the pipeline runs the backward pass")
        return [m.result for m in self.micros]

    def losses(self) -> list[torch.Tensor]:
        """The losses the microbatches handed to ``model.backward`` (last stage only; empty elsewhere), detached."""
        return [m.loss.detach() for m in self.micros if m.loss is not None]

    def without_backward(self) -> bool:
        """Did some microbatch's call return without calling ``model.backward`` (last stage only)?"""
        return any(m.finished and m.error is None and not m.backward_called for m in self.micros)

    def abandon(self) -> None:
        """The step failed: threads still waiting in ``model(...)`` give up (they would wait forever)."""
        for micro in self.micros:
            micro.update(abandoned=True)
