"""``smp.nn``: the modules SMP v1 scripts import from ``smdistributed.modelparallel.torch.nn``.

Distributed modules with SMP v1's constructors, forward signatures and parameter names
(:class:`DistributedLinear`, :class:`DistributedEmbedding`, :class:`DistributedTransformerLMHead`,
:class:`DistributedTransformer`, :class:`DistributedTransformerLayer`, :class:`DistributedAttentionLayer`,
:class:`DistributedTransformerOutputLayer`; their base :class:`DistributedModule`), apex's
:class:`FusedLayerNorm`, and in :mod:`smp.nn.huggingface` the hooks and state-dict translators that let them
stand in for Hugging Face GPT-2, BERT, RoBERTa, GPT-J and GPT-Neo. Each computes the single-device function
with full-size weights until ``smp.DistributedModel`` splits it over the tensor-parallel ranks
(:mod:`smp.nn.dist_module` says how this differs from SMP v1).
"""
from smp.nn.attention import DistributedAttentionLayer
from smp.nn.dist_module import DistributedModule
from smp.nn.embedding import DistributedEmbedding
from smp.nn.layer_norm import FusedLayerNorm
from smp.nn.linear import DistributedLinear
from smp.nn.lm_head import DistributedTransformerLMHead
from smp.nn.output_layer import DistributedTransformerOutputLayer
from smp.nn.transformer import DistributedTransformer, DistributedTransformerLayer

__all__ = ["FusedLayerNorm", "DistributedModule", "DistributedLinear", "DistributedEmbedding",
           "DistributedTransformerLMHead", "DistributedTransformer", "DistributedTransformerLayer",
           "DistributedAttentionLayer", "DistributedTransformerOutputLayer"]
