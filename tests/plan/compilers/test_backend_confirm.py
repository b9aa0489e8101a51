"""Before a graph's plan is taken to differ from Inductor's rule (and so is compiled and
raced against Inductor's own, a second compile), the convolutions that make it differ are
measured again: they were picked by costs that may have read faster by chance. Timings come
from a clock that moves only when an op runs, by what each measuring pass says of each
format, so the expected plan follows from what goes in."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

from memlayout.plan.capture.trace import is_convolution
from memlayout.plan.compilers import backend_plan
from memlayout.plan.compilers.backend import Backend
from memlayout.plan.costs import measure
from memlayout.plan.costs.cache import CostCache

CPU = torch.device("cpu")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(8, 8, 3, 3) / 8)
        self.b = nn.Parameter(torch.randn(8, 8, 3, 3) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(F.relu(F.conv2d(x, self.a, padding=1)), self.b, padding=1)


class Excited(Net):
    """``Net`` with a squeeze-and-excitation gate: a convolution of one pixel per channel,
    an input in both formats."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.randn(8, 8, 1, 1) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y * torch.sigmoid(F.conv2d(F.adaptive_avg_pool2d(y, 1), self.gate))


def _dynamo_graph(net: nn.Module) -> tuple[torch.fx.GraphModule, list[Any]]:
    """The graph and example inputs Dynamo hands a backend for ``net``."""
    seen: list = []

    def grab(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    net, x = net.eval(), torch.randn(2, 8, 12, 12)
    with torch.no_grad():
        torch.compile(net, backend=grab)(x)
    torch._dynamo.reset()
    return seen[0]


def _plan(monkeypatch, passes: list[dict[str, float]], store=None, net: nn.Module | None = None):
    """``plan_graph`` of ``net``'s graph (default: ``Net``) with Inductor's rule channels-last, where the ``i``-th
    pass that measures convolutions times one at ``passes[i][label]`` seconds; per measuring
    pass, the names it was asked to measure again (``None``: the convolutions, all it found
    uncached; ``"rest"``: the graph's other nodes and conversions, after the convolutions)."""
    now = [0.0]
    asked: list[Any] = []
    real_measure, real_call = measure.measure_costs, measure._Measurer._call

    def call(self, n, how, *, grad=False):
        fn = real_call(self, n, how, grad=grad)
        label = (how if isinstance(how, str) else str(int(how)))[0]
        if not is_convolution(self.module, n):
            return fn
        seconds = passes[min(len([a for a in asked if a != "rest"]), len(passes)) - 1][label]

        def timed():
            now[0] += seconds
            return fn()
        return timed

    def measuring(*args, **kwargs):
        asked.append(kwargs.get("timed") or ("rest" if "previous" in kwargs else None))
        return real_measure(*args, clock=lambda: now[0], **kwargs)

    monkeypatch.setattr(measure._Measurer, "_call", call)
    monkeypatch.setattr(backend_plan, "measure_costs", measuring)
    gm, inputs = _dynamo_graph(net or Net())
    planned = backend_plan.plan_graph(gm, inputs, Backend(cache=False), train=False,
                                      dtype=None, device=CPU, rule=True, store=store)
    return planned, asked


NCHW_FASTER = {"0": 0.001, "1": 0.003}
NHWC_FASTER = {"0": 0.003, "1": 0.001}


def test_a_difference_that_does_not_measure_again_is_no_difference(monkeypatch) -> None:
    planned, asked = _plan(monkeypatch, [NCHW_FASTER, NHWC_FASTER])
    assert asked[:2] == [None, "rest"] and len(asked) == 3
    assert len(set(asked[2])) == 2  # the two convolutions, nothing else, measured again
    assert backend_plan.agrees_with_inductor(planned)
    assert all(c.planned == "channels_last" for c in planned.convolutions)


def test_a_difference_that_measures_again_stands(monkeypatch) -> None:
    planned, asked = _plan(monkeypatch, [NCHW_FASTER, NCHW_FASTER])
    assert asked[:2] == [None, "rest"] and len(asked) == 3
    assert not backend_plan.agrees_with_inductor(planned)
    assert all(c.planned == "contiguous" for c in planned.convolutions)


@pytest.mark.parametrize("second", [NCHW_FASTER, NHWC_FASTER])
def test_the_cache_keeps_the_second_measurement_and_is_not_questioned(monkeypatch, tmp_path,
                                                                      second) -> None:
    store = CostCache(tmp_path / "costs.sqlite")
    first, _ = _plan(monkeypatch, [NCHW_FASTER, second], store=store)
    again, asked = _plan(monkeypatch, [NCHW_FASTER], store=store)  # only cached costs now
    # nothing timed, nothing confirmed (the rest looked up where the convolutions leave it open)
    assert asked[0] is None and set(asked[1:]) <= {"rest"} and again.table.measured == 0
    assert [c.planned for c in again.convolutions] == [c.planned for c in first.convolutions]
    store.close()


@pytest.mark.parametrize("passes", [[NHWC_FASTER], [NCHW_FASTER, NHWC_FASTER]])
def test_a_convolution_of_one_pixel_agrees_with_any_format(monkeypatch, passes) -> None:
    """A squeeze-and-excitation gate's input is in both formats: whatever the plan and
    Inductor's rule call it, no copy is made, so it is no difference that costs a compile;
    so where the convolutions settle it (channels-last faster, as Inductor's rule puts them:
    no plan made) as where the cut is solved (they read faster contiguous first)."""
    planned, asked = _plan(monkeypatch, passes, net=Excited())
    gate = [c for c in planned.convolutions if c.shape[2:] == (1, 1)]
    assert gate and gate[0].planned == "either" and gate[0].inductor == "channels_last"
    assert not gate[0].differs and planned.solved == (len(passes) > 1)
    assert len(asked) == (1 if len(passes) == 1 else 3)
    assert backend_plan.agrees_with_inductor(planned)
