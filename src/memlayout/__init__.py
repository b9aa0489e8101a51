"""memlayout: tensor memory layout for PyTorch, made a solved problem.

>>> import torch, memlayout
>>> memlayout.format_of(memlayout.to_format(torch.empty(10, 3, 32, 32), memlayout.Format.CHANNELS_LAST))
<Format.CHANNELS_LAST: 'channels_last'>
"""

from memlayout.errors import (
    CaptureError,
    LayoutDropError,
    LayoutError,
    LayoutVerificationError,
    MemlayoutError,
    ModelSpecError,
)
from memlayout.layout import (
    Format,
    dim_order,
    formats_of,
    is_non_overlapping_and_dense,
    strides_for,
)
from memlayout.tensors import convert_batch, convert_module, format_of, to_format

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "Format",
    "LayoutDropError",
    "LayoutError",
    "LayoutVerificationError",
    "MemlayoutError",
    "ModelSpecError",
    "convert_batch",
    "convert_module",
    "dim_order",
    "format_of",
    "formats_of",
    "is_non_overlapping_and_dense",
    "strides_for",
    "to_format",
]
