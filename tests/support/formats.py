"""The formats torch itself says a tensor is in: the reference the layout algebra is checked against."""

from __future__ import annotations

import torch

from memlayout import Format

TORCH_FORMATS = {
    Format.CONTIGUOUS: torch.contiguous_format,
    Format.CHANNELS_LAST: torch.channels_last,
    Format.CHANNELS_LAST_3D: torch.channels_last_3d,
}


def torch_formats(t: torch.Tensor) -> frozenset[Format]:
    """The reference: the formats torch says the tensor is contiguous in. Channels-last-1d has
    no torch format; (N, C, L) is channels-last-1d exactly when (N, C, 1, L) is channels-last."""
    found = {f for f, mf in TORCH_FORMATS.items()
             if (f.rank is None or f.rank == t.dim()) and t.is_contiguous(memory_format=mf)}
    if t.dim() == 3 and t.unsqueeze(2).is_contiguous(memory_format=torch.channels_last):
        found.add(Format.CHANNELS_LAST_1D)
    return frozenset(found)
