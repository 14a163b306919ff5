"""Executing one rank's share of a lowered pipeline schedule.

The executor walks the rank's ordered action list (:mod:`pipeline.schedule`, lowered by
:mod:`pipeline.lowering`) and nothing else decides the order or the messages:

* ``RECV_F(t<-s, k)`` / ``RECV_B(s<-t, k)`` post the receives of what stage s sends stage t for
  microbatch k (activations) or what t sends back to s (gradients), into buffers sized from the trace;
  the values of one edge and pass travel as one message per dtype (a UNet cut carries four skips: four
  messages, each a round of thread wake-ups on a rank's core, cost more than copying them into one);
* ``F(s, k)`` waits for its receives, takes model inputs from the microbatch and values from earlier local
  stages, runs the stage and keeps what later stages read; ``SEND_F(s->t, k)`` sends t its share;
* ``B(s, k)`` waits for the gradients of the stage's outputs (summed over the stages that read them), runs
  autograd through the stage and keeps the input gradients; ``SEND_B(s->r, k)`` sends stage r its share;
* ``W(s, k)`` finishes a split backward (:mod:`pipeline.zero_bubble`).

Activations are held from ``F`` to ``B`` (to ``W`` when the backward is split), so the number held at once
is exactly what the schedule implies (GPipe: m, 1F1B: p - s, ZB-H1: p + 1, all capped at m);
``peak_held`` counts it; with an ``offload`` (:mod:`pipeline.offload`) what checkpointed stages hold waits in
host memory, loaded ahead of the backward. Values that cross stages are detached at the boundary, also between two
stages on one rank, so each ``B`` runs autograd through its own stage only. Gradients accumulate in the
parameters' ``.grad`` across microbatches, as ``loss.backward()`` per microbatch would. A stage's last ``B`` of the
step makes them final: the sharded parameters' gathering (:mod:`pipeline.param_gather`) is told so, and so are the
data-parallel buckets (:mod:`pipeline.grad_buckets`), also at that microbatch's ``W`` under a split backward, and the
sums of weights read by rows (:mod:`pipeline.row_grads`), whose gradient reaches ``.grad`` then.

With a :class:`pipeline.timeline.Recorder` every pass is a span; a detailed one (profiling,
:mod:`pipeline.profiler`) also gets, nested in each pass, the time it waited for its receives
(``wait F3@s1``), the sends and receives, and the final wait for the sends.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.utils.checkpoint

from partitioner.capture.stage_modules import MODEL_INPUT, SplitModel
from pipeline.grad_buckets import GradBuckets
from pipeline.offload import ActivationOffload
from pipeline.p2p import Transport
from pipeline.param_gather import GatheredParams
from pipeline.row_grads import RowGradients
from pipeline.schedule import Action, Schedule
from pipeline.timeline import Recorder
from pipeline.zero_bubble import backward_input

__all__ = ["Executor", "LossHook"]

# loss_hook(microbatch, flat model outputs) -> the scalar to backpropagate on the last stage (or None)
LossHook = Callable[[int, tuple], "torch.Tensor | None"]
_FORWARD_ONLY = ("RECV_F", "F", "SEND_F")
_NULL = nullcontext()


@dataclass
class _Held:
    outputs: dict[str, torch.Tensor]
    inputs: dict[str, torch.Tensor]
    loss: torch.Tensor | None = None
    weight_pass: Callable[[], None] | None = None  # what W still has to do once B ran (split backward)


@dataclass
class Executor:
    """Runs one rank's actions of a lowered ``schedule`` over ``split_model``'s stages (see the module
    docstring). ``rank`` is the pipeline rank, ``ranks`` the global rank of each pipeline rank;
    ``requires_grad`` says which boundary values carry a gradient back."""

    split_model: SplitModel
    schedule: Schedule
    rank: int
    ranks: list[int]
    transport: Transport
    requires_grad: dict[str, bool]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    recorder: Recorder | None = None
    checkpointed: set[int] = field(default_factory=set)  # stages that recompute activations in backward
    peak_held: dict[int, int] = field(default_factory=dict)
    offload: ActivationOffload | None = None  # checkpointed stages' inputs to host memory and back (pipeline.offload)
    gather: GatheredParams | None = None  # sharded parameters' saved whole copies dropped, gathered again in backward
    grad_buckets: GradBuckets | None = None  # data-parallel averages launched as the last backward makes them final
    row_grads: RowGradients | None = None  # lookups' and row slices' gradients, handed over in the last backward

    def __post_init__(self) -> None:
        if not self.schedule.lowered:
            raise ValueError("the executor walks a lowered schedule: pass pipeline.lowering.lower(schedule, deps)")
        names = sorted({n for s in self.split_model.stages for n in s.inputs if s.sources[n] != MODEL_INPUT})
        self._value_index = {n: i for i, n in enumerate(names)}
        self._stages = {s: self.split_model.stages[s] for s in self.schedule.stages_of(self.rank)}
        program = self.split_model.program
        self._constants = {n: v for n, v in zip(program.input_names, program.input_meta)
                           if not isinstance(v, torch.Tensor)}
        self._last_backward: dict[int, int] = {}  # stage -> the microbatch of its step's last backward
        for b in self.schedule.actions[self.rank]:
            if b.kind == "B":
                self._last_backward[b.stage] = max(b.microbatch, self._last_backward.get(b.stage, b.microbatch))

    # -- tags, peers and what travels on each stage edge ----------------------------------------------------
    def _tag(self, value: str, mb: int, grad: bool) -> int:
        return ((mb * len(self._value_index) + self._value_index[value]) << 1) | int(grad)

    def _peer(self, stage: int) -> int:
        return self.ranks[self.schedule.stage_to_rank[stage]]

    def _local(self, stage: int) -> bool:
        return self.schedule.stage_to_rank[stage] == self.rank

    def _edge_values(self, producer: int, consumer: int, grad: bool) -> list[str]:
        """Values stage ``producer`` sends stage ``consumer`` (those carrying a gradient back, for ``grad``)."""
        st = self.split_model.stages[consumer]
        return sorted(n for n in st.inputs if st.sources[n] == producer
                      and (not grad or self.requires_grad.get(n, False)))

    def _messages(self, producer: int, consumer: int, grad: bool) -> list[list[str]]:
        """The values of one edge and pass grouped into messages: one per dtype, in name order (both ends
        compute the same grouping from the trace)."""
        by_dtype: dict[torch.dtype, list[str]] = {}
        for n in self._edge_values(producer, consumer, grad):
            by_dtype.setdefault(self.split_model.value_meta[n].dtype, []).append(n)
        return list(by_dtype.values())

    # -- the walk ---------------------------------------------------------------------------------------
    def run(self, mb_inputs: Sequence[dict[str, Any]] | Callable[[int], dict[str, Any]], loss_hook: LossHook | None,
            train: bool, before_forward: Callable[[int], Any] | None = None,
            keep_outputs: bool = True) -> dict[int, tuple]:
        """Run this rank's actions; returns the last stage's flat outputs per microbatch (if held here and
        ``keep_outputs``: without it each is dropped once its backward ran, as a step that reads only the loss
        wants; holding every microbatch's logits makes the allocator fetch fresh pages for everything after,
        which tripled the time of GPT-2's log-softmax backward).

        ``mb_inputs`` gives each microbatch's model inputs by placeholder name (a list, or a function called
        when stage 0 needs them; only the rank holding stage 0 reads them). ``before_forward(mb)`` may
        return a context manager entered around each forward (autocast as the user's step function had it).
        Without ``train`` only the forward actions run.
        """
        inputs_of = mb_inputs if callable(mb_inputs) else mb_inputs.__getitem__
        self._held: dict[tuple[int, int], _Held] = {}
        self._mailbox: dict[tuple[str, int, int], torch.Tensor] = {}  # (value, mb, to stage) -> tensor
        self._grads: dict[tuple[str, int], torch.Tensor] = {}        # (value, mb) -> summed local grads
        self._posted: dict[tuple[str, int, int], list[tuple[list[str], list[torch.Tensor], Any, int, str]]] = {}
        # ("F"/"B", stage, mb) -> the values a pass sends other ranks, and how many sends are still to go
        self._outbox: dict[tuple[str, int, int], tuple[dict[str, torch.Tensor], list[int]]] = {}
        self.peak_held = {s: 0 for s in self._stages}
        results: dict[int, tuple] = {}
        offload = self.offload if train else None
        if offload is not None:
            offload.start(self.schedule.actions[self.rank], self.checkpointed)
        if self.row_grads is not None and train:
            self.row_grads.begin_step()
        try:
            for index, action in enumerate(self.schedule.actions[self.rank]):
                kind = action.kind
                if not train and kind not in _FORWARD_ONLY:
                    continue
                if offload is not None:
                    offload.advance(index)
                if action.is_comm:
                    with self._detail(action, "comm"):
                        (self._post if kind.startswith("RECV") else self._send)(action)
                    continue
                span = self.recorder.span(str(action)) if self.recorder else _NULL
                with span:
                    if kind == "F":
                        ctx = before_forward(action.microbatch) if before_forward else None
                        with ctx if ctx is not None else nullcontext():
                            out = self._forward(action, inputs_of, loss_hook, train)
                        if out is not None and keep_outputs:
                            results[action.microbatch] = out
                    elif kind == "B":
                        self._backward(action)
                    else:
                        self._weight(action)
        finally:  # a stage's last unit, kept whole through the step, is not reused once its shards change
            if self.gather is not None:
                self.gather.end_step()
            lost = self.row_grads.end_step() if self.row_grads is not None else 0
        if lost and train:
            raise RuntimeError(f"rank {self.rank}: the gradients of {lost} weight(s) read by rows (embedding lookups, "
                               "row slices of a split linear) were summed over the step's microbatches but never "
                               "reached autograd: the stage's last backward of the step did not read them")
        with self._detail("wait sends", "wait"):
            self.transport.flush()
        return results

    def _detail(self, name: Any, cat: str) -> Any:
        """A span of what the recorder records besides the passes (waits, sends, receives), if it does."""
        rec = self.recorder
        return rec.span(name, cat) if rec is not None and rec.detail else _NULL

    # -- communication actions ----------------------------------------------------------------------------
    def _post(self, a: Action) -> None:
        """RECV_F / RECV_B: post the receives of this edge and microbatch into fresh buffers."""
        grad = a.kind == "RECV_B"
        producer, consumer = (a.stage, a.peer) if grad else (a.peer, a.stage)
        posted = self._posted.setdefault(("B" if grad else "F", a.stage, a.microbatch), [])
        for names in self._messages(producer, consumer, grad):
            metas = [self.split_model.value_meta[n] for n in names]
            sizes = [m.numel() for m in metas]
            flat = torch.empty(sum(sizes), dtype=metas[0].dtype, device=self.device)
            views = [v.view(tuple(m.shape)) for v, m in zip(flat.split(sizes), metas)]
            n = ", ".join(names)
            what = (f"receiving the gradient of {n} (microbatch {a.microbatch}) from stage {a.peer}" if grad else
                    f"receiving {n} for stage {a.stage} microbatch {a.microbatch}")
            work = self.transport.irecv(flat, self._peer(a.peer), self._tag(names[0], a.microbatch, grad))
            posted.append((names, views, work, self._peer(a.peer), what))

    def _received(self, kind: str, stage: int, mb: int) -> list[tuple[str, torch.Tensor]]:
        """Wait for the receives posted for the pass (kind, stage, mb): (value, buffer) pairs."""
        posted = self._posted.pop((kind, stage, mb), [])
        with self._detail(f"wait {kind}{mb}@s{stage}", "wait") if posted else _NULL:
            for _, _, work, peer, what in posted:
                self.transport.wait(work, peer, what)
        return [(n, view) for names, views, _, _, _ in posted for n, view in zip(names, views)]

    def _send(self, a: Action) -> None:
        """SEND_F / SEND_B: send the peer stage its share of what the pass left in the outbox."""
        grad = a.kind == "SEND_B"
        producer, consumer = (a.peer, a.stage) if grad else (a.stage, a.peer)
        key = ("B" if grad else "F", a.stage, a.microbatch)
        box, left = self._outbox[key]
        for names in self._messages(producer, consumer, grad):
            flat = torch.cat([box[n].reshape(-1) for n in names]) if len(names) > 1 else box[names[0]].reshape(-1)
            n = ", ".join(names)
            what = (f"sending the gradient of {n} (microbatch {a.microbatch}) to stage {a.peer}" if grad else
                    f"sending {n} of microbatch {a.microbatch} to stage {a.peer}")
            self.transport.isend(flat, self._peer(a.peer), self._tag(names[0], a.microbatch, grad), what)
        left[0] -= 1
        if not left[0]:
            del self._outbox[key]

    def _to_send(self, kind: str, stage: int, mb: int, peers: set[int]) -> dict[str, torch.Tensor]:
        """The outbox of a pass that sends to the stages ``peers`` on other ranks (one SEND action each)."""
        box: dict[str, torch.Tensor] = {}
        if peers:
            self._outbox[(kind, stage, mb)] = (box, [len(peers)])
        return box

    # -- compute actions ----------------------------------------------------------------------------------
    def _forward(self, a: Action, inputs_of: Callable[[int], dict[str, Any]], loss_hook: LossHook | None,
                 train: bool) -> tuple | None:
        stage = self._stages[a.stage]
        k = a.microbatch
        received = dict(self._received("F", a.stage, k))
        # The step's data enters at stage 0; other stages read only traced constants from the model inputs.
        model_inputs = inputs_of(k) if a.stage == 0 else self._constants
        grad_mode = train and torch.is_grad_enabled()
        args = []
        boundary: dict[str, torch.Tensor] = {}
        for n in stage.inputs:
            if stage.sources[n] == MODEL_INPUT:
                args.append(model_inputs[n])
                continue
            t = received[n] if n in received else self._mailbox.pop((n, k, a.stage))
            if grad_mode and self.requires_grad.get(n, False):
                t = t.detach().requires_grad_(True)
                boundary[n] = t
            args.append(t)
        if a.stage in self.checkpointed and grad_mode:
            # Keep only the stage inputs; backward re-runs the forward (same RNG states, tensor parallelism's
            # dropout streams included) to rebuild the rest.
            comm = self.split_model.program.tp_comm
            with (self.offload.saving(a.stage, k, stage.module, boundary.values())
                  if self.offload is not None else _NULL):
                outs = torch.utils.checkpoint.checkpoint(
                    stage.module, *args, use_reentrant=False,
                    context_fn=comm.replay if comm is not None else torch.utils.checkpoint.noop_context_fn)
        else:
            with self.gather.saving() if self.gather is not None and grad_mode else _NULL:
                outs = stage.module(*args)
        last = not stage.consumers and a.stage == len(self.split_model.stages) - 1
        held = _Held(outputs={}, inputs=boundary)
        if not last:
            box = self._to_send("F", a.stage, k, {c for cs in stage.consumers.values() for c in cs
                                                  if not self._local(c)})
            for name, t in zip(stage.outputs, outs):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    held.outputs[name] = t
                send = t.detach().contiguous() if isinstance(t, torch.Tensor) else t
                for c in stage.consumers.get(name, []):
                    if self._local(c):
                        self._mailbox[(name, k, c)] = send
                    else:
                        box[name] = send
        elif loss_hook is not None:
            held.loss = loss_hook(k, tuple(outs))
        if grad_mode:
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
        final = k == self._last_backward[a.stage]
        if self.gather is not None:  # the stage's last backward of the step reduces sharded gradients as it goes
            self.gather.final = final
        if self.row_grads is not None:  # and hands over the gradients of weights read by rows, summed over the step
            self.row_grads.final = final
        split = self.schedule.split_backward
        if self.grad_buckets is not None:  # and launches the data-parallel buckets its gradients fill
            self.grad_buckets.final_pass(a.stage, final)
        held = self._held.get((a.stage, k)) if split else self._held.pop((a.stage, k), None)
        if held is None:
            raise RuntimeError(f"backward of stage {a.stage} microbatch {k} before its forward ran in training "
                               "mode (was the forward run under torch.no_grad()?)")
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if held.loss is not None:
            tensors, grads = [held.loss], [None]
        else:
            got: dict[str, torch.Tensor] = {}
            for n, buf in self._received("B", a.stage, k):
                got[n] = got[n] + buf if n in got else buf
            local_readers = {n for n in stage.outputs for c in stage.consumers.get(n, []) if self._local(c)}
            for n in local_readers:
                local = self._grads.pop((n, k), None)
                if local is not None:
                    got[n] = got[n] + local if n in got else local
            for n, g in got.items():
                if n in held.outputs:
                    tensors.append(held.outputs[n])
                    grads.append(g)
        if split:
            params = list(stage.module.parameters())
            done = backward_input(tensors, grads, held.inputs, params, a.stage in self.checkpointed)
            input_grads = done.input_grads
            if done.weight_pass is None:
                del self._held[(a.stage, k)]
            else:
                held.weight_pass = done.weight_pass
                if not done.keeps_outputs:  # W needs only the parameters' side of the graph
                    held.outputs, held.loss = {}, None
        else:
            if tensors:
                torch.autograd.backward(tensors, grads)
            if final and self.row_grads is not None:  # a sum the last microbatch did not hand over: handed now
                self.row_grads.flush(a.stage)
            input_grads = {n: t.grad for n, t in held.inputs.items()}
        if self.gather is not None:
            self.gather.release()  # the weights this backward gathered again
        box = self._to_send("B", a.stage, k, {src for src in stage.sources.values()
                                              if src != MODEL_INPUT and not self._local(src)})
        for n, t in held.inputs.items():
            got_grad = input_grads.get(n)
            grad = got_grad if got_grad is not None else torch.zeros_like(t)
            if self._local(stage.sources[n]):
                key = (n, k)
                self._grads[key] = self._grads[key] + grad if key in self._grads else grad
            else:
                box[n] = grad.contiguous()
        if self.grad_buckets is not None and final and not split:
            self.grad_buckets.stage_done(a.stage)

    def _weight(self, a: Action) -> None:
        final = a.microbatch == self._last_backward[a.stage]
        if self.grad_buckets is not None:
            self.grad_buckets.final_pass(a.stage, final)
        held = self._held.pop((a.stage, a.microbatch), None)  # None: B already did everything
        if held is not None and held.weight_pass is not None:
            held.weight_pass()
        if self.grad_buckets is not None and final:
            self.grad_buckets.stage_done(a.stage)
