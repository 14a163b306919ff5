"""Fast variant of SageMaker's data-parallel MNIST example as its revisions of 2022-06 to 2024-07 wrote it
(aws/amazon-sagemaker-examples, train_pytorch_smdataparallel_mnist.py; tests/smp/smddp_public.py names each one):
torch.distributed and torch's ``DistributedDataParallel`` with the library as the backend, ``import
smdistributed.dataparallel.torch.torch_smddp`` and ``init_process_group(backend="smddp")``, on synthetic data for a
few steps (the loop and data are model_def's). Rank 0 prints the loss averaged over the ranks each step, and saves the
trained weights.
"""
from __future__ import annotations

import os

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401  (makes backend="smddp" valid)
import torch
import torch.distributed as dist
from model_def import SEED, Net, arguments, train, train_loader
from torch.nn.parallel import DistributedDataParallel as DDP


def average(loss: torch.Tensor) -> float:
    dist.all_reduce(loss)
    return (loss / dist.get_world_size()).item()


def main() -> None:
    args = arguments("torch.distributed with the smddp backend, MNIST, fast")
    dist.init_process_group(backend="smddp")
    world, rank = dist.get_world_size(), dist.get_rank()
    local_rank = int(os.getenv("LOCAL_RANK", -1))
    torch.manual_seed(SEED)
    dist.barrier()  # the example's other ranks wait for local rank 0's download here
    loader = train_loader(args, world, rank)
    device = torch.device(f"cuda:{local_rank}") if args.device == "cuda" else torch.device("cpu")
    model = DDP(Net().to(device), device_ids=[local_rank] if device.type == "cuda" else None)
    train(model, loader, args, device, average, rank)


if __name__ == "__main__":
    main()
