"""The ``memlayout`` backend on graphs with symbolic integers: blocks of one class with
different strides share one ``forward``, and Dynamo's recompile for the second stride passes
it as a symbolic integer (under FSDP2, automatic dynamic shapes); a second input size makes
the sizes symbolic too. Each such graph is planned and compiled by Inductor with the plan
standing, with no warning, and computes what eager computes.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import fx, nn

import memlayout
from memlayout.plan.compilers import backend as b
from memlayout.plan.compilers.backend_graphs import fix_convolution_arguments, is_dynamic
from memlayout.plan.runners import Runner
from memlayout.train.fsdp import fsdp_available

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Down(nn.Module):
    """A ResNet-like block: convolution (``stride``), training batch norm, ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)).relu()


def _step(x: torch.Tensor, weight: torch.Tensor, stride: int) -> torch.Tensor:
    return nn.functional.conv2d(x, weight, None, (stride, stride), (1, 1)).relu()


def test_a_symbolic_stride_is_guarded_to_its_example_value():
    """The stride Dynamo passes symbolic (an int argument seen with two values) is made a
    constant, guarded in Dynamo's shape env: a third value recompiles, a value seen before
    does not, and the graph is no longer dynamic."""
    fixed: list[tuple[int, bool]] = []

    def spy(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        fixed.append((fix_convolution_arguments(gm), is_dynamic(gm)))
        return gm.forward

    step = torch.compile(_step, backend=spy)
    x, weight = torch.randn(1, 2, 8, 8), torch.randn(3, 2, 3, 3)
    for stride in (1, 2, 3, 2, 3):
        torch.testing.assert_close(step(x, weight, stride), _step(x, weight, stride))
    # stride 1: a constant from the start; 2: symbolic, fixed; 3: recompiled and fixed
    assert fixed == [(0, False), (1, False), (1, False)]


@pytest.mark.skipif(fsdp_available() is not None, reason=str(fsdp_available()))
def test_fsdp_blocks_of_one_class_with_two_strides_and_two_sizes_are_planned(
        one_member_group):
    """Each block compiled and sharded by FSDP2 (as ``memlayout train --strategy fsdp
    --compile backend`` does), trained on two input sizes: every graph, the stride-2
    block's with its symbolic stride and the recompiles with symbolic sizes, is planned and
    compiled with the plan standing, with no warning; outputs and input gradients equal
    eager's."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", b.BackendWarning)
        _train_sharded_blocks(memlayout.backend(measure=False, guard=False, cache=False))
    graphs = memlayout.backend_report().graphs
    assert len(graphs) >= 3 and any(g.dynamic for g in graphs)
    for g in graphs:
        assert g.planned and not g.fallback and g.ran == Runner.PLAN_COMPILED, g



def _train_sharded_blocks(backend: Any) -> None:
    """Two blocks of one class (stride 1, then 2), each compiled with ``backend`` and
    sharded by FSDP2, trained on two input sizes: outputs and input gradients equal eager's."""
    from torch.distributed.fsdp import fully_shard

    net = nn.Sequential(Down(4, 8, 1), Down(8, 8, 2)).train()
    eager = copy.deepcopy(net)
    for block in net:
        block.compile(backend=backend)
        fully_shard(block)
    for shape in ((2, 4, 12, 12), (3, 4, 10, 14)):
        x = torch.randn(shape)
        mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = net(mine)
        out.square().mean().backward()
        expected = eager(theirs)
        expected.square().mean().backward()
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(fsdp_available() is not None, reason=str(fsdp_available()))
def test_memlayout_trains_inductor_baseline_through_the_same_fsdp_blocks(one_member_group):
    """``memlayout train --strategy fsdp --compile inductor``'s backend (Inductor, the
    symbolic stride fixed first) on the same blocks: where plain ``backend="inductor"`` fails
    inside Inductor on the stride-2 block's training batch norm, it compiles and trains."""
    from memlayout.train.compiling import inductor

    _train_sharded_blocks(inductor)
