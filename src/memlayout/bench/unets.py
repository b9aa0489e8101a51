"""Small model factories for the planner's memory and padded-channel work (usable as model
specs, ``src/memlayout/bench/unets.py:unet``).

- ``unet``: an encoder-decoder with skip connections (concatenations), as segmentation models
  are built: the skips keep early, large activations alive across the whole network, which is
  what makes peak memory (and the cost of converting those activations) matter.
- ``odd_channels``: a mobilenet/efficientnet-style network with a 3-channel stem and blocks of
  24, 40, 72 and 112 channels (none a multiple of 16; only 24, 40, 72 and 112 of 8): the case
  for padding channels to the hardware's vector width.

>>> net, x = unet_small()
>>> tuple(net(x).shape)
(1, 2, 32, 32)
>>> net, x = odd_channels_small()
>>> tuple(net(x).shape)
(1, 10)
"""

from __future__ import annotations

import torch
from torch import nn


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    """A UNet: ``depth`` down steps (conv block, max-pool), a bottleneck, and ``depth`` up steps
    (transposed convolution, concatenation with the skip, conv block), then a 1x1 head."""

    def __init__(self, in_channels: int = 3, classes: int = 2, width: int = 16,
                 depth: int = 3) -> None:
        super().__init__()
        widths = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList()
        cin = in_channels
        for w in widths[:-1]:
            self.down.append(_block(cin, w))
            cin = w
        self.pool = nn.MaxPool2d(2)
        self.bottom = _block(widths[-2], widths[-1])
        self.up = nn.ModuleList()
        self.merge = nn.ModuleList()
        for w_low, w in zip(widths[:0:-1], widths[-2::-1], strict=True):
            self.up.append(nn.ConvTranspose2d(w_low, w, 2, stride=2))
            self.merge.append(_block(2 * w, w))
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottom(x)
        for up, merge, skip in zip(self.up, self.merge, reversed(skips), strict=True):
            x = merge(torch.cat([up(x), skip], dim=1))
        return self.head(x)


def unet() -> tuple[nn.Module, torch.Tensor]:
    """UNet, width 16, depth 4, on a (1, 3, 192, 192) image."""
    return UNet(width=16, depth=4).eval(), torch.randn(1, 3, 192, 192)


def unet_small() -> tuple[nn.Module, torch.Tensor]:
    """UNet, width 8, depth 2, on a (1, 3, 32, 32) image (tests)."""
    return UNet(width=8, depth=2).eval(), torch.randn(1, 3, 32, 32)


class _InvertedResidual(nn.Module):
    """mobilenet-v2 block: 1x1 expand, 3x3 depthwise, 1x1 project; residual when shapes match."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        mid = cin * expand
        self.residual = stride == 1 and cin == cout
        self.body = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU6(inplace=True),
            nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), nn.BatchNorm2d(mid),
            nn.ReLU6(inplace=True),
            nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return x + y if self.residual else y


class OddChannels(nn.Module):
    """A 3-channel stem (3x3, stride 2) to ``channels[0]``, then one inverted-residual stage
    per channel count (the first block of a stage strides by 2), pooled linear head."""

    def __init__(self, channels: tuple[int, ...] = (24, 40, 72, 112), classes: int = 10,
                 expand: int = 3, blocks: int = 2) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels[0], 3, 2, 1, bias=False),
                                  nn.BatchNorm2d(channels[0]), nn.ReLU6(inplace=True))
        layers: list[nn.Module] = []
        cin = channels[0]
        for i, c in enumerate(channels):
            for b in range(blocks):
                layers.append(_InvertedResidual(cin, c, 2 if b == 0 and i > 0 else 1, expand))
                cin = c
        self.stages = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def odd_channels() -> tuple[nn.Module, torch.Tensor]:
    """OddChannels (24, 40, 72, 112) on a (1, 3, 128, 128) image."""
    return OddChannels().eval(), torch.randn(1, 3, 128, 128)


def odd_channels_small() -> tuple[nn.Module, torch.Tensor]:
    """OddChannels (24, 40, 72, 112), one block per stage, on a (1, 3, 32, 32) image (tests)."""
    return OddChannels(blocks=1, expand=2).eval(), torch.randn(1, 3, 32, 32)
