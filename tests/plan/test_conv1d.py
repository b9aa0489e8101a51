"""Rank 3: 1-d convolution models planned NCL vs NLC (channels_last_1d)."""

from __future__ import annotations

import torch
from torch import nn

import memlayout
from memlayout.layout import Format
from memlayout.plan.capture import regions as capture
from memlayout.plan.solve import regions as solve_regions
from memlayout.plan.solve.mincut import Solution
from tests.support.counting import conv_inputs


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv1d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv1d(8, 8, 3, padding=1),
                         nn.GroupNorm(2, 8), nn.Conv1d(8, 6, 1)).eval()


def _plan_all_channels_last(monkeypatch) -> None:
    """Label every unpinned node channels-last (the rewrite is what is under test)."""
    real = solve_regions.solve_min_cut
    monkeypatch.setattr(solve_regions, "solve_min_cut", lambda problem: Solution(
        {k: problem.pins.get(k, 1) for k in real(problem).labels}, 0))


def test_torch_runs_conv1d_in_nlc_when_fed_nlc():
    """The premise, from torch itself: an NLC input and weight give an NLC output (a kernel
    that works in that layout, not a silent conversion back)."""
    conv = nn.Conv1d(4, 8, 3, padding=1)
    x = memlayout.to_format(torch.randn(2, 4, 16), Format.CHANNELS_LAST_1D)
    memlayout.convert_module(conv, Format.CHANNELS_LAST_1D)
    with torch.no_grad():
        out = conv(x)
    assert memlayout.format_of(out) is Format.CHANNELS_LAST_1D
    torch.testing.assert_close(out, nn.functional.conv1d(x.contiguous(), conv.weight.contiguous(),
                                                         conv.bias, padding=1))


def test_rank_3_is_planned_only_for_models_with_1d_convolutions():
    assert capture.planned_ranks(_net()) == (3, 4, 5)
    tokens = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    assert capture.planned_ranks(tokens) == (4, 5)
    cap = capture.capture(_net(), (torch.randn(2, 4, 16),))
    assert cap.ranks == (3, 4, 5)
    labels = [n.meta["memlayout"].label for n in cap.regions[0].gm.graph.nodes]
    assert labels[:2] == [0, 0]  # input and first conv's output: rank 3, contiguous (NCL)
    # a model without them: rank-3 values are not layout values
    cap = capture.capture(tokens, (torch.randn(2, 5, 8),))
    assert cap.ranks == (4, 5)
    assert all(n.meta["memlayout"].label is None for n in cap.regions[0].gm.graph.nodes)


def test_an_nlc_plan_converts_weights_once_feeds_nlc_and_matches(monkeypatch):
    _plan_all_channels_last(monkeypatch)
    net, x = _net(), torch.randn(2, 4, 16)
    opt = memlayout.optimize(net, x, measure=False)
    assert {n.format for n in opt.plan.nodes} == {"channels_last"}
    convs = {name: p for name, p in opt.named_parameters() if name.endswith("weight") and p.dim() == 3}
    assert len(convs) == 3
    assert all(Format.CHANNELS_LAST_1D in memlayout.formats_of(p.shape, p.stride())
               for p in convs.values())
    # the input converted where the plan says, at a module boundary (GroupNorm hands NCL back)
    assert opt.plan.conversions and all(c.leaves for c in opt.plan.conversions)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), net(x), rtol=1e-4, atol=1e-5)
    # the planned model keeps running NLC after another (2-d) model, planned in ranks 4 and
    # 5, was planned
    memlayout.optimize(nn.Sequential(nn.Conv2d(3, 4, 3)), torch.randn(1, 3, 8, 8), measure=False)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), net(x), rtol=1e-4, atol=1e-5)
    # what each convolution receives where it runs: channels innermost, NLC
    seen = conv_inputs(opt, x)
    assert len(seen) == 3 and all(fmt is Format.CHANNELS_LAST_1D for _, fmt in seen), seen
    # the original model is untouched
    assert all(p.is_contiguous() for p in net.parameters())


def test_a_measured_plan_says_what_it_did_with_rank_3(tmp_path):
    net, x = _net(), torch.randn(2, 4, 64)
    opt = memlayout.optimize(net, x, cache=tmp_path / "c.sqlite", guard=False, rounds=2)
    convs = [n for n in opt.plan.nodes if n.op == "Conv1d"]
    assert len(convs) == 3 and all(n.timed for n in convs)
    # torch has an NLC kernel here (test above): both formats are measured for every conv
    assert all(n.seconds["contiguous"] and n.seconds["channels_last"] for n in convs)
    notes = [n for n in opt.plan.notes if n.startswith("rank 3")]
    assert len(notes) == 1
    nlc = sum(n.format == "channels_last" for n in convs)
    ratios = [n.seconds["channels_last"] / n.seconds["contiguous"] for n in convs]
    if nlc:
        assert f"planned: {nlc} of 3" in notes[0]
    elif min(ratios) >= 1:
        assert "not beneficial here" in notes[0]
    else:  # NLC faster alone, but not worth the conversions around it
        assert "planned: 0 of 3" in notes[0]
    assert notes[0] in opt.plan.summary()
    with torch.no_grad():
        torch.testing.assert_close(opt(x), net(x), rtol=1e-4, atol=1e-5)


def test_a_2d_model_gets_no_rank_3_note():
    opt = memlayout.optimize(nn.Sequential(nn.Conv2d(3, 4, 3)), torch.randn(1, 3, 8, 8),
                             measure=False)
    assert not [n for n in opt.plan.notes if n.startswith("rank 3")]
