"""Per-op cost measurement: as each Python spells a label, and how many rounds it takes."""

from __future__ import annotations

import enum

import pytest
import torch
from torch import nn

import memlayout
import memlayout.plan.costs.measure as costs
from memlayout.plan.capture.regions import capture
from memlayout.plan.graph import Label
from memlayout.timing import SEQUENTIAL_ROUNDS


def test_costs_are_measured_where_a_labels_str_is_its_name(monkeypatch, tmp_path):
    """Before Python 3.11 ``str()`` of an ``IntEnum`` member is its name (``Label.CONTIGUOUS``),
    from 3.11 its number: measuring must time both formats either way, not find every
    format failing and plan nothing."""
    monkeypatch.setattr(Label, "__str__", enum.Enum.__str__)
    assert str(Label.CHANNELS_LAST) == "Label.CHANNELS_LAST"
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    planned = memlayout.optimize(net.eval(), torch.randn(2, 3, 16, 16), cache=tmp_path / "c",
                                 rounds=1, guard=False, padding=False)
    convolutions = [n for n in planned.plan.nodes if "Conv2d" in n.op]
    assert convolutions and all(n.timed for n in convolutions)
    assert all(s is not None and s > 0 for n in convolutions for s in n.seconds.values())


class CallClock:
    """A clock that moves only when a timed op runs, by ``cost(label, call)`` seconds for the
    ``call``-th run of that label's call."""

    def __init__(self, cost) -> None:
        self.cost, self.now, self.calls = cost, 0.0, {}

    def __call__(self) -> float:
        return self.now

    def ran(self, label: str) -> None:
        self.calls[label] = self.calls.get(label, 0) + 1
        self.now += self.cost(label, self.calls[label])


def _rounds_per_node(monkeypatch, cost) -> tuple[list[int], dict]:
    """Each node measurement's rounds run (of at most 5), and the table's node seconds,
    with every op's run on ``CallClock(cost)``."""
    clock = CallClock(cost)
    real_call, real_interleaved = costs._Measurer._call, costs.interleaved
    rounds: list[int] = []

    def call(self, n, how, *, grad=False):
        fn = real_call(self, n, how, grad=grad)
        label = how if isinstance(how, str) else str(int(how))
        return lambda: (clock.ran(label), fn())[1]

    def interleaved(fns, **kwargs):
        result = real_interleaved(fns, **kwargs)
        if set(fns) == {"0", "1"}:  # a node's two formats (not a conversion)
            rounds.append(len(result.order))
        return result

    monkeypatch.setattr(costs._Measurer, "_call", call)
    monkeypatch.setattr(costs, "interleaved", interleaved)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    x = torch.randn(2, 3, 16, 16)
    gm = capture(net.eval(), (x,)).regions[0].gm
    table = costs.measure_costs(gm, (x,), rounds=5, clock=clock)
    return rounds, {n: c.seconds for n, c in table.nodes.items() if c.timed}


def test_an_ops_rounds_stop_once_its_formats_are_apart_or_tied(monkeypatch):
    """The rounds of one op's two formats are a sequential test: apart in every round, or
    within the keep margin in every round, they stop after ``SEQUENTIAL_ROUNDS``; neither,
    they run to the limit. The costs are the fastest rounds either way."""
    apart, seconds = _rounds_per_node(monkeypatch, lambda label, i: 0.02 if label == "0" else 0.01)
    assert apart and all(r == SEQUENTIAL_ROUNDS for r in apart)
    assert seconds and all(s == pytest.approx((0.02, 0.01)) for s in seconds.values())
    tied, _ = _rounds_per_node(monkeypatch, lambda label, i: 0.01)
    assert tied and all(r == SEQUENTIAL_ROUNDS for r in tied)
    # channels-last 4 % slower and 3 % faster by turns: no side, no tie within 2 %
    mixed, seconds = _rounds_per_node(
        monkeypatch, lambda label, i: 0.01 if label == "0" else (0.0104 if i % 2 else 0.0097))
    assert mixed and all(r == 5 for r in mixed)
    assert all(s == pytest.approx((0.01, 0.0097)) for s in seconds.values())


def test_an_ops_training_step_is_handed_a_gradient_in_its_outputs_strides_drawing_nothing():
    """The cost step's training call of one op: the output gradient its backward receives
    has the output's strides (channels-last here, as the consumer's backward hands it back),
    and no random number is drawn for it (the generator's state is as before: a random
    gradient of a large activation took longer to draw than many an op's step)."""
    seen: list[torch.Tensor] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen.append(grad)
            return grad * 2

    x = torch.randn(2, 8, 4, 4).contiguous(memory_format=torch.channels_last).requires_grad_()
    state = torch.get_rng_state()
    step = costs._train_step(lambda: Probe.apply(x), [x])
    outs = [step(), step()]
    assert torch.equal(torch.get_rng_state(), state)
    assert [g.stride() for g in seen] == [o.stride() for o in outs]
    assert outs[0].is_contiguous(memory_format=torch.channels_last) and x.grad is None
