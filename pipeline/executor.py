"""Executing one rank's share of a pipeline schedule.

The executor walks the rank's ordered action list (:mod:`pipeline.schedule`) and nothing else decides
the order: ``F`` of (stage, microbatch) receives the stage's inputs — from the microbatch itself for model
inputs, from the producing stage otherwise, even when it is several stages back (skip connections, T5's
encoder output) — runs the stage and sends each output to every stage that reads it; ``B`` receives the
gradients of the stage's outputs (summed over the stages that read them), runs autograd through the
stage and sends the input gradients back. Activations are kept from ``F`` to ``B`` only (to ``W`` when the
backward is split, below), so the number held at once is exactly what the schedule implies (GPipe: m,
1F1B: p - s, ZB-H1: p + 1, all capped at m); ``peak_held`` counts it.

Zero-bubble schedules (ZB-H1, Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv:2401.10241;
``schedule.split_backward``) split the backward in two, with torch's own helpers
(``torch.distributed.pipelining._backward``): ``B`` computes only the gradients of the stage's boundary
inputs (``stage_backward_input``, which also records the gradients reaching the parameters' subgraphs)
and sends them upstream at once; ``W`` later turns those into parameter gradients
(``stage_backward_weight``). B keeps the graph for W (``retain_graph``), so W is what frees a microbatch's
activations. Every parameter still gets its exact gradient:

* a stage with no boundary input that carries a gradient (the first stage) has nothing to send upstream,
  so its ``B`` only stores the output gradients and ``W`` runs the whole backward, as torch's stage does;
* the split sees a parameter's gradient only where it meets the inputs' part of the graph, so any other
  stage with an output that does not depend on its inputs runs the fused backward in ``B`` and has nothing
  left for ``W``; so does any other checkpointed stage, whose ``W`` would recompute the forward once per
  parameter group (``stage_backward_weight`` runs one autograd pass per group).

Values that cross stages are detached at the boundary, also between two stages on one rank, so each
``B`` runs autograd through its own stage only. Gradients accumulate in the parameters' ``.grad`` across
microbatches, as ``loss.backward()`` per microbatch would.
"""
from __future__ import annotations

from bisect import bisect_right
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.utils.checkpoint
from torch.distributed.pipelining._backward import (
    _get_grad_fn_or_grad_acc,
    construct_reverse_graph,
    reverse_closure,
    stage_backward_input,
    stage_backward_weight,
)

from partitioner.split import MODEL_INPUT, SplitModel

from .p2p import Transport
from .schedule import Action, Schedule
from .timeline import Recorder

__all__ = ["Executor", "LossHook"]

# loss_hook(microbatch, flat model outputs) -> the scalar to backpropagate on the last stage (or None)
LossHook = Callable[[int, tuple], "torch.Tensor | None"]


@dataclass
class _Held:
    outputs: dict[str, torch.Tensor]
    inputs: dict[str, torch.Tensor]
    loss: torch.Tensor | None = None
    weight_pass: Callable[[], None] | None = None  # what W still has to do once B ran (split backward)


@dataclass
class Executor:
    split_model: SplitModel
    schedule: Schedule
    rank: int                           # pipeline rank (index into ``ranks``)
    ranks: list[int]                    # global rank of each pipeline rank
    transport: Transport
    requires_grad: dict[str, bool]      # per boundary value: does a gradient flow back through it?
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    recorder: Recorder | None = None
    checkpointed: set[int] = field(default_factory=set)  # stages that recompute activations in backward
    peak_held: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = sorted({n for s in self.split_model.stages for n in s.inputs if s.sources[n] != MODEL_INPUT})
        self._value_index = {n: i for i, n in enumerate(names)}
        self._stages = {s: self.split_model.stages[s] for s in self.schedule.stages_of(self.rank)}

    # -- tags and peers ---------------------------------------------------------------------------
    def _tag(self, value: str, mb: int, grad: bool) -> int:
        return ((mb * len(self._value_index) + self._value_index[value]) << 1) | int(grad)

    def _peer(self, stage: int) -> int:
        return self.ranks[self.schedule.stage_to_rank[stage]]

    def _local(self, stage: int) -> bool:
        return self.schedule.stage_to_rank[stage] == self.rank

    def _buffer(self, value: str) -> torch.Tensor:
        meta = self.split_model.value_meta[value]
        return torch.empty(tuple(meta.shape), dtype=meta.dtype, device=self.device)

    # -- the walk ---------------------------------------------------------------------------------
    def run(self, mb_inputs: Sequence[dict[str, Any]] | Callable[[int], dict[str, Any]], loss_hook: LossHook | None,
            train: bool, before_forward: Callable[[int], Any] | None = None) -> dict[int, tuple]:
        """Run this rank's actions; returns the last stage's flat outputs per microbatch (if held here).

        ``mb_inputs`` gives each microbatch's model inputs by placeholder name (a list, or a function called
        when the first local stage needs them). ``before_forward(mb)`` may return a context manager entered
        around each forward (autocast as the user's step function had it).
        """
        inputs_of = mb_inputs if callable(mb_inputs) else mb_inputs.__getitem__
        self._held: dict[tuple[int, int], _Held] = {}
        self._mailbox: dict[tuple[str, int, int], torch.Tensor] = {}  # (value, mb, to stage) -> tensor
        self._grads: dict[tuple[str, int], torch.Tensor] = {}        # (value, mb) -> summed local grads
        self.peak_held = {s: 0 for s in self._stages}
        self._posted: dict[Action, list[tuple[str, int, torch.Tensor, Any, int, str]]] = {}
        results: dict[int, tuple] = {}
        order = [a for a in self.schedule.actions[self.rank] if a.kind == "F" or train]
        communicating = [i for i, a in enumerate(order) if a.kind != "W"]  # a W receives nothing: look past it
        for i, action in enumerate(order):
            nxt = bisect_right(communicating, i)
            for j in communicating[nxt:nxt + self.RECV_LOOKAHEAD]:
                self._post_recvs(order[j])
            span = self.recorder.span(str(action)) if self.recorder else nullcontext()
            with span:
                if action.kind == "F":
                    ctx = before_forward(action.microbatch) if before_forward else nullcontext()
                    with ctx if ctx is not None else nullcontext():
                        out = self._forward(action, inputs_of(action.microbatch), loss_hook, train)
                    if out is not None:
                        results[action.microbatch] = out
                elif action.kind == "B":
                    self._backward(action)
                else:
                    self._weight(action)
        self.transport.flush()
        return results

    # -- receives, posted ahead -------------------------------------------------------------------
    # gloo moves a message's payload only once the receiver has posted its receive (the sender queues it and
    # waits for a "receive ready" note), so a receive posted when the action starts costs a round trip of
    # thread wake-ups on the critical path. Posting the next action's receives before running the current
    # one lets a peer's send go out at once. Same messages, tags and buffers; one action's buffers earlier.
    RECV_LOOKAHEAD = 1

    def _recv_specs(self, a: Action) -> list[tuple[str, int, int, str]]:
        """(value, producing/consuming stage, tag, description) of every remote value ``a`` receives."""
        stage, k = self._stages[a.stage], a.microbatch
        if a.kind == "F":
            return sorted(((n, stage.sources[n], self._tag(n, k, False),
                            f"receiving {n} for stage {a.stage} microbatch {k}")
                           for n in stage.inputs
                           if stage.sources[n] != MODEL_INPUT and not self._local(stage.sources[n])),
                          key=lambda r: r[2])
        if a.kind == "B":
            return [(n, c, self._tag(n, k, True), f"receiving the gradient of {n} (microbatch {k}) from stage {c}")
                    for n in stage.outputs if self.requires_grad.get(n, False)
                    for c in stage.consumers.get(n, []) if not self._local(c)]
        return []

    def _post_recvs(self, a: Action) -> None:
        if a not in self._posted:
            posted = []
            for n, s, tag, what in self._recv_specs(a):
                buf = self._buffer(n)
                posted.append((n, s, buf, self.transport.irecv(buf, self._peer(s), tag), self._peer(s), what))
            self._posted[a] = posted

    def _received(self, a: Action) -> list[tuple[str, int, torch.Tensor]]:
        """Wait for ``a``'s receives (posting them first if they are not yet): (value, stage, buffer)."""
        self._post_recvs(a)
        posted = self._posted.pop(a)
        for _, _, _, work, peer, what in posted:
            self.transport.wait(work, peer, what)
        return [(n, s, buf) for n, s, buf, _, _, _ in posted]

    def _forward(self, a: Action, inputs: dict[str, Any], loss_hook: LossHook | None, train: bool) -> tuple | None:
        stage = self._stages[a.stage]
        k = a.microbatch
        received = {n: buf for n, _, buf in self._received(a)}
        args = []
        boundary: dict[str, torch.Tensor] = {}
        for n in stage.inputs:
            if stage.sources[n] == MODEL_INPUT:
                args.append(inputs[n])
                continue
            t = received[n] if n in received else self._mailbox.pop((n, k, a.stage))
            if train and self.requires_grad.get(n, False) and torch.is_grad_enabled():
                t = t.detach().requires_grad_(True)
                boundary[n] = t
            args.append(t)
        if a.stage in self.checkpointed and train and torch.is_grad_enabled():
            # Keep only the stage inputs; backward re-runs the forward (same RNG state) to rebuild the rest.
            outs = torch.utils.checkpoint.checkpoint(stage.module, *args, use_reentrant=False)
        else:
            outs = stage.module(*args)
        last = not stage.consumers and a.stage == len(self.split_model.stages) - 1
        held = _Held(outputs={}, inputs=boundary)
        for name, t in zip(stage.outputs, outs):
            if last:
                continue
            if isinstance(t, torch.Tensor) and t.requires_grad:
                held.outputs[name] = t
            send = t.detach().contiguous() if isinstance(t, torch.Tensor) else t
            for c in stage.consumers.get(name, []):
                if self._local(c):
                    self._mailbox[(name, k, c)] = send
                else:
                    self.transport.isend(send, self._peer(c), self._tag(name, k, False),
                                         f"sending {name} of microbatch {k} to stage {c}")
        if last and loss_hook is not None:
            held.loss = loss_hook(k, tuple(outs))
        if train and torch.is_grad_enabled():
            self._held[(a.stage, k)] = held
            count = sum(1 for s, _ in self._held if s == a.stage)
            self.peak_held[a.stage] = max(self.peak_held[a.stage], count)
        if last and self.schedule.split_backward and train:
            # B keeps the graph for W, and W frees only the parameters' side of it: outputs handed out
            # attached would keep the rest alive for as long as the caller holds them.
            return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in outs)
        return tuple(outs) if last else None

    def _backward(self, a: Action) -> None:
        stage = self._stages[a.stage]
        k = a.microbatch
        split = self.schedule.split_backward
        held = self._held.get((a.stage, k)) if split else self._held.pop((a.stage, k), None)
        if held is None:
            raise RuntimeError(f"backward of stage {a.stage} microbatch {k} before its forward ran in training "
                               "mode (was the forward run under torch.no_grad()?)")
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if held.loss is not None:
            tensors, grads = [held.loss], [None]
        else:
            wanted = [(n, c) for n in stage.outputs if self.requires_grad.get(n, False)
                      for c in stage.consumers.get(n, [])]
            remote = self._received(a)
            got: dict[str, torch.Tensor] = {}
            for n, _, buf in remote:
                got[n] = got[n] + buf if n in got else buf
            for n in {n for n, c in wanted if self._local(c)}:
                local = self._grads.pop((n, k), None)
                if local is not None:
                    got[n] = got[n] + local if n in got else local
            for n, g in got.items():
                if n in held.outputs:
                    tensors.append(held.outputs[n])
                    grads.append(g)
        if split:
            input_grads = self._backward_input(a, held, tensors, grads)
        else:
            if tensors:
                torch.autograd.backward(tensors, grads)
            input_grads = {n: t.grad for n, t in held.inputs.items()}
        for n, t in held.inputs.items():
            g = input_grads.get(n)
            g = g if g is not None else torch.zeros_like(t)
            src = stage.sources[n]
            if self._local(src):
                key = (n, k)
                self._grads[key] = self._grads[key] + g if key in self._grads else g
            else:
                self.transport.isend(g.contiguous(), self._peer(src), self._tag(n, k, True),
                                     f"sending the gradient of {n} (microbatch {k}) to stage {src}")

    def _backward_input(self, a: Action, held: _Held, tensors: list[torch.Tensor],
                        grads: list[torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        """B of a split backward: the input gradients now, the rest left in ``held.weight_pass`` for W (the
        held activations then stay until W; they are released here when nothing is left)."""
        inputs = list(held.inputs.values())
        if tensors and not inputs:
            held.weight_pass = lambda: torch.autograd.backward(tensors, grads)
            return {}
        if not tensors or a.stage in self.checkpointed or not _inputs_reach_all(tensors, inputs):
            if tensors:
                torch.autograd.backward(tensors, grads)
            del self._held[(a.stage, a.microbatch)]
            return {n: t.grad for n, t in held.inputs.items()}
        # stage_backward_input detaches its roots in place to free the output side, but an output may be a
        # view, which refuses (pytorch#142229), or saved by a node W still needs (a residual stream that the
        # stage also reads), which would break W: hand it throwaway copies, roots of the same graph.
        roots = [t.clone() for t in tensors]
        params = list(self._stages[a.stage].module.parameters())
        dinputs, groups = stage_backward_input(roots, grads, inputs, iter(params))
        held.outputs, held.loss = {}, None  # the originals too: W needs only the parameters' side of the graph
        held.weight_pass = lambda: _weight_grads(params, groups)
        return dict(zip(held.inputs, dinputs))

    def _weight(self, a: Action) -> None:
        held = self._held.pop((a.stage, a.microbatch), None)  # None: B already did everything
        if held is not None and held.weight_pass is not None:
            held.weight_pass()


def _inputs_reach_all(roots: list[torch.Tensor], inputs: list[torch.Tensor]) -> bool:
    """Does every root depend on some input? Then each path from a parameter to a root meets the inputs'
    part of the graph, where ``stage_backward_input`` records the gradient, so W's parameter gradients are
    complete; a root that depends on parameters alone would have its contribution lost."""
    root_nodes = [_get_grad_fn_or_grad_acc(t) for t in roots]
    reached, _ = reverse_closure([_get_grad_fn_or_grad_acc(t) for t in inputs], set(),
                                 construct_reverse_graph(root_nodes))
    return all(n in reached for n in root_nodes)


def _weight_grads(params: list[torch.nn.Parameter], groups: list[dict[str, Any]]) -> None:
    """W of a split backward: accumulate the parameter gradients into ``.grad``."""
    fresh = [p for p in params if p.grad is None]
    stage_backward_weight(iter(params), groups)
    # A first gradient is stored as autograd returned it, which may be the very tensor it also gave another
    # parameter or the input gradient (x + b): own it before the next microbatch adds to it in place.
    for p in fresh:
        if p.grad is not None:
            p.grad = p.grad.clone()
