"""An SMP v1 training script, as the public MNIST example writes one, run with only its import changed.

    smp launch -n 2 examples/smp_v1_mnist.py --steps 8 --ckpt /tmp/mnist                  # 2 pipeline stages
    smp launch -n 4 examples/smp_v1_mnist.py --steps 8 --ckpt /tmp/mnist                  # 2 stages x 2 replicas
    smp launch -n 2 examples/smp_v1_mnist.py --steps 8 --ckpt /tmp/mnist --stop-after 4   # save at step 4, stop
    smp launch -n 2 examples/smp_v1_mnist.py --steps 8 --ckpt /tmp/mnist --resume         # go on from there

What it shows, in SMP v1's own idioms: only pp_rank 0 reads data (the other pipeline ranks learn the number of
batches with ``smp.broadcast(n, smp.PP_GROUP)`` / ``smp.recv_from(0, smp.RankType.PP_RANK)`` and feed empty
placeholders); the step returns ``loss.item()``, which comes back as a list with one value per microbatch, so
``sum(loss_batch)`` works; the checkpoint is ``smp.save(..., partial=True)`` on ``smp.rdp_rank() == 0`` and
``smp.load(..., partial=True)`` on every replica. The data is MNIST-shaped and random (nothing is downloaded).
A resumed run prints the same losses as an uninterrupted one, digit for digit.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import smp  # was: import smdistributed.modelparallel.torch as smp


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.fc1 = nn.Linear(16 * 12 * 12, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return F.log_softmax(self.fc2(F.relu(self.fc1(torch.flatten(x, 1)))), dim=1)


class RandomMnist:
    """``steps`` batches of MNIST-shaped images with a per-class pattern, different on every replica."""

    def __init__(self, steps: int, batch: int, replica: int, seed: int = 1):
        self.steps, self.batch, self.replica, self.seed = steps, batch, replica, seed
        self.patterns = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for step in range(self.steps):
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.replica * 10_007 + step)
            target = torch.randint(10, (self.batch,), generator=g)
            yield 0.5 * torch.randn(self.batch, 1, 28, 28, generator=g) + self.patterns[target], target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="batch per data-parallel replica")
    p.add_argument("--ckpt", required=True, help="checkpoint directory")
    p.add_argument("--stop-after", type=int, default=None, help="save a checkpoint after this step and stop")
    p.add_argument("--resume", action="store_true", help="start from the checkpoint in --ckpt")
    args = p.parse_args()

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "interleaved",
              "ddp": int(os.environ.get("WORLD_SIZE", "1")) > 2})
    torch.manual_seed(1)
    model = smp.DistributedModel(Net())
    optimizer = smp.DistributedOptimizer(torch.optim.Adadelta(model.parameters(), lr=0.3))
    start = 0
    if args.resume:  # before the first step: applied right after partitioning, cut as it was saved
        model.load_state_dict(smp.load(os.path.join(args.ckpt, "model"), partial=True))
        saved = smp.load(os.path.join(args.ckpt, "optimizer"), partial=True)
        optimizer.load_state_dict(saved["optimizer"])
        start = saved["step"]

    @smp.step
    def train_step(model, data, target):
        output = model(data)
        loss = F.nll_loss(output, target)
        model.backward(loss)
        return loss.item()

    if smp.pp_rank() == 0:  # SMP v1: only the first stage reads data
        loader = RandomMnist(args.steps, args.batch, smp.dp_rank())
        smp.broadcast(len(loader), smp.PP_GROUP)
    else:
        steps = smp.recv_from(0, smp.RankType.PP_RANK)
        loader = [(torch.empty(0), torch.empty(0))] * steps  # placeholders: pp_rank 0's batch is used

    model.train()
    for step, (data, target) in enumerate(loader):
        if step < start:
            continue
        loss_batch = train_step(model, data, target)
        loss = sum(loss_batch) / len(loss_batch)
        losses = smp.allgather(loss, smp.DP_GROUP)
        optimizer.step()
        optimizer.zero_grad()
        if smp.rank() == 0:
            print(f"step {step + 1}/{len(loader)} loss {sum(losses) / len(losses)!r}", flush=True)
        if step + 1 == args.stop_after:
            if smp.rdp_rank() == 0:  # one replica writes the files every replica reads
                smp.save(model.local_state_dict(), os.path.join(args.ckpt, "model"), partial=True)
                smp.save({"optimizer": optimizer.local_state_dict(), "step": step + 1},
                         os.path.join(args.ckpt, "optimizer"), partial=True)
            smp.barrier()
            break


if __name__ == "__main__":
    main()
