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


class _ConvInputs(TorchFunctionMode):
    """The format of the input of each convolution call, with the convolution module it ran
    in (the innermost one being called)."""

    def __init__(self) -> None:
        super().__init__()
        self.calling: list[str] = []
        self.seen: list[tuple[str, Any]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func in CONVOLUTIONS:
            from memlayout import format_of

            self.seen.append((self.calling[-1] if self.calling else "?", format_of(args[0])))
        return func(*args, **(kwargs or {}))


def conv_inputs(model: nn.Module, *args: object) -> list[tuple[str, Any]]:
    """``(module path, format of its input)`` of every convolution call of one forward, seen
    where the convolution runs (inside the module's own forward, after any conversion at its
    boundary)."""
    mode = _ConvInputs()
    handles = []
    for path, m in model.named_modules():
        if isinstance(m, nn.modules.conv._ConvNd):
            handles.append(m.register_forward_pre_hook(
                lambda _m, _a, path=path: mode.calling.append(path)))
            handles.append(m.register_forward_hook(lambda *_: mode.calling.pop() and None))
    try:
        with torch.no_grad(), mode:
            model(*args)
    finally:
        for h in handles:
            h.remove()
    return mode.seen
