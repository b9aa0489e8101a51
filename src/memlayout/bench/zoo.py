"""Model zoos: named lists of model specs (``memlayout.models`` builds them; nothing downloads).

>>> [e.spec for e in zoo("quick")]
['torchvision:resnet18', 'torchvision:mobilenet_v3_small', 'torchvision:squeezenet1_1']
>>> len(zoo("classification"))
17
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from memlayout.bench.config import BenchConfigError


@dataclass(frozen=True)
class ZooEntry:
    """A model spec and the image size it runs at in this zoo (``None``: the model's own)."""

    spec: str
    image_size: int | None = None


_QUICK = (
    ZooEntry("torchvision:resnet18", 64),
    ZooEntry("torchvision:mobilenet_v3_small", 64),
    ZooEntry("torchvision:squeezenet1_1", 64),
)

_CLASSIFICATION_NAMES = (
    "resnet18", "resnet50", "resnext50_32x4d", "wide_resnet50_2", "alexnet", "vgg11_bn",
    "densenet121", "googlenet", "inception_v3", "mobilenet_v2", "mobilenet_v3_large",
    "shufflenet_v2_x1_0", "squeezenet1_0", "efficientnet_b0", "mnasnet1_0", "regnet_y_400mf",
    "convnext_tiny",
)
_CLASSIFICATION = tuple(ZooEntry(f"torchvision:{n}") for n in _CLASSIFICATION_NAMES)

# Segmentation and video (r3d_18 runs NCDHW vs NDHWC: channels_last_3d) from torchvision.
_EXTRA = (
    ZooEntry("torchvision:fcn_resnet50"),
    ZooEntry("torchvision:deeplabv3_resnet50"),
    ZooEntry("torchvision:r3d_18"),
)
_TIMM = (
    ZooEntry("timm:resnet50"),
    ZooEntry("timm:efficientnet_b0"),
    ZooEntry("timm:convnext_tiny"),
    ZooEntry("timm:regnety_016"),
)

ZOO_NAMES: tuple[str, ...] = ("quick", "classification", "all")


def zoo(name: str) -> tuple[ZooEntry, ...]:
    """The entries of zoo ``name``; ``all`` includes timm models only when timm is installed."""
    if name == "quick":
        return _QUICK
    if name == "classification":
        return _CLASSIFICATION
    if name == "all":
        timm = _TIMM if importlib.util.find_spec("timm") is not None else ()
        return _CLASSIFICATION + _EXTRA + timm
    raise BenchConfigError(f"unknown zoo {name!r}; expected one of {', '.join(ZOO_NAMES)}")
