"""``MNIST``: deterministic synthetic 28x28 uint8 images and labels in place of the download."""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch.utils.data import Dataset

__all__ = ["MNIST", "SIZES_ENV"]

SIZES_ENV = "SMP_STANDIN_MNIST_SIZES"  # "train,test": how many images each split has (default 1024,256)


class MNIST(Dataset):
    """torchvision's ``MNIST(root, train, transform, target_transform, download)``, generated instead of read."""

    resources: list[Any] = []  # the script points these at its own bucket; nothing is downloaded here
    mirrors: list[str] = []

    def __init__(self, root: str, train: bool = True, transform: Callable | None = None,
                 target_transform: Callable | None = None, download: bool = False) -> None:
        train_size, test_size = (int(n) for n in os.environ.get(SIZES_ENV, "1024,256").split(","))
        g = torch.Generator().manual_seed(0 if train else 1)
        size = train_size if train else test_size
        self.data = torch.randint(0, 256, (size, 28, 28), dtype=torch.uint8, generator=g)
        self.targets = torch.randint(0, 10, (size,), generator=g)
        self.transform, self.target_transform = transform, target_transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        image, target = self.data[index], int(self.targets[index])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target
