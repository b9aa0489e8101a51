"""A small ImageFolder of JPEGs made here (PIL), for runs and tests without downloads.

Each class has its own colour, drawn with per-image noise and a random bright square, so a
model can learn it (accuracy rises) but not by reading one pixel.

>>> import tempfile, pathlib
>>> root = make_synthetic(pathlib.Path(tempfile.mkdtemp()) / "ds", 6, classes=3, size=8)
>>> sorted(p.name for p in root.iterdir()), len(list(root.rglob("*.jpg")))
(['class0', 'class1', 'class2'], 6)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from memlayout.errors import TrainError


def make_synthetic(root: str | Path, n: int, *, classes: int = 4, size: int = 64,
                   seed: int = 0) -> Path:
    """Write ``n`` ``size`` x ``size`` RGB JPEGs as ``root/class{k}/{i:05d}.jpg`` (ImageFolder
    layout), ``n // classes`` or one more per class. An existing dataset with the same number
    of images and classes is reused as is. Returns ``root``."""
    if n < classes or classes < 1 or size < 4:
        raise TrainError(f"a synthetic dataset needs n >= classes >= 1 and size >= 4; got "
                         f"n={n}, classes={classes}, size={size}")
    root = Path(root)
    existing = list(root.glob("class*/*.jpg"))
    if len(existing) == n and len(list(root.glob("class*"))) == classes:
        return root
    if existing:
        raise TrainError(f"{root} already holds {len(existing)} images in another layout; "
                         f"asked for {n} in {classes} classes: give an empty or new folder")
    rng = np.random.default_rng(seed)
    palette = rng.integers(40, 216, size=(classes, 3))
    for k in range(classes):
        (root / f"class{k}").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        k = i % classes
        pixels = palette[k] + rng.normal(0, 24, size=(size, size, 3))
        side = max(2, size // 4)
        top, left = rng.integers(0, size - side, size=2)
        pixels[top:top + side, left:left + side] += 60
        img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
        img.save(root / f"class{k}" / f"{i:05d}.jpg", quality=90)
    return root
