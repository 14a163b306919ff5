"""What the fast variants share, so that each script holds only its API's lines: the network, the data, the
command line and the training loop, and the single-process run they are compared with.

The network is a small convolutional classifier ending in log-softmax, as the public example's is, without its dropout:
neither the ranks nor one process draw random numbers, so their losses compare exactly. The data is synthetic,
MNIST-sized, in place of the example's download.
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

__all__ = ["Net", "SyntheticMNIST", "SEED", "arguments", "train_loader", "train", "reference_losses"]

SEED = 1  # the example's --seed default: every rank builds the same initial weights from it


class Net(nn.Module):
    """A strided convolution, then a linear layer to the ten classes' log-probabilities."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 5, stride=2)
        self.fc = nn.Linear(4 * 12 * 12, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.fc(torch.flatten(F.relu(self.conv(x)), 1)), dim=1)


class SyntheticMNIST(Dataset):
    """``size`` normalised 1x28x28 images and labels in 0..9, the same for every process."""

    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(2020)
        self.images = torch.randn(size, 1, 28, 28, generator=g)
        self.labels = torch.randint(0, 10, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


def arguments(description: str) -> argparse.Namespace:
    """The variants' command line: the batch per rank, the steps, the learning rate, the device, where to save."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--save", required=True)
    return parser.parse_args()


def train_loader(args: argparse.Namespace, world: int, rank: int) -> DataLoader:
    """This rank's part of ``args.steps`` global batches, through a DistributedSampler, as the example loads MNIST."""
    dataset = SyntheticMNIST(args.batch_size * args.steps * world)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank)
    return DataLoader(dataset, batch_size=args.batch_size, shuffle=False, num_workers=0, sampler=sampler)


def train(model: nn.Module, loader: DataLoader, args: argparse.Namespace, device: torch.device,
          average: Callable[[torch.Tensor], float], rank: int) -> None:
    """The example's loop with its optimizer and schedule; rank 0 prints each step's loss averaged over the ranks
    (``average``, the API's all-reduce) and saves the trained weights at the end."""
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    model.train()
    for step, (data, target) in enumerate(loader, 1):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        mean = average(loss.detach().clone())
        if rank == 0:
            print(f"step {step} loss {mean!r}")
    scheduler.step()
    if rank == 0:
        torch.save(model.state_dict(), args.save)


def reference_losses(world: int, batch: int, steps: int, lr: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the same model and optimizer, each step on the concatenation of the ranks' batches of that step
    (each rank's DistributedSampler): the losses and the trained weights that DDP's averaged gradients must give."""
    dataset = SyntheticMNIST(batch * steps * world)
    loaders = [DataLoader(dataset, batch_size=batch, sampler=DistributedSampler(dataset, world, rank))
               for rank in range(world)]
    torch.manual_seed(SEED)
    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=lr)
    losses = []
    for parts in zip(*loaders):
        data, target = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()
