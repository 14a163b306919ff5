"""A reduction of SageMaker's public SMP v1 MNIST script, ``pt_mnist.py`` of aws/amazon-sagemaker-examples
(``training/distributed_training/pytorch/model_parallel/mnist/utils/pt_mnist.py``), every published text of it:
1938d0b (2020-12-08), 93cd954 and 187e52f (2021-05-11; formatting and import order only). Written anew, not copied:
the SMP calls and the ways the script reaches the model are the published ones, in its order.

What it keeps: ``smp.init()`` with no argument (the notebook's parameters arrive in ``SM_HP_MP_PARAMETERS``), the
model of two sub-networks (``GroupedNet``: ``Net1``'s convolutions, ``Net2``'s linears) wrapped whole by
``smp.DistributedModel``, an unused ``smp.amp.GradScaler()`` handed to the step, ``Adadelta(lr=4.0)`` inside
``smp.DistributedOptimizer`` driven by a ``StepLR``, a train step that runs the model under
``torch.cuda.amp.autocast(True)`` and returns ``(output, loss)`` (unpacked as two ``StepOutput``s), the data split
over ``smp.dp_size()`` replicas by ``smp.dp_rank()``, an evaluation step under ``torch.no_grad()`` that returns
Python numbers (lists, one per microbatch, summed), printing on ``smp.rank() == 0`` / ``smp.mp_rank() == 0``, and the
end of training: ``smp.barrier()``, then ``smp.save({"model_state_dict": model.local_state_dict(),
"optimizer_state_dict": optimizer.local_state_dict()}, PATH, partial=True)`` on ``smp.dp_rank() == 0``, then
``smp.barrier()``.

What differs, as the task allows (data and CUDA lines, SageMaker paths): MNIST and torchnet's ``SplitDataset`` are
stand-ins with the same shapes and split (synthetic images, nothing downloaded); the CUDA lines (``set_device``,
``torch.device("cuda")``, the refusal to run without CUDA) pick the CPU when there is no GPU; ``/opt/ml`` is
``--checkpoint-dir``; the S3 upload after the save is left out (it is the ``aws`` CLI, not SMP). Two additions for
the tests: ``--log-every`` (the script logs every 10th batch) and ``--resume``, which loads the checkpoint the script
writes, as its ``sync_s3_checkpoints_to_local`` helper was provided to do: ``smp.load(PATH, partial=True)``, then
``model.load_state_dict`` and ``optimizer.load_state_dict`` of the saved entries, before the first step.

    smp launch -n 2 --as-smdistributed tests/smp/smp_v1_reductions/mnist/pt_mnist.py --checkpoint-dir /tmp/mnist
"""
from __future__ import annotations

import argparse
import os
import random

import numpy as np
import smdistributed.modelparallel.torch as smp  # the published import line, unchanged
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.cuda.amp import autocast
from torch.optim.lr_scheduler import StepLR

torch.backends.cudnn.deterministic = True
torch.backends.cudnn.benchmark = False


class Net1(nn.Module):
    """The first sub-network: two convolutions and a pooling, flattened."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        return torch.flatten(F.max_pool2d(x, 2), 1)


class Net2(nn.Module):
    """The second sub-network: two linears and a log-softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), 1)


class GroupedNet(nn.Module):
    """``Net1`` then ``Net2``, the model the script wraps."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = Net1()
        self.net2 = Net2()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.net1(x))


class StandInMnist(torch.utils.data.Dataset):
    """MNIST's shapes (1x28x28 images normalised as the script's transform does, labels 0-9): a class pattern plus
    noise, fixed by ``seed`` (a data line: the script downloads MNIST)."""

    def __init__(self, samples: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        patterns = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(1234))
        self.targets = torch.randint(10, (samples,), generator=g)
        self.images = 0.8 * torch.randn(samples, 1, 28, 28, generator=g) + patterns[self.targets]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.targets[i]


def split_dataset(dataset: torch.utils.data.Dataset, parts: int, part: int) -> torch.utils.data.Dataset:
    """torchnet's ``SplitDataset`` with ``partitions={"0": 1/parts, ...}`` and ``select(str(part))``: consecutive
    equal slices (a data line)."""
    size = len(dataset) // parts  # type: ignore[arg-type]
    return torch.utils.data.Subset(dataset, range(part * size, (part + 1) * size))


@smp.step
def train_step(model, scaler, data, target):
    with autocast(1 > 0):
        output = model(data)
    loss = F.nll_loss(output, target, reduction="mean")
    model.backward(loss)
    return output, loss


def train(model, scaler, device, train_loader, optimizer, epoch: int, log_every: int) -> None:
    """One epoch: step, average the microbatches' losses, ``optimizer.step()``."""
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        _, loss_mb = train_step(model, scaler, data, target)
        loss = loss_mb.reduce_mean()
        optimizer.step()
        if smp.rank() == 0 and batch_idx % log_every == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)}] Loss: {loss.item()!r}",
                  flush=True)


@smp.step
def test_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="sum").item()
    pred = output.argmax(dim=1, keepdim=True)
    correct = pred.eq(target.view_as(pred)).sum().item()
    return loss, correct


def test(model, device, test_loader) -> float:
    """Evaluation: the step's Python numbers come back as lists (one per microbatch) and are summed."""
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            loss_batch, correct_batch = test_step(model, data, target)
            test_loss += sum(loss_batch)
            correct += sum(correct_batch)
    test_loss /= len(test_loader.dataset)
    if smp.mp_rank() == 0:
        print(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {correct}/{len(test_loader.dataset)}", flush=True)
    return test_loss


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=8, help="training batches of 64 per replica and epoch")
    p.add_argument("--epochs", type=int, default=1, help="the script trains one")
    p.add_argument("--start-epoch", type=int, default=1)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--checkpoint-dir", required=True, help="stands for /opt/ml/local_checkpoints")
    p.add_argument("--resume", action="store_true", help="load the checkpoint the script wrote (see the docstring)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    torch.cuda.manual_seed(1)

    smp.init()

    if torch.cuda.is_available():  # CUDA lines: the script requires CUDA and sets the device
        torch.cuda.set_device(smp.local_rank())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kwargs = {"batch_size": 64, "num_workers": 0, "shuffle": False}

    dataset1 = StandInMnist(64 * args.batches * smp.dp_size(), seed=10)
    if smp.dp_size() > 1:
        dataset1 = split_dataset(dataset1, smp.dp_size(), smp.dp_rank())
    dataset2 = StandInMnist(128, seed=20)
    train_loader = torch.utils.data.DataLoader(dataset1, **kwargs)
    test_loader = torch.utils.data.DataLoader(dataset2, **kwargs)

    model = GroupedNet()
    optimizer = optim.Adadelta(model.parameters(), lr=4.0)
    model = smp.DistributedModel(model)
    scaler = smp.amp.GradScaler()
    optimizer = smp.DistributedOptimizer(optimizer)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)

    path = os.path.join(args.checkpoint_dir, "pt_mnist_checkpoint.pt")
    if args.resume:
        checkpoint = smp.load(path, partial=True)
        model.load_state_dict(checkpoint["model_state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer_state_dict"])

    for epoch in range(args.start_epoch, args.start_epoch + args.epochs):
        train(model, scaler, device, train_loader, optimizer, epoch, args.log_every)
        test(model, device, test_loader)
        scheduler.step()

    if smp.rank() == 0:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
    smp.barrier()
    if smp.dp_rank() == 0:
        model_dict = model.local_state_dict()
        opt_dict = optimizer.local_state_dict()
        smp.save({"model_state_dict": model_dict, "optimizer_state_dict": opt_dict}, path, partial=True)
    smp.barrier()


if __name__ == "__main__":
    main()
