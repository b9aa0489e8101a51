"""Training plans of forwards that autograd handles specially: each ends in a plan that trains
or a ``MemlayoutError`` naming the construct, never in torch's own error from inside
verification."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import memlayout
from memlayout.errors import MemlayoutError

pytestmark = pytest.mark.faults


class Recomputed(nn.Module):
    """Activation checkpointing, reentrant: torch refuses ``autograd.grad`` through it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.b, torch.relu(self.a(x)), use_reentrant=True)


class ChangesItsInput(nn.Module):
    """An input changed in place after a convolution that saved it for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        x.add_(1)
        return y + x


def test_reentrant_checkpointing_is_planned_or_refused_by_name():
    x = torch.randn(2, 3, 12, 12)
    try:
        opt = memlayout.optimize(Recomputed().train(), x, train=True, measure=False, cache=False)
    except MemlayoutError as exc:
        assert "checkpoint" in str(exc) and "use_reentrant" in str(exc)
    else:
        opt(x).sum().backward()


def test_an_input_changed_in_place_says_the_originals_backward_fails_too():
    x = torch.randn(2, 3, 12, 12, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ChangesItsInput().train()(x.clone()).sum().backward()  # the original itself
    with pytest.raises(MemlayoutError, match="original"):
        memlayout.optimize(ChangesItsInput().train(), x.clone(), train=True, measure=False,
                           cache=False)
