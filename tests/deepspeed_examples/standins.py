"""Local stand-ins for what the ported DeepSpeedExamples scripts would download or import from packages that are
not installed here (each port's docstring says which lines use them). Nothing here is DeepSpeed's or zerofit's:
they only feed the scripts tiny data that the tests write.

- ``datasets.CIFAR10`` and ``transforms`` (torchvision's names): a CIFAR-shaped data set read from
  ``<root>/cifar10_{train,test}.pt`` (``{"data": uint8 (N, 32, 32, 3), "targets": [int]}``, as torchvision
  keeps CIFAR-10 in memory), and torchvision's ``Compose``, ``ToTensor`` (HWC uint8 -> CHW float in [0, 1]) and
  ``Normalize`` ((x - mean) / std per channel).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
from torch.utils.data import Dataset


class _Compose:
    def __init__(self, ts):
        self.ts = ts

    def __call__(self, x):
        for t in self.ts:
            x = t(x)
        return x


class _ToTensor:
    def __call__(self, img):
        return img.permute(2, 0, 1).contiguous().float().div(255)


class _Normalize:
    def __init__(self, mean, std):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x):
        return (x - self.mean) / self.std


transforms = SimpleNamespace(Compose=_Compose, ToTensor=_ToTensor, Normalize=_Normalize)


class CIFAR10(Dataset):
    def __init__(self, root, train=True, download=False, transform=None):
        blob = torch.load(os.path.join(root, f"cifar10_{'train' if train else 'test'}.pt"))
        self.data, self.targets, self.transform = blob["data"], list(blob["targets"]), transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        img = self.data[i]
        return (self.transform(img) if self.transform else img), self.targets[i]


datasets = SimpleNamespace(CIFAR10=CIFAR10)


def write_cifar10(root, n_train: int = 64, n_test: int = 20, seed: int = 0) -> None:
    """The tiny CIFAR-shaped data set the cifar10 port reads (every class in the test split, whose accuracy per
    class the script prints; its size a multiple of the script's test batch of 4)."""
    g = torch.Generator().manual_seed(seed)
    os.makedirs(root, exist_ok=True)
    for name, n in (("train", n_train), ("test", n_test)):
        targets = torch.arange(n) % 10
        torch.save({"data": torch.randint(0, 256, (n, 32, 32, 3), generator=g, dtype=torch.uint8),
                    "targets": targets[torch.randperm(n, generator=g)].tolist()},
                   os.path.join(root, f"cifar10_{name}.pt"))
