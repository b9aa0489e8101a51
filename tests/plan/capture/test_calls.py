"""A module call's tensors are told apart by a digest (shape, dtype, two sums): the same
value computed by another kernel, in another memory order, is one value; another activation
of the same shape is another."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memlayout.plan.capture.calls import leaf_of


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_value_computed_in_another_layout_is_the_same_leaf(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(32, 32, 3, padding=1).to(dtype)
    x = torch.randn(2, 32, 64, 64, dtype=dtype)
    with torch.no_grad():
        nchw = conv(x)
        nhwc = conv.to(memory_format=torch.channels_last)(
            x.contiguous(memory_format=torch.channels_last))
    assert nhwc.is_contiguous(memory_format=torch.channels_last)
    assert leaf_of(nchw).matches(leaf_of(nhwc))  # type: ignore[union-attr]
    # other values of the same shape: the input, the output scaled by 1 %, the output's ReLU
    for other in (x, nchw * 1.01, nchw.relu()):
        assert not leaf_of(nchw).matches(leaf_of(other))  # type: ignore[union-attr]


def test_a_leaf_is_another_for_another_shape_or_dtype_and_none_for_what_is_no_dense_tensor(
        ) -> None:
    t = torch.ones(2, 3)
    assert not leaf_of(t).matches(leaf_of(t.reshape(3, 2)))  # type: ignore[union-attr]
    assert not leaf_of(t).matches(leaf_of(t.double()))  # type: ignore[union-attr]
    assert leaf_of(3.0) is None and leaf_of(t.to_sparse()) is None
    assert leaf_of(torch.empty(2, device="meta")) is None
