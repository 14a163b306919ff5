"""The tensor-parallel ops a sharded graph calls: Megatron's f and g, the vocabulary-parallel embedding and
cross-entropy, the gather of sharded outputs and dropout from the engine's own streams.

Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053, section 3) makes a transformer block tensor-parallel with
two conjugate operators around each pair of column- and row-parallel matmuls: ``f`` is the identity forward
and an all-reduce of the gradient backward (before a column-parallel matmul, whose input every rank holds
whole); ``g`` is an all-reduce forward and the identity backward (after a row-parallel matmul, whose output
is a partial sum). Both are DTensor redistributions here (``Replicate`` to a gradient that is ``Partial``, and
``Partial`` to ``Replicate``), so the collectives are torch's own and run on gloo and NCCL alike. The
vocabulary-parallel cross-entropy (Megatron's ``vocab_parallel_cross_entropy``) exchanges three numbers per
token (the maximum logit, the sum of exponentials and the target's logit), never the logits.

The ops take a :class:`TPComm`, a handle that a sharded graph holds as an attribute (``get_attr``): the
partitioner writes graphs without any process, and the runtime binds the handle to its tensor-parallel
process group (:meth:`TPComm.bind`) before a step runs.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["TPComm", "UnboundGroupError", "shard_range", "copy_to", "reduce_from", "gather_from", "scatter_to",
           "vocab_embedding", "vocab_cross_entropy", "tp_dropout", "tp_attention", "FOLDED", "Tokens",
           "seq_reduce_scatter", "seq_gather", "seq_scatter", "seq_gather_whole", "SEQUENCE_OPS"]


class UnboundGroupError(RuntimeError):
    """A tensor-parallel graph ran before its :class:`TPComm` was bound to a process group."""


def shard_range(size: int, tp: int, rank: int) -> tuple[int, int]:
    """The ``[start, stop)`` of tp rank ``rank``'s shard of a dimension of ``size``: ``torch.chunk``'s (and
    DTensor's) layout, ``ceil(size / tp)`` per rank and the remainder on the last ones."""
    if not 0 <= rank < tp:
        raise ValueError(f"tp rank {rank} is outside a tensor-parallel group of {tp}")
    chunk = -(-size // tp)
    return min(rank * chunk, size), min((rank + 1) * chunk, size)


@dataclass(eq=False)
class TPComm:
    """The tensor-parallel group a sharded graph's collectives run on. ``size`` and ``rank`` are fixed when the
    graph is written for one tp rank; :meth:`bind` gives it the process group (and the seeds of its dropout
    streams) at run time."""

    size: int
    rank: int
    group: Any = None
    mesh: Any = None
    generators: dict[str, torch.Generator] = field(default_factory=dict)

    def bind(self, group: Any, device: torch.device | str = "cpu", seed: int = 0) -> None:
        """Run the collectives on ``group`` (this rank's tp group, of ``size`` ranks, in which it is ``rank``).
        ``seed`` seeds the dropout streams: the same on every rank of the group."""
        from torch.distributed.device_mesh import DeviceMesh
        if dist.get_world_size(group) != self.size or dist.get_rank(group) != self.rank:
            raise ValueError(f"the graph was sharded for tp rank {self.rank} of {self.size}, but this process is "
                             f"rank {dist.get_rank(group)} of a tp group of {dist.get_world_size(group)}")
        dev = torch.device(device)
        self.group, self.mesh = group, DeviceMesh.from_group(group, dev.type)
        # Megatron's rule: activations every tp rank holds whole draw the same mask on each, shards their own.
        self.generators = {"replicated": torch.Generator(dev).manual_seed(seed),
                           "sharded": torch.Generator(dev).manual_seed(seed + 1 + self.rank)}

    def replay(self) -> tuple[Any, Any]:
        """Contexts for ``torch.utils.checkpoint``'s ``context_fn``: the forward records the dropout streams'
        states, the recomputation draws from those states again (the same masks) and leaves the streams where the
        forward left them."""
        saved: dict[str, torch.Tensor] = {}

        @contextmanager
        def forward() -> Iterator[None]:
            saved.update({k: g.get_state() for k, g in self.generators.items()})
            yield

        @contextmanager
        def recompute() -> Iterator[None]:
            after = {k: g.get_state() for k, g in self.generators.items()}
            for k, g in self.generators.items():
                g.set_state(saved[k])
            try:
                yield
            finally:
                for k, g in self.generators.items():
                    g.set_state(after[k])
        return forward(), recompute()

    def bound_mesh(self) -> Any:
        """The device mesh of the bound group (raises :class:`UnboundGroupError` before :meth:`bind`)."""
        if self.mesh is None:
            raise UnboundGroupError(f"a graph sharded for tensor parallelism (tp rank {self.rank} of {self.size}) "
                                    "ran without its process group: run it through the engine's runner, which "
                                    "binds it (TPComm.bind)")
        return self.mesh


def _dtensor(x: torch.Tensor, comm: TPComm, placement: Any) -> Any:
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(x, comm.bound_mesh(), [placement], run_check=False)


def copy_to(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """Megatron's ``f``: ``x`` unchanged forward; its gradient, a partial sum on each rank, all-reduced backward."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.placement_types import Replicate
    return _dtensor(x, comm, Replicate()).to_local(grad_placements=[Partial()])


def reduce_from(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """Megatron's ``g``: the partial sums ``x`` all-reduced forward; the gradient passed through backward."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.placement_types import Replicate
    return _dtensor(x, comm, Partial()).redistribute(comm.mesh, [Replicate()]).to_local()


def gather_from(x: torch.Tensor, dim: int, size: int, comm: TPComm) -> torch.Tensor:
    """The whole tensor from each rank's shard of it along ``dim`` (global length ``size``, sharded as
    :func:`shard_range`); backward, each rank keeps its shard of the gradient."""
    from torch.distributed.tensor.placement_types import Replicate, Shard
    shape = list(x.shape)
    shape[dim] = size
    stride = torch.empty(shape, device="meta").stride()
    from torch.distributed.tensor import DTensor
    whole = DTensor.from_local(x, comm.bound_mesh(), [Shard(dim)], run_check=False, shape=torch.Size(shape),
                               stride=stride)
    return whole.redistribute(comm.mesh, [Replicate()]).to_local()


def scatter_to(x: torch.Tensor, dim: int, comm: TPComm) -> torch.Tensor:
    """This rank's slice along ``dim`` of a value every rank holds whole (:func:`shard_range`); backward, the
    slices' gradients are gathered, so the whole value gets its whole gradient on every rank (Megatron's
    ``scatter_to_tensor_model_parallel_region``)."""
    from torch.distributed.tensor.placement_types import Replicate, Shard
    return _dtensor(x, comm, Replicate()).redistribute(comm.mesh, [Shard(dim)]).to_local()


# Where a tensor holds its tokens, for sequence parallelism (partitioner.tp.sequence): dimension ``dim`` is ``outer``
# x sequence x ``inner`` long (a (batch, sequence, hidden) activation: (1, 1, 1); flattened to (batch x sequence,
# hidden): (0, batch, 1)), and the sequence factor is what the ranks split.
Tokens = tuple[int, int, int]


def _on_tokens(x: torch.Tensor, tokens: Tokens, tp: int, fn: Any, grow: bool) -> torch.Tensor:
    """``fn(view, axis)`` on ``x`` viewed with its sequence on an axis of its own, viewed back; ``grow``: ``fn``
    returns the whole sequence (``tp`` times this rank's), else this rank's slice of it."""
    dim, outer, inner = tokens
    shape = list(x.shape)
    length = shape[dim] // (outer * inner)
    out = fn(x.reshape(shape[:dim] + [outer, length, inner] + shape[dim + 1:]), dim + 1)
    shape[dim] = outer * inner * (length * tp if grow else length // tp)
    return out.reshape(shape)


def seq_reduce_scatter(x: torch.Tensor, tokens: Tokens, comm: TPComm) -> torch.Tensor:
    """Megatron's ``g`` under sequence parallelism: the partial sums ``x`` reduce-scattered along the sequence
    forward (each rank keeps the sum of its slice); backward, the slices' gradients all-gathered."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.placement_types import Shard
    return _on_tokens(x, tokens, comm.size, lambda v, axis: _dtensor(v, comm, Partial()).redistribute(
        comm.mesh, [Shard(axis)]).to_local(), grow=False)


def seq_gather(x: torch.Tensor, tokens: Tokens, comm: TPComm) -> torch.Tensor:
    """Megatron's ``f`` under sequence parallelism: the sequence all-gathered forward from each rank's slice (the
    whole value a column-parallel matmul reads); backward, the gradient (a partial sum on each rank)
    reduce-scattered along the sequence."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.placement_types import Replicate, Shard
    return _on_tokens(x, tokens, comm.size, lambda v, axis: _dtensor(v, comm, Shard(axis)).redistribute(
        comm.mesh, [Replicate()]).to_local(grad_placements=[Partial()]), grow=True)


def seq_scatter(x: torch.Tensor, tokens: Tokens, comm: TPComm) -> torch.Tensor:
    """This rank's slice along the sequence of a value every rank holds whole (position embeddings added to the
    residual stream); backward, the slices' gradients gathered into the whole value's (:func:`scatter_to`)."""
    return _on_tokens(x, tokens, comm.size, lambda v, axis: scatter_to(v, axis, comm), grow=False)


def seq_gather_whole(x: torch.Tensor, tokens: Tokens, comm: TPComm) -> torch.Tensor:
    """The whole sequence from each rank's slice, for ops every rank then runs whole (an output, an op that mixes
    positions); backward, each rank keeps its slice of the gradient (:func:`gather_from`)."""
    return _on_tokens(x, tokens, comm.size, lambda v, axis: gather_from(v, axis, v.shape[axis] * comm.size, comm),
                      grow=True)


# The sequence-parallel collectives (partitioner.tp.sequence), priced by partitioner.tp.pricing.
SEQUENCE_OPS = frozenset({seq_reduce_scatter, seq_gather, seq_scatter, seq_gather_whole})

# The collectives that join the op whose result they carry (partitioner.capture.build's ``folded``): no stage cut
# between a row-parallel matmul and its all-reduce, and Megatron's f and the gather of an output stay with the value
# they act on.
FOLDED = frozenset({copy_to, gather_from, reduce_from, scatter_to}) | SEQUENCE_OPS


def vocab_embedding(weight: torch.Tensor, ids: torch.Tensor, start: int, padding_idx: int,
                    comm: TPComm, tokens: Tokens | None = None) -> torch.Tensor:
    """Rows ``ids`` of an embedding whose rows ``[start, start + len(weight))`` this rank holds: each rank looks
    up the ids it holds, zeros elsewhere, and ``g`` sums the ranks' lookups (reduce-scatters them along the
    sequence where the output holds ``tokens``: sequence parallelism)."""
    stop = start + weight.shape[0]
    outside = (ids < start) | (ids >= stop)
    local = torch.where(outside, torch.zeros_like(ids), ids - start)
    pad = padding_idx - start if start <= padding_idx < stop else -1
    rows = F.embedding(local, weight, padding_idx=pad if pad >= 0 else None) if weight.shape[0] else \
        weight.new_zeros((*ids.shape, weight.shape[1]))
    rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from(rows, comm) if tokens is None else seq_reduce_scatter(rows, tokens, comm)


def vocab_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int, reduction: int,
                        ignore_index: int, comm: TPComm) -> torch.Tensor:
    """``aten.cross_entropy_loss(logits, target)`` over logits whose classes ``[start, start + logits.shape[-1])``
    this rank holds (``reduction``: aten's 0 none, 1 mean, 2 sum). Three numbers per token cross the group."""
    from torch.distributed import _functional_collectives as funcol
    width = logits.shape[-1]
    local_max = logits.detach().amax(-1) if width else logits.new_full(logits.shape[:-1], float("-inf"))
    comm.bound_mesh()
    # The maximum only keeps exp() in range: any value common to the group gives the same loss, so no gradient.
    top = funcol.all_reduce(local_max, "max", comm.group)
    shifted = logits - top.unsqueeze(-1)
    total = reduce_from(shifted.exp().sum(-1), comm)
    mine = (target >= start) & (target < start + width)
    index = torch.where(mine, target - start, torch.zeros_like(target)).clamp(max=max(width - 1, 0))
    picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) if width else torch.zeros_like(total)
    target_logit = reduce_from(torch.where(mine, picked, torch.zeros_like(picked)), comm)
    valid = target != ignore_index
    loss = torch.where(valid, total.log() - target_logit, torch.zeros_like(total))
    if reduction == 0:
        return loss
    if reduction == 2:
        return loss.sum()
    return loss.sum() / valid.sum().to(loss.dtype)


def tp_dropout(x: torch.Tensor, p: float, train: bool, sharded: bool, comm: TPComm) -> torch.Tensor:
    """``aten.dropout`` drawing its mask from the engine's stream for a ``sharded`` or a replicated activation."""
    if not train or p == 0.0:
        return x
    comm.bound_mesh()
    if isinstance(x, FakeTensor):
        return x * 1.0
    keep = torch.empty_like(x).bernoulli_(1.0 - p, generator=comm.generators["sharded" if sharded else "replicated"])
    return x * keep / (1.0 - p)


def tp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False, *, sharded: bool, comm: TPComm) -> torch.Tensor:
    """``scaled_dot_product_attention`` whose dropout draws from the engine's stream for a ``sharded`` (heads
    split over the group: independent masks) or a whole attention (the same mask on every rank), in a forked
    random state: the user's global stream is neither read nor advanced."""
    comm.bound_mesh()
    if isinstance(q, FakeTensor):  # a shape-only run (the runner's boundary analysis) draws no random numbers
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    gen = comm.generators["sharded" if sharded else "replicated"]
    seed = int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device))
    with torch.random.fork_rng(devices=[q.device] if q.device.type != "cpu" else [], device_type=q.device.type):
        torch.manual_seed(seed)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
