"""A small 1-d convolution model (audio/sequence style) for ``memlayout optimize``.

    memlayout optimize benchmarks/conv1d.py:tcn --dtype bf16
"""

import torch
from torch import nn


def tcn() -> tuple[nn.Module, torch.Tensor]:
    """Four Conv1d blocks (BatchNorm, ReLU, one max-pool) over 64 channels x 4096 steps, and a
    classifier; the example input is (8, 64, 4096), NCL."""
    def block(c_in: int, c_out: int, k: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv1d(c_in, c_out, k, padding=k // 2), nn.BatchNorm1d(c_out),
                             nn.ReLU())

    model = nn.Sequential(block(64, 128, 5), block(128, 128, 3), nn.MaxPool1d(2),
                          block(128, 256, 3), block(256, 256, 3), nn.AdaptiveAvgPool1d(1),
                          nn.Flatten(), nn.Linear(256, 10)).eval()
    return model, torch.randn(8, 64, 4096)
