"""Tiny models several test modules plan."""

from __future__ import annotations

import torch
from torch import nn


class Branchy(nn.Module):
    """Convs, a residual add, GroupNorm (drops channels-last), a pad and a pooled head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 1))
        self.gn = nn.GroupNorm(2, 8)
        self.tail = nn.Conv2d(8, 4, 3)
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.stem(x)))
        x = x + self.body(x)
        x = nn.functional.pad(self.gn(x), (1, 1, 1, 1))
        x = self.tail(x)
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class Features(nn.Module):
    """Returns a feature map: its format must come back as the original's."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3)
        self.b = nn.Conv2d(8, 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def batch(n: int = 2, size: int = 12) -> torch.Tensor:
    """A random image batch of ``n`` 3-channel ``size`` x ``size`` images."""
    return torch.randn(n, 3, size, size)
