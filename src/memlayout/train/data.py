"""Batches for training: an ImageFolder read through memlayout's channels-last pipeline
(``memlayout.data``: one write per image into an NHWC batch, normalized on the device) for the
nhwc / planned layouts, or through the usual torchvision path (``PILToTensor`` per image,
``default_collate``, ``Normalize``) for the nchw baseline.

The order of samples is a ``DistributedSampler``'s (also with one process), so a run is the
same on one process with batch ``B * N`` as on N processes with batch ``B``, and a resumed run
skips exactly the samples it had already seen in the epoch.

An image that cannot be read (not an image, truncated, corrupt) stops the run with a
``TrainError`` naming the file, in worker processes too: training on fewer images than the
folder holds would change the run without saying so. Each image is decoded in full where it
is read, so a truncated file is found there, not half-way into a batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate
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


@dataclass(frozen=True)
class Unreadable:
    """An image file that could not be read, in a sample's place (workers hand it on)."""

    path: str
    reason: str


@dataclass(frozen=True)
class UnreadableBatch:
    """A batch that held unreadable images, in the batch's place."""

    images: tuple[Unreadable, ...]

    def error(self) -> TrainError:
        first = self.images[0]
        more = f" (and {len(self.images) - 1} more in its batch)" if len(self.images) > 1 else ""
        return TrainError(f"--data: {first.path!r} cannot be read as an image ({first.reason})"
                          f"{more}; remove or replace it: the run stops at an unreadable image "
                          "rather than train on fewer images than the folder holds")


def read_image(path: str) -> Image.Image | Unreadable:
    """The RGB image at ``path``, decoded in full, or :class:`Unreadable` saying why not.
    A library that wraps ``PIL.Image.open`` (ultralytics retries a file PIL does not identify
    after installing a HEIF plugin) may raise its own error from PIL's: the file is as
    unreadable."""
    try:
        with open(path, "rb") as f:
            img = Image.open(f)
            return img.convert("RGB")
    except Exception as exc:
        if _raised_from(exc, UnidentifiedImageError):
            return Unreadable(path, "PIL recognizes no image format in it")
        if isinstance(exc, (OSError, ValueError, SyntaxError, Image.DecompressionBombError)):
            return Unreadable(path, f"{type(exc).__name__}: {exc}")
        raise


def _raised_from(exc: BaseException | None, kind: type[BaseException]) -> bool:
    """Whether ``exc`` is a ``kind``, or was raised while one was handled."""
    while exc is not None:
        if isinstance(exc, kind):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class _StopAtUnreadable:
    """A collate function that hands on an :class:`UnreadableBatch` in place of a batch
    holding unreadable images (the main process raises its error: a worker's exception
    would come back with its traceback in its message)."""

    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, samples: list[Any]) -> Any:
        bad = tuple(s[0] for s in samples if isinstance(s[0], Unreadable))
        return UnreadableBatch(bad) if bad else self.collate(samples)


class _ToCHW:
    """PIL image -> uint8 (C, H, W) tensor of ``size``: the usual NCHW per-sample path."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, img):
        if isinstance(img, Unreadable):
            return img
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
        return ImageFolder(str(root), transform=transform, loader=read_image)
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
        data = channels_last_loader(dataset, fit="resize", size=(image_size, image_size),
                                    pin_memory=pin_memory, **kwargs)
        data.collate_fn = _StopAtUnreadable(data.collate_fn)
        return data
    return DataLoader(dataset, pin_memory=pin_memory,
                      collate_fn=_StopAtUnreadable(default_collate), **kwargs)


def model_input(images: torch.Tensor, layout: str, device: torch.device) -> torch.Tensor:
    """uint8 batch -> float32 normalized (ImageNet mean/std) input on ``device``: channels-last
    in one device pass (``memlayout.data.to_model_input``), or NCHW as torchvision's
    ``Normalize`` computes it."""
    if uses_channels_last(layout):
        return to_model_input(images, IMAGENET_MEAN, IMAGENET_STD, torch.float32, device)
    x = images.to(device, non_blocking=True).to(torch.float32).div_(255.0)
    return F.normalize(x, list(IMAGENET_MEAN), list(IMAGENET_STD))
