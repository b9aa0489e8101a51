"""The model planned entirely in one format (the guard's eager NCHW / NHWC candidate,
``memlayout.plan.steer.build.uniform_steering``): its root boundary converts exactly the
inputs its plan lists as conversions, no more and no fewer, whatever format they arrive in."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memlayout
from memlayout import Format, format_of
from memlayout.plan.costs import measure

CL = torch.channels_last


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1)).eval()


def _boundary_leaves(model: nn.Module) -> list[tuple[str, int]]:
    found = []
    for path, m in model.named_modules():
        if "forward" in m.__dict__:
            for b in m.forward.boundaries.values():
                found += [(path, leaf[1]) for leaf in (*b.inputs, *b.outputs)]
    return found


@pytest.mark.parametrize("arrives", ["contiguous", "channels_last"])
@pytest.mark.parametrize("runs_in", [0, 1])
def test_uniform_plan_converts_exactly_what_it_lists(monkeypatch, arrives: str,
                                                     runs_in: int) -> None:
    # predicted costs that make every node cheapest in ``runs_in``: a uniform plan
    analytic = measure.analytical_seconds
    monkeypatch.setattr(measure, "analytical_seconds", lambda gm, n, label: analytic(
        gm, n, label) * (1.0 if label == runs_in else 50.0))
    x = torch.randn(2, 3, 10, 10)
    if arrives == "channels_last":
        x = x.contiguous(memory_format=CL)
    opt = memlayout.optimize(_net(), x, measure=False, cache=False, guard=False)
    assert {n.format for n in opt.plan.nodes} == {("contiguous", "channels_last")[runs_in]}
    leaves = _boundary_leaves(opt)
    assert len(opt.plan.conversions) == len(leaves)
    if Format.parse(arrives) == (Format.CONTIGUOUS, Format.CHANNELS_LAST)[runs_in]:
        assert leaves == []  # nothing arrives in the other format: nothing to convert
    else:
        assert leaves and runs_in in {label for _, label in leaves}
    with torch.no_grad():  # and the planned model still hands back the original's format
        assert format_of(opt(x)) == format_of(_net()(x))
