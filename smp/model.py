"""SMP v1's module ``smdistributed.modelparallel.torch.model``, where its ``DistributedModel`` class lives.

Code written for SMP names the class by that path: Hugging Face's ``Trainer`` checks
``isinstance(model, smp.model.DistributedModel)`` before wrapping a model, so ``smp.model`` must be a module
holding it. The class itself is :class:`smp.distributed_model.DistributedModel`.
"""
from smp.distributed_model import DistributedModel

__all__ = ["DistributedModel"]
