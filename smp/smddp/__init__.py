"""SageMaker's data-parallel library for PyTorch (``smdistributed.dataparallel.torch``, v1) on torch.distributed, so
that scripts written for it run on this engine unchanged: :func:`smp.alias_smdistributed` (or ``smp launch
--as-smdistributed``) makes ``import smdistributed.dataparallel.torch.<x>`` import ``smp.smddp.<x>``, the same module
objects.

Its modules are the library's: :mod:`~smp.smddp.distributed` (``init_process_group``, the rank helpers, the
collectives and ``ReduceOp`` of the API that v1.4.0 deprecated), :mod:`~smp.smddp.parallel` (its
``DistributedDataParallel``: torch's, placed as the library placed it) and :mod:`~smp.smddp.torch_smddp` (whose import
makes ``torch.distributed.init_process_group(backend="smddp")`` valid, the API since v1.4.0). Every collective is
torch.distributed's own: NCCL on CUDA, gloo on the CPU.

It may import :mod:`smp.runtime` (a free port for a world of one), never the SMP surface above it.
"""
from __future__ import annotations

__all__: list[str] = []
