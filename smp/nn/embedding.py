"""``smp.nn.DistributedEmbedding``: SMP v1's tensor-parallel ``nn.Embedding``.

SMP v1 splits the embedding dimension over the tp ranks, or the vocabulary with ``vocab_parallel=True``
(Megatron's vocabulary-parallel embedding, Shoeybi et al. 2019, arXiv:1909.08053). Here it is an
``nn.Embedding`` of the global sizes initialised as SMP does (normal, ``initializer_range``); the engine's
tensor parallelism splits the vocabulary where the traced graph allows (:mod:`partitioner.tp.sharding`), which
computes the same function either way.
"""
from __future__ import annotations

import torch

from smp.nn.dist_module import DistributedModule

__all__ = ["DistributedEmbedding"]


class DistributedEmbedding(torch.nn.Embedding, DistributedModule):
    """``nn.Embedding`` with SMP v1's constructor; ``max_norm`` and ``_weight`` are refused, as in SMP."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, vocab_parallel: bool = False, _weight: torch.Tensor | None = None,
                 initializer_range: float = 0.02, _skip_allgather: bool = False,
                 _skip_scatter_and_merge: bool = False, _output_full_batch: bool = False):
        if max_norm is not None:
            raise ValueError(f"DistributedEmbedding(max_norm={max_norm}): max_norm is not supported (it renormalises "
                             "rows in place, across tp ranks); pass max_norm=None")
        if _weight is not None:
            raise ValueError("DistributedEmbedding(_weight=...): passing an initial weight is not supported; load it "
                             "with load_state_dict after construction")
        self.initializer_range = initializer_range
        self.vocab_parallel = vocab_parallel
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx, norm_type=norm_type,
                         scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)

    def reset_parameters(self) -> None:
        """SMP's initialisation: normal with ``initializer_range``; the padding row zero."""
        torch.nn.init.normal_(self.weight, 0.0, self.initializer_range)
        self._fill_padding_idx_with_zero()
