"""Weights read by rows, their gradient summed over a step's microbatches and handed to autograd once.

Two ops read a few rows of a large weight and give back, in every microbatch's backward, a gradient of the *whole*
weight, zeros but those rows, which autograd then adds into ``.grad``:

* an embedding lookup (``embedding``'s backward: the vocabulary's rows zeroed, the looked-up ones added);
* the row slices of a linear layer split into column chunks (:mod:`partitioner.capture.chunk`: the LM head, after
  vocabulary parallelism for pipelines, Yeung et al. 2025, arXiv:2411.05288), which a stage holding some chunks
  takes as one ``split_with_sizes`` of the weight (:func:`partitioner.capture.chunk.merge_weight_slices`).

For GPT-2's tied 50,257 x 256 embedding that is 51 MB allocated, zero-filled and added per microbatch and per op,
fresh pages from the kernel each time on a CPU (glibc maps blocks that large anew): 280 ms of a 2.2 s step for the
slices on the stage that also holds the embedding, and about as much again for the lookup.

So, much as torch's pipelines accumulate over microbatches and synchronise at the last one
(``torch.distributed.pipelining``'s ``backward_maybe_with_nosync``), :class:`RowGradients` sums these gradients
over the step's microbatches — a slice's in a buffer of its rows alone (the first microbatch's gradient is
autograd's own tensor, kept; later ones are added), a lookup's rows added into one whole buffer made at the step's
first backward — and hands autograd the weight's gradient once, in the stage's last backward of the step, which the
executor marks (``final``). Whatever watches the weight's gradient (the data-parallel buckets of
:mod:`pipeline.grad_buckets`, the sharded gathering of :mod:`pipeline.param_gather`) sees it arrive in that
backward, where it expects the last one. Every row gets the same terms as before, summed over the microbatches before
being added to the weight's other readers' share: a rounding-level difference only. Should the last microbatch
backpropagate nothing through the weight (a step function that skips ``model.backward`` for a NaN loss), the
executor's :meth:`RowGradients.flush` at the end of that backward hands the sum over through the weight's gradient
edge instead.

A split backward (zero-bubble schedules, :mod:`pipeline.zero_bubble`) computes weight gradients with
``autograd.grad``, which wants one in every pass: there (``defer=False``) each backward hands its own at once; so
does every backward outside an executor's training step (:meth:`RowGradients.begin_step` to ``end_step``): a
stage module timed or run by hand gets its gradient as the ops themselves give it. Lookups scaled by frequency or
with sparse gradients are left as they are.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

__all__ = ["RowGradients"]


class _Slices(torch.autograd.Function):
    """``weight.split_with_sizes(sizes)`` (views), whose gradient goes through the owner's per-step sums."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, sizes: list[int], owner: "RowGradients",
                key: int) -> tuple[torch.Tensor, ...]:
        ctx.owner, ctx.key, ctx.shape, ctx.sizes = owner, key, weight.shape, sizes
        ctx.set_materialize_grads(False)  # a slice no op reads has no gradient: None, not zeros
        owner.read(key, weight, sizes)
        return tuple(weight.split_with_sizes(sizes))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None, None]:
        return ctx.owner.add_slices(ctx.key, ctx.shape, ctx.sizes, grads), None, None, None


class _Lookup(torch.autograd.Function):
    """``embedding(weight, indices, padding_idx)``, whose gradient goes through the owner's per-step sums."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, indices: torch.Tensor, padding_idx: int, owner: "RowGradients",
                key: int) -> torch.Tensor:
        ctx.owner, ctx.key, ctx.shape, ctx.padding_idx = owner, key, weight.shape, padding_idx
        ctx.save_for_backward(indices)
        owner.read(key, weight, None)
        return torch.ops.aten.embedding.default(weight, indices, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        indices, = ctx.saved_tensors
        return ctx.owner.add_lookup(ctx.key, ctx.shape, indices, grad, ctx.padding_idx), None, None, None, None


@dataclass(eq=False)
class RowGradients:
    """The per-step gradient sums of the weights one rank's stages read by rows (see the module docstring).
    ``defer``: hand each weight's gradient over in the stage's last backward only (False under a split backward);
    ``final``: the running backward is its stage's last of the step (the executor sets it)."""

    defer: bool = True
    final: bool = False
    _step: bool = False  # within an executor's training step (begin_step .. end_step): the only time it defers
    _slices: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)  # key -> each slice's sum so far
    _owned: set[tuple[int, int]] = field(default_factory=set)  # (key, slice) whose sum is ours to add into
    _lookups: dict[int, torch.Tensor] = field(default_factory=dict)  # key -> the lookups' gradient so far, whole
    _stage: dict[int, int] = field(default_factory=dict)  # key -> the local stage whose graph reads it
    _read: dict[int, tuple[Any, torch.Size, list[int] | None]] = field(default_factory=dict)  # key -> the weight's
    # gradient edge in the last forward, its shape and the slices' sizes (None for a lookup)

    def insert(self, gm: torch.fx.GraphModule, stage: int) -> int:
        """Route each ``split_with_sizes`` of a trainable parameter along its rows (``merge_weight_slices``) and each
        plain ``embedding`` lookup of one in ``gm`` (local ``stage``'s graph) through these sums; returns how many
        (0 leaves ``gm`` as it was)."""
        found = 0
        for node in gm.graph.nodes:
            weight = node.args[0] if node.op == "call_function" and node.args else None
            if not (isinstance(weight, torch.fx.Node) and weight.op == "get_attr"
                    and _trainable(gm, str(weight.target))) or node.kwargs:
                continue
            key = len(self._stage)
            if node.target is torch.ops.aten.split_with_sizes.default and node.args[2:] == (0,):
                node.target, node.args = self.slices, (weight, node.args[1], key)
            elif node.target is torch.ops.aten.embedding.default and len(node.args) <= 3:  # not by frequency, dense
                node.target, node.args = self.lookup, (weight, node.args[1], (*node.args[2:], -1)[0], key)
            else:
                continue
            self._stage[key] = stage
            found += 1
        if found:
            gm.recompile()
        return found

    def slices(self, weight: torch.Tensor, sizes: list[int], key: int) -> tuple[torch.Tensor, ...]:
        """``weight``'s rows in pieces of ``sizes`` (the graph's node), differentiable through :meth:`add_slices`."""
        return _Slices.apply(weight, sizes, self, key)

    def lookup(self, weight: torch.Tensor, indices: torch.Tensor, padding_idx: int, key: int) -> torch.Tensor:
        """``weight``'s rows at ``indices`` (the graph's node), differentiable through :meth:`add_lookup`."""
        return _Lookup.apply(weight, indices, padding_idx, self, key)

    def read(self, key: int, weight: torch.Tensor, sizes: list[int] | None) -> None:
        """A forward read ``key``'s ``weight``: where a gradient left over at the stage's end goes (:meth:`flush`)."""
        if weight.requires_grad:
            self._read[key] = (torch.autograd.graph.get_gradient_edge(weight), weight.shape, sizes)

    def _now(self) -> bool:
        """Is a weight's gradient handed to autograd in the running backward?"""
        return not (self.defer and self._step and not self.final)

    def add_slices(self, key: int, shape: torch.Size, sizes: list[int],
                   grads: tuple[torch.Tensor | None, ...]) -> torch.Tensor | None:
        """One backward's gradients of ``key``'s slices (of ``sizes`` rows): added to the step's sums; returns the
        weight's gradient (``shape``) when it is to be handed over now, else None."""
        sums = self._slices.setdefault(key, [None] * len(grads))
        for i, g in enumerate(grads):
            if g is None:
                continue
            held = sums[i]
            if held is None:  # autograd's own tensor, kept: another node may read it, so never added into
                sums[i] = g
            elif (key, i) in self._owned:
                held.add_(g)
            else:
                sums[i] = held + g
                self._owned.add((key, i))
        return self._whole(key, shape, sizes) if self._now() else None

    def _whole(self, key: int, shape: torch.Size, sizes: list[int]) -> torch.Tensor | None:
        """The weight's gradient from ``key``'s slices' sums, which are forgotten."""
        pieces = self._slices.pop(key)
        self._owned -= {(key, i) for i in range(len(pieces))}
        some = next((p for p in pieces if p is not None), None)
        if some is None:
            return None
        whole = some.new_empty(shape)
        for part, p in zip(whole.split_with_sizes(sizes), pieces):
            if p is None:
                part.zero_()
            else:
                part.copy_(p)
        return whole

    def add_lookup(self, key: int, shape: torch.Size, indices: torch.Tensor, grad: torch.Tensor,
                   padding_idx: int) -> torch.Tensor | None:
        """One backward's gradient of ``key``'s lookup at ``indices`` (``padding_idx``'s rows get none, as
        ``embedding``'s backward gives them): added into the step's whole sum (made at the step's first); returns it
        when it is to be handed over now, else None."""
        total = self._lookups.get(key)
        if total is None:
            total = self._lookups[key] = grad.new_zeros(shape)
        rows, g = indices.reshape(-1), grad.reshape(-1, *shape[1:])
        if padding_idx >= 0:
            keep = rows != padding_idx
            rows, g = rows[keep], g[keep]
        total.index_put_((rows,), g, accumulate=True)  # deterministic on CUDA too, unlike index_add_
        return self._lookups.pop(key) if self._now() else None

    def flush(self, stage: int) -> None:
        """The end of local ``stage``'s last backward of the step: a sum still held (the step's last microbatch
        backpropagated nothing through the weight: a step function that skipped ``model.backward`` for it) goes to
        autograd now, through the weight's gradient edge, so that no microbatch's gradient is lost."""
        for key in [k for k, s in self._stage.items() if s == stage and (k in self._slices or k in self._lookups)]:
            edge, shape, sizes = self._read[key]
            grad = self._lookups.pop(key) if sizes is None else self._whole(key, shape, sizes)
            if grad is not None:
                torch.autograd.backward([edge], [grad])

    def begin_step(self) -> None:
        """A training step's passes begin (the executor calls it): from now on the sums wait for the last backward."""
        self.end_step()
        self._step = True

    def end_step(self) -> int:
        """The step's passes are over (the executor calls it, whatever happened): forget every sum; returns how
        many weights had sums never handed to autograd (0 unless a step failed, or lost gradients)."""
        left = sum(any(p is not None for p in pieces) for pieces in self._slices.values()) + len(self._lookups)
        self._slices.clear()
        self._owned.clear()
        self._lookups.clear()
        self._read.clear()  # no autograd node of this step's forwards held into the next
        self._step = self.final = False
        return left


def _trainable(gm: torch.nn.Module, target: str) -> bool:
    """Is ``gm``'s attribute ``target`` (a ``get_attr``'s, so it exists) a parameter that takes gradients?"""
    obj = operator.attrgetter(target)(gm)
    return isinstance(obj, torch.nn.Parameter) and obj.requires_grad
