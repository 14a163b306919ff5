"""A stand-in for torchvision with what SageMaker's data-parallel MNIST script uses: synthetic ``datasets.MNIST``
and the ``transforms`` it composes. Its version is one after 0.9.1, so the script sets ``MNIST.mirrors``."""
from __future__ import annotations

from torchvision import datasets, transforms

__all__ = ["datasets", "transforms"]
__version__ = "0.15.2"
