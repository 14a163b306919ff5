"""``Compose``, ``ToTensor`` (a uint8 HxW image to a float 1xHxW tensor in [0, 1]) and ``Normalize``."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["Compose", "ToTensor", "Normalize"]


class Compose:
    """Apply the transforms in order."""

    def __init__(self, transforms: Sequence[Callable]) -> None:
        self.transforms = list(transforms)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        for transform in self.transforms:
            image = transform(image)
        return image


class ToTensor:
    """A uint8 HxW image to a float 1xHxW tensor in [0, 1]."""

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image.unsqueeze(0).float().div(255)


class Normalize:
    """Subtract each channel's mean and divide by its standard deviation."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return (image - self.mean) / self.std
