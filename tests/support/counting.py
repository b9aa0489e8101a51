"""Convolution calls counted where Python makes them: a second method beside the planner's own count."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

#: the convolutions a forward calls from Python: every convolution module's forward calls
#: one, and a forward may call one itself (diffusers' 1-d resampling kernels)
CONVOLUTIONS = frozenset({
    nn.functional.conv1d, nn.functional.conv2d, nn.functional.conv3d,
    nn.functional.conv_transpose1d, nn.functional.conv_transpose2d,
    nn.functional.conv_transpose3d})


class _ConvCalls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.calls += func in CONVOLUTIONS
        return func(*args, **(kwargs or {}))


def conv_calls(model: nn.Module, *args: object, **kwargs: object) -> int:
    """Convolution calls of one forward, counted where Python makes them (the
    ``torch.nn.functional`` convolutions), not at dispatch as the planner counts them."""
    with torch.no_grad(), _ConvCalls() as count:
        model(*args, **kwargs)
    return count.calls
