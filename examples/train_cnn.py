"""The classic MNIST model-parallel example, pipelined over processes with the SMP-compatible API.

    smp launch -n 2 examples/train_cnn.py --steps 8
    smp launch -n 2 examples/train_cnn.py --pipeline simple --microbatches 8 --batch 128

Two convolutions, max pooling, dropout, two linear layers and ``log_softmax`` with ``nll_loss``, trained with
Adadelta and a StepLR schedule, as in the MNIST example of SageMaker model parallelism. The data has
MNIST's shape (1 x 28 x 28 images, 10 classes) but is random, with a per-class pattern added so the
classes can be learned; nothing is downloaded. Written as an SMP v1 script: ``import smp`` in place of
``import smdistributed.modelparallel.torch as smp``.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import smp


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    p.add_argument("--batch", type=int, default=64, help="global batch size (default 64)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default 4)")
    p.add_argument("--pipeline", choices=("interleaved", "simple"), default="interleaved",
                   help="interleaved = 1F1B (default), simple = GPipe")
    p.add_argument("--partitions", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--lr", type=float, default=0.3, help="Adadelta learning rate (default 0.3; the MNIST "
                   "example's 1.0 overshoots on the first step with this data)")
    p.add_argument("--gamma", type=float, default=0.7, help="StepLR decay per --decay-every steps (default 0.7)")
    p.add_argument("--decay-every", type=int, default=4, help="StepLR period in steps (default 4)")
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args(argv)


def make_batch(step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST-shaped random images plus their class's pattern; the same on every rank (seeded by step)."""
    patterns = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(args.seed))
    g = torch.Generator().manual_seed(args.seed * 100_003 + step + 1)
    target = torch.randint(10, (args.batch,), generator=g)
    data = 0.5 * torch.randn(args.batch, 1, 28, 28, generator=g) + patterns[target]
    return data, target


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    smp.init({"pipeline_parallel_degree": args.partitions, "microbatches": args.microbatches,
              "pipeline": args.pipeline, "ddp": int(os.environ.get("WORLD_SIZE", "1")) > args.partitions})
    torch.manual_seed(args.seed)
    model = smp.DistributedModel(Net())
    optimizer = smp.DistributedOptimizer(torch.optim.Adadelta(model.parameters(), lr=args.lr))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.decay_every, gamma=args.gamma)
    if smp.rank() == 0:
        print(f"MNIST CNN on {smp.size()} processes: {smp.pp_size()} pipeline stages x {smp.dp_size()} "
              f"replica(s), {args.microbatches} microbatches, pipeline={args.pipeline}")
        model.register_post_partition_hook(lambda m, _: print("partition plan:\n" + m.runner.plan.summary(),
                                                              flush=True))

    @smp.step
    def train_step(model, data, target):
        output = model(data)
        loss = F.nll_loss(output, target, reduction="mean")
        model.backward(loss)
        return output, loss

    model.train()
    shard = args.batch // smp.dp_size()
    for step in range(args.steps):
        t0 = time.perf_counter()
        data, target = make_batch(step, args)
        lo, hi = smp.dp_rank() * shard, (smp.dp_rank() + 1) * shard
        output, loss = train_step(model, data[lo:hi], target[lo:hi])
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if smp.rank() == 0:
            correct = (output.concat().argmax(1) == target[lo:hi]).float().mean()
            print(f"step {step + 1:3d}/{args.steps}  loss {float(loss.reduce_mean()):.4f}  "
                  f"accuracy {float(correct):.2f}  {time.perf_counter() - t0:6.3f} s", flush=True)
    smp.barrier()


if __name__ == "__main__":
    main()
