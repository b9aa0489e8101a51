"""Only image-like values are layout values, in the planner and in the audit: attention scores
and position biases of rank 4 are not; a 3-d network's first convolution, fed a 1-channel
input (in both formats), is where the format is lost when torch returns NCDHW."""

from __future__ import annotations

import torch
from torch import nn

import memlayout
from memlayout.audit.recorder import audit
from memlayout.layout import Format
from memlayout.tensors import format_of, to_format


class BiasedAttention(nn.Module):
    """A convolution, then attention over its pixels with a relative position bias made as
    timm's CoAtNet makes it (index, view, permute, unsqueeze, contiguous): the bias is rank 4
    and its strides look channels-last, yet it is no image."""

    def __init__(self, c: int = 8, heads: int = 2, size: int = 4) -> None:
        super().__init__()
        self.heads, self.tokens = heads, size * size
        self.conv = nn.Conv2d(3, c, 3, padding=1)
        self.qkv = nn.Conv2d(c, 3 * c, 1)
        self.table = nn.Parameter(torch.randn(self.tokens * self.tokens, heads))
        self.register_buffer("index", torch.arange(self.tokens * self.tokens))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        b, c, h, w = x.shape
        q, k, v = self.qkv(x).reshape(b, 3, self.heads, c // self.heads, h * w).unbind(1)
        bias = self.table[self.index].view(self.tokens, self.tokens, self.heads) \
            .permute(2, 0, 1).unsqueeze(0).contiguous()
        scores = (q.transpose(-2, -1) @ k + bias).softmax(dim=-1)
        y = (v @ scores.transpose(-2, -1)).reshape(b, c, h, w)
        return y + x  # a contiguous y added to a channels-last x: a real drop, on an image


def test_the_audit_flags_no_drop_on_attention_tensors_and_keeps_real_ones() -> None:
    model, x = BiasedAttention().eval(), torch.randn(1, 3, 4, 4)
    # reality first: the bias's permuted view is channels-last by its strides
    view = model.table[model.index].view(16, 16, 2).permute(2, 0, 1).unsqueeze(0)
    assert format_of(view) is Format.CHANNELS_LAST
    report = audit(model, x)
    assert [d.op for d in report.drops] == ["aten.add.Tensor"], \
        [(d.op, d.where()) for d in report.drops]


def test_the_planner_makes_no_layout_node_of_attention_values() -> None:
    model, x = BiasedAttention().eval(), torch.randn(1, 3, 4, 4)
    opt = memlayout.optimize(model, x, measure=False, cache=False)
    ops = {n.op for n in opt.plan.nodes}
    assert not any(w in op for op in ops for w in ("softmax", "matmul", "contiguous", "permute"))
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_3d_networks_first_convolution_is_where_the_format_is_lost() -> None:
    net = nn.Sequential(nn.Conv3d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv3d(8, 8, 3, padding=1))
    x = torch.randn(1, 1, 6, 6, 6)
    fmt = Format.CHANNELS_LAST_3D
    # what this build really does with the first convolution fed NDHWC (x and its weight are
    # both formats: C == 1)
    first = net[0].to(memory_format=torch.channels_last_3d)
    with torch.no_grad():
        kept = fmt in {format_of(first(to_format(x, fmt)))}
    report = audit(net.eval(), x, fmt=fmt)
    dropped_at = {d.module for d in report.drops}
    assert ("0" in dropped_at) == (not kept)
    if not kept:
        assert "NCDHW" in report.meta["coverage"]["aten.convolution.default"]
