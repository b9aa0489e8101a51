"""Batches for training: an ImageFolder read through memlayout's channels-last pipeline
(``memlayout.data``: one write per image into an NHWC batch, normalized on the device) for the
nhwc / planned layouts, or through the usual torchvision path (``PILToTensor`` per image,
``default_collate``, ``Normalize``) for the nchw baseline.

The order of samples is a ``DistributedSampler``'s (also with one process), so a run is the
same on one process with batch ``B * N`` as on N processes with batch ``B``, and a resumed run
skips exactly the samples it had already seen in the epoch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder
from torchvision.transforms.v2 import functional as F

from memlayout.data import IMAGENET_MEAN, IMAGENET_STD, channels_last_loader, to_model_input
from memlayout.errors import TrainError

LAYOUTS: tuple[str, ...] = ("nchw", "nhwc", "planned")


def uses_channels_last(layout: str) -> bool:
    """Whether a layout is fed by the channels-last pipeline (nhwc, planned) or not (nchw)."""
    if layout not in LAYOUTS:
        raise TrainError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    return layout != "nchw"


class _ToCHW:
    """PIL image -> uint8 (C, H, W) tensor of ``size``: the usual NCHW per-sample path."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, img):
        x = F.pil_to_tensor(img)
        if tuple(x.shape[1:]) != (self.size, self.size):
            x = F.resize(x, [self.size, self.size], antialias=True)
        return x


def image_folder(root: str | Path, layout: str, image_size: int) -> Dataset:
    """The ImageFolder at ``root`` as this layout's pipeline reads it: PIL images (the
    channels-last collate decodes them into the batch) or uint8 CHW tensors (nchw)."""
    root = Path(root)
    if not root.is_dir():
        raise TrainError(f"--data {str(root)!r} is not a folder; give an ImageFolder "
                         "(one sub-folder per class) or use --synthetic N to make one")
    transform = None if uses_channels_last(layout) else _ToCHW(image_size)
    try:
        return ImageFolder(str(root), transform=transform)
    except (FileNotFoundError, RuntimeError) as exc:
        raise TrainError(f"--data {str(root)!r} is not an ImageFolder: {exc}") from exc


class SkipSampler(Sampler[int]):
    """``inner``'s indices without the first ``skip`` (a resumed epoch)."""

    def __init__(self, inner: DistributedSampler, skip: int = 0) -> None:
        self.inner, self.skip = inner, skip

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.inner), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.skip)


def loader(dataset: Dataset, layout: str, *, batch: int, sampler: Sampler[int],
           image_size: int, workers: int = 0, pin_memory: bool = False,
           generator: torch.Generator | None = None) -> DataLoader:
    """A DataLoader of ``(uint8 images, labels)``; full batches only (one shape per run)."""
    kwargs = dict(batch_size=batch, sampler=sampler, num_workers=workers, drop_last=True,
                  persistent_workers=False, generator=generator)
    if uses_channels_last(layout):
        return channels_last_loader(dataset, fit="resize", size=(image_size, image_size),
                                    pin_memory=pin_memory, **kwargs)
    return DataLoader(dataset, pin_memory=pin_memory, **kwargs)


def model_input(images: torch.Tensor, layout: str, device: torch.device) -> torch.Tensor:
    """uint8 batch -> float32 normalized (ImageNet mean/std) input on ``device``: channels-last
    in one device pass (``memlayout.data.to_model_input``), or NCHW as torchvision's
    ``Normalize`` computes it."""
    if uses_channels_last(layout):
        return to_model_input(images, IMAGENET_MEAN, IMAGENET_STD, torch.float32, device)
    x = images.to(device, non_blocking=True).to(torch.float32).div_(255.0)
    return F.normalize(x, list(IMAGENET_MEAN), list(IMAGENET_STD))
