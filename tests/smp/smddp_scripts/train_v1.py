"""Fast variant of SageMaker's data-parallel MNIST example as its revisions of 2020-11 to 2022-02 wrote it
(aws/amazon-sagemaker-examples, train_pytorch_smdataparallel_mnist.py; tests/smp/smddp_public.py names each one): the
library's own API, ``smdistributed.dataparallel.torch.distributed`` and its ``DistributedDataParallel``, called as they
call it, on synthetic data for a few steps (the loop and data are model_def's). Rank 0 prints the loss averaged over
the ranks (``ReduceOp.AVERAGE``) each step, and saves the trained weights.
"""
from __future__ import annotations

import smdistributed.dataparallel.torch.distributed as dist
import torch
from model_def import SEED, Net, arguments, train, train_loader
from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel as DDP

dist.init_process_group()


def average(loss: torch.Tensor) -> float:
    dist.all_reduce(loss, op=dist.ReduceOp.AVERAGE)
    return loss.item()


def main() -> None:
    args = arguments("smdistributed.dataparallel v1 MNIST, fast")
    world, rank, local_rank = dist.get_world_size(), dist.get_rank(), dist.get_local_rank()
    torch.manual_seed(SEED)
    device = torch.device(args.device)
    dist.barrier()  # the example's other ranks wait for local rank 0's download here
    loader = train_loader(args, world, rank)
    model = DDP(Net().to(device))
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        model.cuda(local_rank)
    train(model, loader, args, device, average, rank)


if __name__ == "__main__":
    main()
