"""Model files the fault-injection tests hand to the CLI (``file.py:factory`` specs)."""

from __future__ import annotations

from pathlib import Path

MODELS = '''
import torch
from torch import nn


class Gate(nn.Module):
    """A branch on a tensor's value: neither torch.fx nor torch.export takes it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        if x.mean() > 0:
            return self.conv(x)
        return self.conv(x) * 2


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.gate = Gate()
        self.head = nn.Sequential(nn.Conv2d(8, 4, 3, padding=1), nn.ReLU())

    def forward(self, x):
        return self.head(self.gate(self.stem(x)))


def gated():
    """Captured in parts: the whole model and its gate are not (the same reason twice)."""
    return Gated().eval(), torch.randn(2, 3, 16, 16)


def on_meta():
    """Built under torch.device("meta"): shapes without values."""
    with torch.device("meta"):
        net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
    return net, torch.randn(2, 3, 16, 16)


def own_input():
    """Brings its own input, of batch 2 (``--batch`` does not apply to it)."""
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).eval(), torch.randn(2, 3, 16, 16)
'''


def write_models(folder: Path) -> Path:
    path = folder / "fault_models.py"
    path.write_text(MODELS)
    return path
