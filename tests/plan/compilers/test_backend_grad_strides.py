"""The backend hands a parameter's gradient back in the parameter's exact strides
(``grad_in_strides``), checked against torch: the gradient's values are autograd's own, and
its strides are the parameter's, a size-1 dim's included."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from memlayout.plan.compilers.backend_graphs import grad_in_strides, grads_in_parameter_strides

CL = torch.channels_last
# (weight shape, groups, weight stored in, input in): convolutions whose weight gradient
# autograd leaves in other strides than the weight's, or not
CASES = [
    ((8, 4, 1, 1), 1, torch.contiguous_format, CL),  # oneDNN: (4, 1, 4, 4) for (4, 1, 1, 1)
    ((8, 4, 1, 1), 1, CL, torch.contiguous_format),
    ((8, 4, 3, 3), 1, torch.contiguous_format, CL),  # autograd copies it into the weight's
    ((8, 1, 3, 3), 8, torch.contiguous_format, CL),  # depthwise: a size-1 dim, others differ
    ((8, 4, 3, 3), 1, CL, CL),
]


@pytest.mark.parametrize(("shape", "groups", "stored", "fed"), CASES)
@pytest.mark.parametrize("threads", [1, 2])  # torch's CPU convolution differs by threads
def test_the_gradient_comes_back_in_the_parameters_strides(shape, groups, stored, fed, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        w = torch.randn(shape).contiguous(memory_format=stored).requires_grad_()
        x = torch.randn(2, shape[1] * groups, 6, 6).contiguous(memory_format=fed)
        (want,) = torch.autograd.grad(
            nn.functional.conv2d(x, w, groups=groups).square().sum(), w)
        nn.functional.conv2d(x, grad_in_strides(w), groups=groups).square().sum().backward()
    finally:
        torch.set_num_threads(before)
    assert w.grad.stride() == w.stride()
    torch.testing.assert_close(w.grad, want, rtol=0, atol=0)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Conv2d(3, 8, 3)
        self.point = nn.Conv2d(8, 16, 1)
        self.fixed = nn.Conv2d(16, 4, 1)
        self.fixed.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fixed(self.point(self.wide(x)))


def test_only_trainable_parameters_with_a_size_1_dim_are_routed():
    net = _Net()
    gm = fx.symbolic_trace(lambda x, a, b, c, d, e, f: nn.functional.conv2d(
        nn.functional.conv2d(nn.functional.conv2d(x, a, b), c, d), e, f))
    inputs = [torch.randn(1, 3, 8, 8), *(nn.Parameter(p.detach(), p.requires_grad)
                                         for p in net.parameters())]
    assert grads_in_parameter_strides(gm, inputs) == 1
    routed = [n for n in gm.graph.nodes if n.target is grad_in_strides]
    assert [n.args[0].name for n in routed] == ["c"]  # point.weight: not wide's, bias, fixed
    out = gm(*inputs)
    torch.testing.assert_close(out, net(inputs[0]))


def test_the_control_torch_leaves_a_1x1_weights_gradient_in_other_strides():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        w = torch.randn(8, 4, 1, 1, requires_grad=True)
        x = torch.randn(2, 4, 6, 6).contiguous(memory_format=CL)
        nn.functional.conv2d(x, w).sum().backward()
    finally:
        torch.set_num_threads(before)
    assert w.grad.stride() != w.stride()  # what grad_in_strides is there for
