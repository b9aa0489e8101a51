"""The channels-last input pipeline (L2 ``data/``): decode -> channels-last batch -> device
normalize, with no per-image permute copy.

>>> import numpy as np
>>> from memlayout.data import channels_last_loader, to_model_input, IMAGENET_MEAN, IMAGENET_STD
>>> ds = [(np.zeros((8, 8, 3), np.uint8), 0)] * 4
>>> x, y = next(iter(channels_last_loader(ds, batch_size=4)))
>>> x.dtype, x.stride()
(torch.uint8, (192, 1, 24, 3))
>>> to_model_input(x, IMAGENET_MEAN, IMAGENET_STD, torch.bfloat16).stride()
(192, 1, 24, 3)
"""

import torch  # noqa: F401  (doctest namespace)

from memlayout.data.collate import (
    ChannelsLastCollate,
    DataPipelineError,
    MixedImageSizeError,
    channels_last_loader,
    collate_channels_last,
    collate_images,
    empty_channels_last_batch,
    is_image,
)
from memlayout.data.copies import CopyCounter
from memlayout.data.normalize import IMAGENET_MEAN, IMAGENET_STD, to_model_input

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ChannelsLastCollate",
    "CopyCounter",
    "DataPipelineError",
    "MixedImageSizeError",
    "channels_last_loader",
    "collate_channels_last",
    "collate_images",
    "empty_channels_last_batch",
    "is_image",
    "to_model_input",
]
