"""The tiny classifiers and the configuration the training tests share."""

from __future__ import annotations

from pathlib import Path

from memlayout.train import TrainConfig

# Tiny CNNs as a model file (file specs reach subprocesses too).
MODELS = '''
from torch import nn


def plain():
    """No BatchNorm, no dropout: DDP on N ranks equals one process on the global batch."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def bn_dropout():
    """BatchNorm (running statistics to checkpoint) and dropout (RNG to restore)."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Dropout(0.3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def strided_stem():
    """A strided 1x1 stem on three channels: oneDNN's channels-last training fault."""
    return nn.Sequential(nn.Conv2d(3, 8, 1, stride=2), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
'''


IMAGE = 16


def write_models(folder: Path) -> Path:
    path = folder / "tiny_models.py"
    path.write_text(MODELS)
    return path


def config(work: Path, **kw) -> TrainConfig:
    base = dict(model=f"{work / 'tiny_models.py'}:bn_dropout", data=str(work / "data"),
                batch=4, image_size=IMAGE, log_every=3, plan_measure=False, lr=0.05)
    base.update(kw)
    return TrainConfig(**base)
