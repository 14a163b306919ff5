"""Row slices of a weight, their gradient summed over a step's microbatches and handed to autograd once.

A linear layer split into column chunks (:mod:`partitioner.capture.chunk`: the LM head, after vocabulary
parallelism for pipelines, Yeung et al. 2025, arXiv:2411.05288) reads row slices of its weight on every stage that
holds some of its chunks, and the stage's graph takes them as one ``split_with_sizes`` of the weight
(:func:`partitioner.capture.chunk.merge_weight_slices`). That op's backward builds a gradient of the *whole* weight,
zeros but the rows read, in every microbatch's backward, and autograd adds it into ``.grad``: for GPT-2's tied
50,257 x 256 embedding, 51 MB allocated, zero-filled, copied and added per microbatch on each stage holding chunks,
fresh pages from the kernel each time on a CPU (glibc maps blocks that large anew) — 280 ms of a 2.2 s step on the
stage that also holds the embedding.

So, much as torch's pipelines accumulate over microbatches and synchronise at the last one
(``torch.distributed.pipelining``'s ``backward_maybe_with_nosync``), :class:`RowGradients` sums the slices'
gradients over the step's microbatches in buffers of the rows alone (the first microbatch's gradient is autograd's
own tensor, kept; later ones are added) and hands autograd the weight's gradient once, in the stage's last backward
of the step, which the executor marks (``final``). Whatever watches the weight's gradient (the data-parallel
buckets of :mod:`pipeline.grad_buckets`, the sharded gathering of :mod:`pipeline.param_gather`) sees it arrive in
that backward, where it expects the last one. Every row gets the same terms as before, summed over the microbatches
before being added to the other readers' share (the tied embedding's), a rounding-level difference only.

A split backward (zero-bubble schedules, :mod:`pipeline.zero_bubble`) computes weight gradients with
``autograd.grad``, which wants one in every pass: there (``defer=False``) each backward hands its own at once; so
does every backward outside an executor's training step (:meth:`RowGradients.begin_step` to ``end_step``): a
stage module timed or run by hand gets its gradient as ``split_with_sizes`` gave it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

__all__ = ["RowGradients"]


class _Rows(torch.autograd.Function):
    """``weight.split_with_sizes(sizes)`` (views), whose gradient goes through the owner's per-step sums."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, sizes: list[int], owner: "RowGradients",
                key: int) -> tuple[torch.Tensor, ...]:
        ctx.owner, ctx.key, ctx.shape, ctx.sizes = owner, key, weight.shape, sizes
        ctx.set_materialize_grads(False)  # a slice no op reads has no gradient: None, not zeros
        return tuple(weight.split_with_sizes(sizes))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None, None]:
        return ctx.owner.add(ctx.key, ctx.shape, ctx.sizes, grads), None, None, None


@dataclass(eq=False)
class RowGradients:
    """The per-step gradient sums of the row slices that one rank's stages read (see the module docstring).
    ``defer``: hand each weight's gradient over in the stage's last backward only (False under a split backward);
    ``final``: the running backward is its stage's last of the step (the executor sets it)."""

    defer: bool = True
    final: bool = False
    _step: bool = False  # within an executor's training step (begin_step .. end_step): the only time it defers
    _sums: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)  # key -> each slice's sum so far
    _owned: set[tuple[int, int]] = field(default_factory=set)  # (key, slice) whose sum is ours to add into
    _keys: int = 0

    def insert(self, gm: torch.fx.GraphModule) -> int:
        """Route each ``split_with_sizes`` of a trainable parameter along its rows (``merge_weight_slices``) in
        ``gm`` through these sums; returns how many were (0 leaves ``gm`` as it was)."""
        found = 0
        for node in gm.graph.nodes:
            if (node.op == "call_function" and node.target is torch.ops.aten.split_with_sizes.default
                    and len(node.args) == 3 and node.args[2] == 0 and isinstance(node.args[0], torch.fx.Node)
                    and node.args[0].op == "get_attr" and _trainable(gm, str(node.args[0].target))):
                node.target, node.args = self.rows, (node.args[0], node.args[1], self._keys)
                self._keys += 1
                found += 1
        if found:
            gm.recompile()
        return found

    def rows(self, weight: torch.Tensor, sizes: list[int], key: int) -> tuple[torch.Tensor, ...]:
        """``weight``'s rows in pieces of ``sizes`` (the graph's node), differentiable through :meth:`add`."""
        return _Rows.apply(weight, sizes, self, key)

    def add(self, key: int, shape: torch.Size, sizes: list[int],
            grads: tuple[torch.Tensor | None, ...]) -> torch.Tensor | None:
        """One backward's gradients of ``key``'s slices (of ``sizes`` rows): added to the step's sums; returns the
        weight's gradient (``shape``) when it is to be handed over now, else None."""
        sums = self._sums.setdefault(key, [None] * len(grads))
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
        if self.defer and self._step and not self.final:
            return None
        pieces = self._sums.pop(key)
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

    def begin_step(self) -> None:
        """A training step's passes begin (the executor calls it): from now on the sums wait for the last backward."""
        self.end_step()
        self._step = True

    def end_step(self) -> int:
        """The step's passes are over (the executor calls it, whatever happened): forget every sum; returns how
        many weights had sums never handed to autograd (0 unless a step failed, or lost gradients)."""
        left = sum(any(p is not None for p in pieces) for pieces in self._sums.values())
        self._sums.clear()
        self._owned.clear()
        self._step = self.final = False
        return left


def _trainable(gm: torch.nn.Module, target: str) -> bool:
    """Is ``gm``'s attribute ``target`` a parameter that takes gradients?"""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return isinstance(obj, torch.nn.Parameter) and obj.requires_grad
