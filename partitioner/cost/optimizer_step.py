"""The optimizer's step priced: the memory it streams, at the device's memory bandwidth.

An optimizer step is elementwise over every parameter a rank updates, so it is memory-bound on every device: its
seconds are the bytes it reads and writes over the roofline's memory rate (``bytes_per_s x memory_efficiency``).
torch's default implementations (``foreach``, on CPU and CUDA) sweep the state tensors in several passes; per fp32
element of a trained parameter, counting each tensor read or written once per pass (torch/optim/adam.py,
``_multi_tensor_adam``): Adam 19 accesses (the first moment's ``lerp_`` toward the gradient 3, the second moment's
``mul_`` 2 and ``addcmul_`` of the gradient squared 4, its square root, bias correction and epsilon 6, the update's
``addcdiv_`` 4), AdamW 21 (the decoupled weight decay's ``mul_`` of the weights 2 more), SGD with momentum 8 (the
buffer's ``mul_`` 2 and ``add_`` of the gradient 3, the update 3). Priced per byte of optimizer state the rank holds
(8 per element for Adam, 4 for SGD, :data:`partitioner.cost.precision.OPTIMIZER_STATE_FACTOR`), so ZeRO-1's and
sharded data parallelism's shards price 1/D of the step; under mixed precision the fp32 master weights are also
copied to the 16-bit weights (4 bytes read, 2 written per element).

On this machine's CPU, a 7.2M-parameter Llama's AdamW step, priced 24 ms at the calibrated 25 GB/s, took 16 to 21
ms.
"""
from __future__ import annotations

from .devices import DeviceRates

__all__ = ["optimizer_step_s", "TRAFFIC_PER_STATE_BYTE"]

# Bytes read and written per byte of optimizer state (fp32 accesses per element x 4 / state bytes per element).
TRAFFIC_PER_STATE_BYTE = {"adam": 19 * 4 / 8, "adamw": 21 * 4 / 8, "sgd": 8 * 4 / 4, "none": 0.0}
_MASTER_COPY = 6 / 4  # per fp32 master byte: read it, write the 16-bit weight


def optimizer_step_s(optimizer_bytes: float, master_bytes: float, optimizer: str, rates: DeviceRates) -> float:
    """Seconds of one optimizer step over ``optimizer_bytes`` of ``optimizer``'s state (and ``master_bytes`` of fp32
    master weights copied to the weights), at ``rates``' memory rate."""
    moved = optimizer_bytes * TRAFFIC_PER_STATE_BYTE[optimizer] + master_bytes * _MASTER_COPY
    return moved / (rates.bytes_per_s * rates.memory_efficiency)
