"""Tracing a torch model into an :class:`~partitioner.capture.graph.OpGraph`.

We use ``torch.export.export(..., strict=False)``: it runs the model's Python under fake tensors and
records an ATen-level graph with shapes on every node, and it handles real HF transformers models
(GPT-2, BERT, ViT, ResNet, T5) where ``torch.fx.symbolic_trace`` fails on their Python control flow. The
graph is then folded into ops (:mod:`partitioner.capture.build`) and kept, pointed at the model's own tensors, as
the program the stages are cut from (:mod:`partitioner.capture.program`).

Hugging Face generative models (Llama, Mistral, Qwen2, T5, BART, Whisper) return a ``DynamicCache`` of past
keys and values when their config's ``use_cache`` is on, which it is by default; the cache is not a tensor
tree torch.export can return, and a training step never reads it. So every config in the model has
``use_cache`` turned off for the duration of the export and restored after (:func:`_without_kv_cache`): the
stages run the traced graph, never the model's own forward, so the cache stays off in them for good.

torch.export prints on its way to an error: a warning per unbacked symbol it cannot place and the partial graph it
had traced (twice, from two nested wrappers), 30 lines and more before the error itself. That output is held while
the export runs (:func:`_held_console`): a successful export writes it to stderr as it would have, a failed one
attaches it to the :class:`TraceError` as a note, so it is in the traceback (a rank's log under ``smp launch``)
and not ahead of the one line that names the module and the fix.
"""
from __future__ import annotations

import contextlib
import copy
import io
import itertools
import logging
import sys
import threading
import traceback
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from ..errors import EngineError
from .build import build_graph
from .graph import WORK_FIELDS, OpGraph
from .program import DEVICE_ARGS, graph_modules

__all__ = ["trace", "TraceError", "CustomGradientWarning", "price_loss"]


class TraceError(EngineError, RuntimeError):
    """The model could not be traced into a static op graph; the message names the module and the fix."""


def _offending_module(model: torch.nn.Module, exc: BaseException) -> str:
    """The deepest module of ``model`` whose ``forward`` was on the stack when tracing failed."""
    names = {id(m): name or type(model).__name__ for name, m in model.named_modules()}
    found = ""
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            frame = traceback.extract_tb(tb, limit=1)[0]
            found = f"{names[id(owner)]} ({type(owner).__name__}, {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno})"
        tb = tb.tb_next
    return found or type(model).__name__


@contextmanager
def _without_kv_cache(model: torch.nn.Module) -> Iterator[None]:
    """Turn ``use_cache`` off in every (Hugging Face) config the model's modules hold, restore it after."""
    configs: dict[int, Any] = {id(c): c for c in (getattr(m, "config", None) for m in model.modules())
                               if getattr(c, "use_cache", False) is True}
    for c in configs.values():
        c.use_cache = False
    try:
        yield
    finally:
        for c in configs.values():
            c.use_cache = True


_PATCH = threading.RLock()


class CustomGradientWarning(UserWarning):
    """The model runs a custom ``torch.autograd.Function``: the traced stages differentiate its forward instead of
    running its own backward."""


@contextmanager
def _custom_functions_noted(model: torch.nn.Module) -> Iterator[None]:
    """Warn about every custom ``torch.autograd.Function`` the forward applies. torch.export (non-strict) records
    the ops of its forward, not the function, so the stages' backward is autograd's derivative of that forward:
    the same gradient when the function's backward is that derivative (a fused or memory-saving op), another one
    when it is not (a straight-through estimator, gradient scaling or reversal). Functions of torch itself (such
    as activation checkpointing's) recompute or differentiate their forward and are not reported."""
    seen: list[str] = []
    base = torch.autograd.Function
    with _PATCH:  # one trace at a time patches (and restores) the class attribute
        original = base.__dict__["apply"]
        apply = original.__func__
        tracing = threading.get_ident()

        def noting(cls: type, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == tracing and not cls.__module__.startswith("torch.") \
                    and cls.__qualname__ not in seen:
                seen.append(cls.__qualname__)
            return apply(cls, *args, **kwargs)

        base.apply = classmethod(noting)  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            base.apply = original  # type: ignore[method-assign]
    if seen:
        warnings.warn(f"{type(model).__name__} applies custom torch.autograd.Function(s) {seen}: the pipeline "
                      "stages run their forward's ops and differentiate those, not the functions' own backward; "
                      "gradients match only if that backward is the true derivative of the forward (not for a "
                      "straight-through estimator or gradient scaling). Write such a gradient as ops instead, e.g. "
                      "x * s + (x - x * s).detach() scales the gradient by s", CustomGradientWarning, stacklevel=4)


@contextmanager
def _held_console() -> Iterator[io.StringIO]:
    """What is written to stderr meanwhile, by ``print`` and by the log handlers that write to stderr (torch's),
    held in the yielded buffer in the order it came; on the way out the handlers write where they did before."""
    held = io.StringIO()
    streams = (sys.stderr, sys.__stderr__)
    handlers = {h for lg in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
                if isinstance(lg, logging.Logger) for h in lg.handlers
                if isinstance(h, logging.StreamHandler) and any(h.stream is s for s in streams)}
    before = {h: h.setStream(held) for h in handlers}
    try:
        with contextlib.redirect_stderr(held):
            yield held
    finally:
        for h, stream in before.items():
            h.setStream(stream)


def _export(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.export.ExportedProgram:
    held = io.StringIO()
    try:
        with _without_kv_cache(model), _custom_functions_noted(model), _held_console() as held:
            ep = torch.export.export(model, args, kwargs, strict=False)
        sys.stderr.write(held.getvalue())  # an export that succeeded says what it would have said
        return ep
    except Exception as exc:  # torch raises many types here; all get the same treatment
        where = _offending_module(model, exc)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        data_dependent = any(s in str(exc) for s in ("data-dependent", "data dependent", "GuardOnDataDependent",
                                                     "Could not guard", "Could not extract specialized"))
        hint = ("the model branches on tensor values (data-dependent control flow); make the branch depend on "
                "shapes or config, express it with torch.cond, or move it out of forward"
                if data_dependent else
                "check that the example inputs are what forward expects (one microbatch, the right shapes, dtypes "
                "and types); if they are, simplify that module's forward for torch.export (see the torch.export "
                "docs on non-strict tracing)")
        error = TraceError(f"cannot trace {type(model).__name__}: {type(exc).__name__} in module {where}: "
                           f"{first.rstrip('.')}. Fix: {hint}.")
        printed = held.getvalue().strip("\n")
        if printed:  # in the traceback, after the message (Python 3.11+ prints notes)
            note = f"torch.export printed before it failed ({printed.count(chr(10)) + 1} lines):\n{printed}"
            error.__notes__ = [*getattr(error, "__notes__", []), note]
        raise error from exc


def trace(model: torch.nn.Module, args: tuple | list | Any = (), kwargs: dict | None = None, *,
          loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, target: Any = None) -> OpGraph:
    """Trace ``model(*args, **kwargs)`` into an :class:`OpGraph` whose ``fx`` field can rebuild stages.

    ``loss_fn`` (with one microbatch's ``target``): the loss the pipeline computes from the model's output on
    the last stage (``PipelineRunner.step(loss_fn=...)``). It is traced too and its work priced on the graph's
    output op, so plans count it: a cross-entropy over a 50,257-token vocabulary costs as much as a third of
    GPT-2's LM head. The stages are still cut from the model alone.

    The export runs on a weightless copy of the model — its parameters, buffers and the example inputs are fake
    tensors (shapes, dtypes and a device, no data) of one fake-tensor mode — then the traced program is pointed
    back at the model's own tensors: a trace costs no memory for weights, a model built on the meta device (how a
    model larger than this machine is planned) traces like any other, on the CPU, and the exporter's caches never
    hold the model's tensors, which the engine later materialises or releases in place
    (:func:`torch.utils.swap_tensors` refuses tensors with weak references). The fakes live on the model's
    device, so autocast applies as it will at run time and the traced dtypes are the real ones."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"trace() needs a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(args, (tuple, list)):
        args = (args,)
    kwargs = dict(kwargs or {})
    device = next((t.device for t in itertools.chain(model.parameters(), model.buffers()) if not t.is_meta),
                  torch.device("cpu"))
    mode = FakeTensorMode()
    shadow = _weightless_copy(model, mode, device)
    with mode:
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device=device),
                                            (tuple(args), kwargs))
    ep = _export(shadow, tuple(args), kwargs)
    gm = ep.module()
    _point_at(gm, model)
    for graph_module in graph_modules(gm):  # the device constants the trace baked in, for set_device
        for node in graph_module.graph.nodes:
            spots = [k for k, v in itertools.chain(enumerate(node.args), node.kwargs.items())
                     if isinstance(v, torch.device) and v == device]
            if spots:
                node.meta[DEVICE_ARGS] = spots
    graph = build_graph(gm, ep.call_spec.in_spec, ep.call_spec.out_spec, model.training)
    if loss_fn is not None:
        price_loss(graph, loss_fn, target, device)
        graph.fx.loss = (loss_fn, target)
    return graph


class _Loss(torch.nn.Module):
    """``loss_fn(output, target)`` as a module, for torch.export."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor]):
        super().__init__()
        self.loss_fn = loss_fn

    def forward(self, output: Any, target: Any) -> torch.Tensor:
        return self.loss_fn(output, target)


def price_loss(graph: OpGraph, loss_fn: Callable[[Any, Any], torch.Tensor], target: Any,
               device: torch.device | str = "cpu") -> None:
    """Add the work of ``loss_fn`` on the model's (fake) output and ``target`` (traced on ``device``, as the
    model's outputs live) to the graph's output op: the last stage's work then counts the loss, forward and
    backward, while the stages are still cut from the model alone."""
    out_node = next(n for n in graph.fx.module.graph.nodes if n.op == "output")
    leaves = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in pytree.tree_leaves(out_node.args[0])]
    mode = FakeTensorMode()
    with mode:
        fakes = pytree.tree_map_only(torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device=device),
                                     (pytree.tree_unflatten(leaves, graph.fx.out_spec), target))
    ep = _export(_Loss(loss_fn), fakes, {})
    loss = build_graph(ep.module(), ep.call_spec.in_spec, ep.call_spec.out_spec, True, inputs_require_grad=True)
    graph.add_output_work({name: float(getattr(loss, name).sum()) for name in WORK_FIELDS})


def _weightless_copy(model: torch.nn.Module, mode: FakeTensorMode, device: torch.device) -> torch.nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are fake tensors of ``mode`` on ``device`` with
    the same shapes and dtypes (tied ones stay tied): the module structure and Python state, no weights.

    Other tensors a module keeps as plain attributes (a cached mask, the activation of the last forward) are
    shared with the model, not copied: their data is the user's and may be large, and one kept from a training
    forward is not a graph leaf, which ``copy.deepcopy`` refuses. A forward that reads one gets its real values,
    through a detached view of the same storage."""
    memo: dict[int, Any] = {}
    with mode:
        for t in itertools.chain(model.parameters(), model.buffers()):
            if id(t) not in memo:
                empty = torch.empty(t.shape, dtype=t.dtype, device=device)
                memo[id(t)] = torch.nn.Parameter(empty, t.requires_grad) if isinstance(t, torch.nn.Parameter) else empty
    for module in model.modules():
        for name, value in vars(module).items():
            if name in ("_parameters", "_buffers", "_modules"):
                continue
            for leaf in pytree.tree_leaves(value):
                if isinstance(leaf, torch.Tensor) and id(leaf) not in memo:
                    memo[id(leaf)] = leaf.detach()
    return copy.deepcopy(model, memo)


def _point_at(gm: torch.nn.Module, model: torch.nn.Module) -> None:
    """Make the traced program's parameters and buffers the model's own tensors (same names, same objects)."""
    real: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    real.update(model.named_buffers(remove_duplicate=False))
    for kind in ("_parameters", "_buffers"):
        for path, owner in gm.named_modules(remove_duplicate=False):
            registry = getattr(owner, kind)
            for attr in list(registry):
                name = f"{path}.{attr}" if path else attr
                if name in real:
                    registry[attr] = real[name]
