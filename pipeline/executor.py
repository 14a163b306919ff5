"""Executing one rank's share of a pipeline schedule.

The executor walks the rank's ordered action list (:mod:`pipeline.schedule`) and nothing else decides
the order: ``F`` of (stage, microbatch) receives the stage's inputs — from the microbatch itself for model
inputs, from the producing stage otherwise, even when it is several stages back (skip connections, T5's
encoder output) — runs the stage and sends each output to every stage that reads it; ``B`` receives the
gradients of the stage's outputs (summed over the stages that read them), runs autograd through the
stage and sends the input gradients back. Activations are kept from ``F`` to ``B`` only, so the number
held at once is exactly what the schedule implies (GPipe: m, 1F1B: p - s); ``peak_held`` counts it.

Values that cross stages are detached at the boundary, also between two stages on one rank, so each
``B`` runs autograd through its own stage only. Gradients accumulate in the parameters' ``.grad`` across
microbatches, as ``loss.backward()`` per microbatch would.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.utils.checkpoint

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
        order = [a for a in self.schedule.actions[self.rank] if a.kind != "B" or train]
        for i, action in enumerate(order):
            if action.kind == "W":
                raise NotImplementedError("split input/weight backward (zero-bubble) schedules are simulated "
                                          "only; run them with schedule='1f1b' or 'gpipe'")
            for ahead in order[i + 1:i + 1 + self.RECV_LOOKAHEAD]:
                self._post_recvs(ahead)
            span = self.recorder.span(str(action)) if self.recorder else nullcontext()
            with span:
                if action.kind == "F":
                    ctx = before_forward(action.microbatch) if before_forward else nullcontext()
                    with ctx if ctx is not None else nullcontext():
                        out = self._forward(action, inputs_of(action.microbatch), loss_hook, train)
                    if out is not None:
                        results[action.microbatch] = out
                else:
                    self._backward(action)
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
        return tuple(outs) if last else None

    def _backward(self, a: Action) -> None:
        stage = self._stages[a.stage]
        k = a.microbatch
        held = self._held.pop((a.stage, k), None)
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
        if tensors:
            torch.autograd.backward(tensors, grads)
        for n, t in held.inputs.items():
            g = t.grad if t.grad is not None else torch.zeros_like(t)
            src = stage.sources[n]
            if self._local(src):
                key = (n, k)
                self._grads[key] = self._grads[key] + g if key in self._grads else g
            else:
                self.transport.isend(g.contiguous(), self._peer(src), self._tag(n, k, True),
                                     f"sending the gradient of {n} (microbatch {k}) to stage {src}")
