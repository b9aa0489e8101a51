"""Rank 5: video models planned NCDHW vs NDHWC (channels_last_3d), end to end."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from torch import nn

import memlayout
from memlayout.layout import Format
from memlayout.plan.capture.regions import capture
from memlayout.plan.solve import regions as solve_regions
from memlayout.plan.solve.mincut import Solution
from tests.support.counting import conv_inputs

VIDEO_MODELS = ("r3d_18", "mc3_18", "r2plus1d_18")


def _conv_weights(model: nn.Module, opt: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each 3-d convolution node (as capture names it) and the weight the planned model runs
    it with (found by the parameter's name in the planned model)."""
    gm = capture(copy.deepcopy(model), (x,)).regions[0].gm
    out = {}
    for n in gm.graph.nodes:
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Conv3d):
            out[n.name] = opt.get_parameter(f"{n.target}.weight")
        elif n.op == "call_function" and n.target is torch.conv3d:
            out[n.name] = opt.get_parameter(str(n.args[1].target))
    return out


@pytest.mark.parametrize("name", VIDEO_MODELS)
def test_torchvision_video_models_plan_verify_and_match(name):
    torch.manual_seed(0)
    model = getattr(torchvision.models.video, name)(num_classes=5).eval()
    # batch 2: at batch 1 torch's conv3d returns NCDHW even for NDHWC input and weight (the
    # plan models that drop; batch 2 is the case worth planning)
    x = torch.randn(2, 3, 4, 16, 16)
    # r3d_18 with every planning step; the other two without the memory, padding and blocked
    # reports (memory, padding, mkldnn: slow here and not about rank 5)
    extras = {} if name == "r3d_18" else {"memory": False, "padding": False, "blocked": False}
    opt = memlayout.optimize(model, x, measure=False, **extras)
    plan = opt.plan
    assert plan.verification.ok and plan.regions == [""] and not plan.uncaptured
    # nn.Conv3d leaves, and torchvision's Conv3d subclasses that fx traces to torch.conv3d
    convs = [n for n in plan.nodes if n.op in ("Conv3d", "torch.conv3d")]
    assert len(convs) == sum(isinstance(m, nn.Conv3d) for m in model.modules())
    # every convolution planned channels-last runs with an NDHWC weight (converted once),
    # every other with an NCDHW one
    weights = _conv_weights(model, opt, x)
    assert set(weights) == {n.name for n in convs}
    for n in convs:
        fmt = Format.CHANNELS_LAST_3D if n.format == "channels_last" else Format.CONTIGUOUS
        assert fmt in memlayout.formats_of(weights[n.name].shape, weights[n.name].stride()), n
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)


def test_an_ndhwc_plan_feeds_ndhwc_and_keeps_the_output_format(monkeypatch):
    real = solve_regions.solve_min_cut
    monkeypatch.setattr(solve_regions, "solve_min_cut", lambda problem: Solution(
        {k: problem.pins.get(k, 1) for k in real(problem).labels}, 0))
    net = nn.Sequential(nn.Conv3d(3, 8, 3, padding=1), nn.BatchNorm3d(8), nn.ReLU(),
                        nn.MaxPool3d(2), nn.Conv3d(8, 4, 3, padding=1)).eval()
    x = torch.randn(2, 3, 4, 8, 8)
    opt = memlayout.optimize(net, x, measure=False)
    assert {n.format for n in opt.plan.nodes} == {"channels_last"}
    with torch.no_grad():
        out = opt(x)
    # what the last convolution receives where it runs
    assert conv_inputs(opt, x)[-1] == ("4", Format.CHANNELS_LAST_3D)
    assert memlayout.format_of(out) is Format.CONTIGUOUS  # output_format="keep": as the original
    torch.testing.assert_close(out, net(x), rtol=1e-4, atol=1e-5)


def test_measured_3d_costs_time_both_formats(tmp_path):
    net = nn.Sequential(nn.Conv3d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv3d(8, 8, 3)).eval()
    x = torch.randn(2, 3, 4, 12, 12)
    opt = memlayout.optimize(net, x, cache=tmp_path / "c.sqlite", guard=False, rounds=2)
    convs = [n for n in opt.plan.nodes if n.op == "Conv3d"]
    assert len(convs) == 2 and all(n.timed for n in convs)
    assert all(n.seconds["contiguous"] and n.seconds["channels_last"] for n in convs)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), net(x), rtol=1e-4, atol=1e-5)
