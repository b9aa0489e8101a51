"""Per-op cost measurement as each Python spells a label."""

from __future__ import annotations

import enum

import torch
from torch import nn

import memlayout
from memlayout.plan.graph import Label


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
