"""``memlayout bench-data``: JPEG files -> normalized channels-last batch, two pipelines.

- ``torchvision``: the standard recipe. Per image ``ToTensor`` (HWC -> CHW permute copy, to
  float, / 255) and ``Normalize``; ``default_collate`` stacks; the batch is then converted with
  ``.to(memory_format=torch.channels_last)``.
- ``memlayout``: per image nothing; :class:`~memlayout.data.ChannelsLastCollate` writes each
  image's HWC pixels into one NHWC uint8 batch; :func:`~memlayout.data.to_model_input`
  normalizes it to float32 in one pass.

Both read the same files through the same PIL loader (``torchvision.datasets.folder.pil_loader``)
and produce the same values. They are timed by :func:`memlayout.timing.interleaved` (one epoch
over the folder per sample, rounds interleaved), and the bytes each writes per batch are
counted with :class:`~memlayout.data.CopyCounter` on one batch with ``num_workers=0``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms as T
from torchvision.datasets.folder import pil_loader

from memlayout.data.collate import channels_last_loader
from memlayout.data.copies import CopyCounter
from memlayout.data.normalize import IMAGENET_MEAN, IMAGENET_STD, to_model_input
from memlayout.devices import seam
from memlayout.files import atomic_file, cache_dir
from memlayout.timing import Comparison, interleaved

PIPELINES: tuple[str, str] = ("torchvision", "memlayout")


@dataclass(frozen=True)
class DataBenchConfig:
    """What ``bench-data`` runs; every field is a CLI flag."""

    images: int = 256
    size: int = 224
    batch: int = 64
    workers: int = 0
    rounds: int = 7
    warmup: int = 1
    quality: int = 90
    cache_dir: Path | None = None
    #: where the normalized batch goes (both pipelines copy it there; timing syncs the device)
    device: str = "cpu"


@dataclass(frozen=True)
class PipelineCopies:
    """Bytes one pipeline writes for one batch (see :mod:`memlayout.data.copies`)."""

    name: str
    images: int
    copy_bytes: int
    layout_copy_bytes: int
    layout_copies: int
    arithmetic_bytes: int
    calls: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class DataBenchResult:
    """Timings (one epoch over the folder per round), copies per batch, and the value check."""

    config: DataBenchConfig
    folder: Path
    comparison: Comparison
    copies: dict[str, PipelineCopies]
    output_shape: tuple[int, ...]
    output_strides: dict[str, tuple[int, ...]]
    max_abs_diff: float

    def images_per_s(self, name: str) -> float | None:
        mode = self.comparison[name]
        return self.config.images / mode.median if mode.ok and mode.median > 0 else None

    @property
    def ratio(self) -> float | None:
        """Median of the per-round ratios torchvision time / memlayout time (> 1: faster)."""
        return self.comparison.speedup("memlayout")

    @property
    def ratio_range(self) -> tuple[float, float] | None:
        return self.comparison.speedup_range("memlayout")


def _synthetic_image(index: int, size: int) -> np.ndarray:
    """A deterministic photo-like RGB image: smooth gradients, a few edges, mild noise (so the
    JPEG decodes at the cost of a real photo, not of flat colour or of pure noise)."""
    rng = np.random.default_rng(index)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    f = rng.uniform(1.0, 6.0, size=(3, 2))
    phase = rng.uniform(0, 2 * np.pi, size=3)
    chans = [127 + 90 * np.sin(2 * np.pi * (f[c, 0] * xx + f[c, 1] * yy) + phase[c]) for c in range(3)]
    img = np.stack(chans, axis=-1)
    cx, cy, r = rng.uniform(0.2, 0.8), rng.uniform(0.2, 0.8), rng.uniform(0.1, 0.3)
    img[(xx - cx) ** 2 + (yy - cy) ** 2 < r * r] *= 0.5
    img += rng.normal(0, 6, size=img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def synthetic_jpeg_folder(n: int, size: int, root: Path | None = None, quality: int = 90) -> list[Path]:
    """Paths of ``n`` synthetic ``size`` x ``size`` RGB JPEGs under ``root`` (default
    ``bench-data/`` in memlayout's cache folder, :func:`memlayout.files.cache_dir`), writing
    only the files that are not there yet.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     paths = synthetic_jpeg_folder(2, 16, Path(d))
    ...     [p.name for p in paths], Image.open(paths[0]).size
    (['img_00000.jpg', 'img_00001.jpg'], (16, 16))
    """
    folder = (root or cache_dir() / "bench-data") / f"{size}px-q{quality}"
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"img_{i:05d}.jpg" for i in range(n)]
    for i, path in enumerate(paths):
        if path.exists():
            continue
        with atomic_file(path) as f:  # a concurrent run never reads half a file
            Image.fromarray(_synthetic_image(i, size)).save(f, "JPEG", quality=quality)
    return paths


class JpegFiles(Dataset):
    """(image, label) from image files through torchvision's PIL loader, then ``transform``."""

    def __init__(self, paths: Sequence[Path], transform: Callable[[Any], Any] | None = None) -> None:
        self.paths = list(paths)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        img = pil_loader(str(self.paths[i]))
        return (self.transform(img) if self.transform is not None else img), i % 10


def standard_pipeline(paths: Sequence[Path], batch: int, workers: int, device: str = "cpu"
                      ) -> tuple[DataLoader, Callable[[torch.Tensor], torch.Tensor]]:
    """The torchvision recipe: (loader, finish) with finish = ``.to(device)`` then
    ``.to(memory_format=channels_last)``."""
    tf = T.Compose([T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    loader = DataLoader(JpegFiles(paths, tf), batch_size=batch, num_workers=workers,
                        persistent_workers=workers > 0)
    return loader, lambda x: x.to(device).to(memory_format=torch.channels_last)


def memlayout_pipeline(paths: Sequence[Path], batch: int, workers: int, device: str = "cpu"
                       ) -> tuple[DataLoader, Callable[[torch.Tensor], torch.Tensor]]:
    """memlayout's: (channels_last_loader, finish) with finish = ``to_model_input`` (float32,
    on ``device``: the uint8 batch crosses, normalization runs there)."""
    loader = channels_last_loader(JpegFiles(paths), batch_size=batch, num_workers=workers,
                                  persistent_workers=workers > 0)
    return loader, lambda x: to_model_input(x, IMAGENET_MEAN, IMAGENET_STD, torch.float32,
                                            device=device)


def _epoch(loader: DataLoader, finish: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        for x, _ in loader:
            finish(x)

    return run


def _count_one_batch(name: str, loader: DataLoader, finish: Callable[[torch.Tensor], torch.Tensor]) -> tuple[PipelineCopies, torch.Tensor]:
    batches = iter(loader)  # outside the count: the iterator draws its seed (8 bytes)
    with CopyCounter() as c:
        x, _ = next(batches)
        out = finish(x)
    return PipelineCopies(name, out.shape[0], c.copy_bytes, c.layout_copy_bytes, c.layout_copies,
                          c.arithmetic_bytes, tuple(sorted(c.calls.items()))), out


def run_data_bench(config: DataBenchConfig, on_step: Callable[[int, str], None] | None = None) -> DataBenchResult:
    """Make (or reuse) the JPEG folder, check both pipelines agree, count their copies on one
    batch, then time one epoch of each per round, interleaved."""
    paths = synthetic_jpeg_folder(config.images, config.size, config.cache_dir, config.quality)
    builders = {"torchvision": standard_pipeline, "memlayout": memlayout_pipeline}
    copies: dict[str, PipelineCopies] = {}
    outs: dict[str, torch.Tensor] = {}
    for name, build in builders.items():
        copies[name], outs[name] = _count_one_batch(name, *build(paths, config.batch, 0,
                                                                 config.device))
    diff = (outs["torchvision"] - outs["memlayout"]).abs().max().item()
    loaders = {name: build(paths, config.batch, config.workers, config.device)
               for name, build in builders.items()}
    comparison = interleaved({name: _epoch(*lf) for name, lf in loaders.items()},
                             rounds=config.rounds, warmup=config.warmup, baseline="torchvision",
                             on_step=on_step, sync=seam(config.device).synchronize)
    return DataBenchResult(
        config=config,
        folder=paths[0].parent,
        comparison=comparison,
        copies=copies,
        output_shape=tuple(outs["memlayout"].shape),
        output_strides={name: tuple(o.stride()) for name, o in outs.items()},
        max_abs_diff=diff,
    )
