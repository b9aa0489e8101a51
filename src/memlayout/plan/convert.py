"""Values converted between the two labels (L2 plan): what measuring, the graph rewrite and the
steered model all use to put a value, or a module's weights, in a format."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memlayout.layout import Format, strides_for
from memlayout.plan.graph import CONV1D_RANKS, Label
from memlayout.plan.weights import CONVERTED, PER_CALL
from memlayout.plan.weights import convert_per_call as _convert_per_call
from memlayout.tensors import convert_module, to_format


def convert_value(value: Any, label: Label, ranks: tuple[int, ...]) -> Any:
    """Every tensor inside ``value`` whose rank is in ``ranks`` (the planned model's layout
    ranks) in the format ``label`` means for its rank (canonical strides: ``to_format``);
    other tensors and objects unchanged.

    >>> convert_value((torch.empty(2, 3, 4, 4), 7), 1, (4, 5))[0].stride()
    (48, 1, 12, 3)
    """
    if isinstance(value, torch.Tensor):
        if value.dim() in ranks:
            return to_format(value, Label(label).format(value.dim()))
        return value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(convert_value(v, label, ranks) for v in value)
    if isinstance(value, list):
        return [convert_value(v, label, ranks) for v in value]
    return value


def fresh_value(value: Any, label: Label | None, ranks: tuple[int, ...]) -> Any:
    """A copy of ``value`` (``label``: in that format for the layout ``ranks``; ``None``: same
    strides), so a timed op that works in place never touches the real activations."""
    if isinstance(value, torch.Tensor):
        if label is not None and value.dim() in ranks:
            strides = strides_for(tuple(value.shape), Label(label).format(value.dim()))
        else:
            strides = value.stride()
        return torch.empty_strided(value.shape, strides, dtype=value.dtype,
                                   device=value.device).copy_(value)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(fresh_value(v, label, ranks) for v in value)
    if isinstance(value, list):
        return [fresh_value(v, label, ranks) for v in value]
    return value


def convert_module_to(module: nn.Module, label: Label, ranks: tuple[int, ...], *,
                      weights: str = CONVERTED) -> nn.Module:
    """``module``'s weights of the layout ``ranks`` in label's format, in place (returns
    ``module``). ``weights=CONTIGUOUS``: every weight contiguous whatever the label, and
    ``PER_CALL``: contiguous, converted per call to the input's format
    (``memlayout.plan.weights``)."""
    if weights == PER_CALL:
        _convert_per_call(module)
    if weights != CONVERTED:
        label = Label.CONTIGUOUS
    if label == Label.CHANNELS_LAST:
        if 3 in ranks:  # a 1-d convolution model: Conv1d weights N L C too
            convert_module(module, Format.CHANNELS_LAST_1D)
        convert_module(module, Format.CHANNELS_LAST)
        return convert_module(module, Format.CHANNELS_LAST_3D)
    module._apply(lambda t: t.contiguous() if t.dim() in ranks else t)
    return module


def convert_value_1d(value: Any, label: Label) -> Any:
    """``convert_value`` for a value holding rank-3 tensors of a 1-d convolution model: every
    rank-3/4/5 tensor in ``label``'s format (rank 3: channels_last_1d).

    >>> convert_value_1d(torch.empty(2, 8, 16), 1).stride()
    (128, 1, 8)
    """
    return convert_value(value, label, CONV1D_RANKS)
