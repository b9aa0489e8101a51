"""Random masks drawn as the original draws them (``same_draws``): PyTorch's dropout kernels
fill their mask in memory order, so where a plan lays a dropout's activation out otherwise
than the original, the same seed drops other (equally random) elements. :class:`OriginalDraws`
runs each such element-wise dropout on a copy of its activation in the format the original
drew in, by PyTorch's own kernel, and hands the result back in the activation's format.

>>> x = torch.randn(2, 4, 3, 3)
>>> torch.manual_seed(0); want = F.dropout(x, 0.5)  # doctest: +ELLIPSIS
<...>
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<...>
>>> with OriginalDraws(("contiguous",)):
...     got = F.dropout(x.contiguous(memory_format=torch.channels_last), 0.5)
>>> torch.equal(got, want), got.is_contiguous(memory_format=torch.channels_last)
(True, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.nn import functional as F

from memlayout.layout import Format
from memlayout.tensors import torch_memory_format

#: element-wise dropouts: (argument names, alpha dropout, in place, training by default)
DROPOUTS: dict[Any, tuple[tuple[str, ...], bool, bool, bool]] = {
    F.dropout: (("input", "p", "training", "inplace"), False, False, True),
    F.alpha_dropout: (("input", "p", "training", "inplace"), True, False, False),
    torch.dropout: (("input", "p", "train"), False, False, True),
    torch.dropout_: (("input", "p", "train"), False, True, True),
    torch.alpha_dropout: (("input", "p", "train"), True, False, True),
    torch.alpha_dropout_: (("input", "p", "train"), True, True, True),
}


def drawing(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> tuple[torch.Tensor, float, bool, bool] | None:
    """What a call of ``func`` draws: its activation, ``p``, whether it is an alpha dropout
    and whether it is in place; ``None`` when it is no element-wise dropout that draws (not
    training, or ``p`` 0 or 1)."""
    spec = DROPOUTS.get(func)
    if spec is None:
        return None
    names, alpha, inplace, training = spec
    bound = dict(zip(names, args, strict=False)) | kwargs
    p = float(bound.get("p", 0.5))
    if not bound.get("training", bound.get("train", training)) or not 0 < p < 1:
        return None
    return bound["input"], p, alpha, bool(bound.get("inplace", inplace))


class OriginalDraws(torch.overrides.TorchFunctionMode):
    """While active, the ``k``-th element-wise dropout that draws runs on its activation in
    ``formats[k]`` (a :class:`~memlayout.Format` value: where the original drew it), by
    PyTorch's own kernel, its result back in the activation's format (in place: copied back
    into it)."""

    def __init__(self, formats: Sequence[str]) -> None:
        super().__init__()
        self.formats = tuple(formats)
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        drawn = drawing(func, args, kwargs)
        if drawn is None:
            return func(*args, **kwargs)
        x, _, _, inplace = drawn
        k, self.calls = self.calls, self.calls + 1
        if k >= len(self.formats) or x.dim() not in (4, 5):
            return func(*args, **kwargs)
        want, have = torch_memory_format(Format(self.formats[k])), _memory_format(x)
        if want == have:
            return func(*args, **kwargs)
        moved = x.contiguous(memory_format=want)
        if "input" in kwargs:
            kwargs["input"] = moved
        else:
            args = (moved, *args[1:])
        out = func(*args, **kwargs)
        return x.copy_(moved) if inplace else out.contiguous(memory_format=have)


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    """The memory format torch's kernels read from ``x``'s strides (rank 4 or 5)."""
    other = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    if x.is_contiguous(memory_format=other) and not x.is_contiguous():
        return other
    return torch.contiguous_format


__all__ = ["DROPOUTS", "OriginalDraws", "drawing"]
