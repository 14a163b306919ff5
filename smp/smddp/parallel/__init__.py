"""``smdistributed.dataparallel.torch.parallel``: the library's ``DistributedDataParallel``, which scripts import from
here or from :mod:`~smp.smddp.parallel.distributed`."""
from __future__ import annotations

from smp.smddp.parallel.distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
