"""Kernels torch runs wrongly channels-last: the rule that knows them from a node's arguments,
in every form a graph spells a convolution, and a training plan that never runs one
channels-last (measuring, guarding, verifying), however its cost reads."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from torch import fx, nn

import memlayout
from memlayout.bench.config import ModeUnavailable
from memlayout.bench.modes import prepare_mode
from memlayout.plan.capture.regions import propagate
from memlayout.plan.capture.trace import is_convolution
from memlayout.plan.compilers.backend_plan import Planned, inductor_runs_a_fault
from memlayout.plan.costs import measure
from memlayout.plan.costs.faults import ONEDNN_STRIDED_1X1, channels_last_fault
from memlayout.plan.costs.table import CostTable, NodeCost
from memlayout.plan.graph import Label

CPU = torch.device("cpu")

#: (in channels, kernel, stride, groups, whether the fault applies): the bug's conditions
#: (oneDNN's channels-last weight gradient): a weight gradient, nhwc, 1x1, a stride above 1, fewer input channels
#: than the channel block (16 covers every x86 ISA)
CASES = [
    (3, 1, 2, 1, True),
    (15, 1, 2, 1, True),
    (3, 1, (2, 1), 1, True),
    (16, 1, 2, 1, False),
    (3, 1, 1, 1, False),
    (3, 3, 2, 1, False),
    (4, 1, 2, 2, False),
]


def _conv(channels: int, kernel: int, stride: Any, groups: int) -> nn.Conv2d:
    return nn.Conv2d(channels, 16, kernel, stride=stride, groups=groups)


def _conv_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if is_convolution(gm, n)]


def _graphs(conv: nn.Conv2d, x: torch.Tensor) -> list[fx.GraphModule]:
    """The forms a captured graph spells ``conv`` in: a module call (torch.fx), ``conv2d``
    with positional and keyword arguments, aten's ``convolution`` (as AOT graphs do), and
    torch.export's ``aten.conv2d``; each run once so its weight's shape is known."""
    s, g = conv.stride, conv.groups

    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = conv.weight

        def forward(self, x: torch.Tensor) -> Any:
            return (torch.conv2d(x, self.weight, None, s, 0, 1, g),
                    nn.functional.conv2d(x, self.weight, stride=s, groups=g),
                    torch.ops.aten.convolution.default(x, self.weight, None, list(s), [0, 0],
                                                       [1, 1], False, [0, 0], g))

    graphs = [fx.symbolic_trace(nn.Sequential(conv)), fx.symbolic_trace(Functional()),
              torch.export.export(nn.Sequential(conv), (x,)).module()]
    for gm in graphs:
        propagate(gm, (x,))
    return graphs


@pytest.mark.parametrize("channels, kernel, stride, groups, faulty", CASES)
def test_the_rule_names_the_fault_in_every_form_of_a_convolution_and_only_in_training(
        channels, kernel, stride, groups, faulty) -> None:
    conv = _conv(channels, kernel, stride, groups)
    graphs = _graphs(conv, torch.randn(2, channels, 8, 8))
    nodes = [(gm, n) for gm in graphs for n in _conv_nodes(gm)]
    assert len(nodes) == 5
    want = ONEDNN_STRIDED_1X1 if faulty else None
    assert [channels_last_fault(gm, n, train=True, device=CPU) for gm, n in nodes] == [want] * 5
    assert all(channels_last_fault(gm, n, train=False, device=CPU) is None for gm, n in nodes)
    assert all(channels_last_fault(gm, n, train=True, device=torch.device("cuda")) is None
               for gm, n in nodes)


def test_a_cost_from_an_earlier_pass_does_not_make_the_fault_a_way_to_run() -> None:
    gm = fx.symbolic_trace(nn.Sequential(_conv(3, 1, 2, 1)))
    x = torch.randn(2, 3, 8, 8)
    propagate(gm, (x,))
    [node] = _conv_nodes(gm)
    earlier = CostTable(nodes={node.name: NodeCost(node.name, "Conv2d", (2e-3, 1e-3),
                                                   (Label.CONTIGUOUS, Label.CHANNELS_LAST),
                                                   True)})
    table = measure.measure_costs(gm, (x,), train=True, previous=earlier, measure=False)
    assert table.faults == {node.name: ONEDNN_STRIDED_1X1}
    assert table.nodes[node.name].seconds == (2e-3, None)
    analytic = measure.measure_costs(gm, (x,), train=True, measure=False)
    assert analytic.nodes[node.name].seconds[1] is None
    assert analytic.nodes[node.name].seconds[0] is not None


class Stem(nn.Module):
    """A strided 1x1 stem on three channels (the fault), next to a 3x3 one and a 1x1 of
    stride 1 on the same input (no fault: measured in both formats)."""

    def __init__(self) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(3, 16, 1, stride=2)
        self.wide = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.point = nn.Conv2d(3, 16, 1)
        self.body = nn.Sequential(nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(self.reduce(x) + self.wide(x))
        return y + nn.functional.avg_pool2d(self.point(x), 2)


def test_a_training_plan_never_runs_the_fault_channels_last(tmp_path, monkeypatch) -> None:
    ran: list[tuple[str, ...]] = []
    real = nn.Conv2d._conv_forward

    def watched(self: nn.Conv2d, x: torch.Tensor, weight: torch.Tensor, bias: Any) -> Any:
        strided = self.kernel_size == (1, 1) and max(self.stride) > 1 and self.in_channels < 16
        laid_out = any(not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)
                       for t in (x, weight))
        if strided and laid_out and torch.is_grad_enabled() and weight.requires_grad:
            ran.append((tuple(x.shape), tuple(x.stride())))
            # what the planner must never do, run here in a way that cannot fault
            return real(self, x.contiguous(), weight.contiguous(), bias)
        return real(self, x, weight, bias)

    monkeypatch.setattr(nn.Conv2d, "_conv_forward", watched)
    torch.manual_seed(0)
    model = Stem().train()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 16, 16)
    planned = memlayout.optimize(model, x, train=True, cache=tmp_path / "c.sqlite", rounds=1,
                                 guard_rounds=2, padding=False)
    assert ran == []
    by_name = {n.name: n for n in planned.plan.nodes}
    reduce = next(n for n in by_name.values() if n.name.startswith("reduce"))
    assert reduce.format == "contiguous" and reduce.seconds["channels_last"] is None
    point = next(n for n in by_name.values() if n.name.startswith("point"))
    assert all(s is not None for s in point.seconds.values())  # the rule is that narrow
    assert any(ONEDNN_STRIDED_1X1 in note and "reduce" in note for note in planned.plan.notes)
    assert planned.plan.guard is not None
    assert "all_channels_last" not in planned.plan.guard.candidates
    torch.testing.assert_close(planned(x), reference(x), rtol=1e-4, atol=1e-5)


@pytest.mark.usefixtures("fresh_dynamo")
def test_the_backend_keeps_the_fault_contiguous_and_races_no_inductor_that_runs_it(
        tmp_path) -> None:
    torch.manual_seed(0)
    model = Stem().train()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 16, 16)
    compiled = torch.compile(model, backend=memlayout.backend(
        cache=str(tmp_path / "c.sqlite"), inner="eager", rounds=1))
    out = compiled(x)
    want = reference(x)
    out.square().mean().backward()
    want.square().mean().backward()
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-3, atol=1e-5)
    (graph,) = [g for g in memlayout.backend_report().graphs if g.convolutions]
    by_where = {c.where: c for c in graph.convolutions}
    assert by_where["reduce"].fault == ONEDNN_STRIDED_1X1
    assert by_where["reduce"].planned == "contiguous"
    assert "never channels-last" in by_where["reduce"].describe()
    assert not by_where["point"].fault and not by_where["wide"].fault
    # where Inductor's rule puts it channels-last, Inductor's own is no way to race
    ruled = [dataclasses.replace(c, inductor="channels_last") for c in graph.convolutions]
    assert inductor_runs_a_fault(Planned(None, None, 0, tuple(ruled)))  # type: ignore[arg-type]


def test_the_benchmark_does_not_train_such_a_model_channels_last_and_says_why() -> None:
    x = torch.randn(2, 3, 16, 16)
    with pytest.raises(ModeUnavailable, match=r"nhwc is not run in training: it would run "
                                              r"reduce channels-last, and oneDNN's"):
        prepare_mode("nhwc", Stem(), x, dtype="fp32", task="train")
    inference = prepare_mode("nhwc", Stem(), x, dtype="fp32", task="infer")  # forward: no fault
    assert inference is not None
