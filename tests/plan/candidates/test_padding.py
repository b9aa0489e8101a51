"""Padded channels (plan/padding.py): a padded convolution computes the unpadded one's values,
keeps its state dict, and the planner pads only where its own measurements say it is faster;
verification catches a padding that changes values."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from memlayout.bench.unets import odd_channels_small
from memlayout.errors import LayoutVerificationError
from memlayout.plan.candidates import padding as padding_mod
from memlayout.plan.candidates.padding import UNPADDED, PaddedConv2d, block_sizes, decide, variants
from memlayout.plan.pipeline import optimize
from memlayout.plan.report.records import PadChoice
from memlayout.timing import Race, Ratio
from tests.support.machine import AVX512, as_cpu

# Which padded variants exist is the CPU's vector width (block_sizes): `make test` runs these
# again under ATEN_CPU_CAPABILITY=avx2.
pytestmark = pytest.mark.isa

CASES = [  # (C in, C out, kernel, stride, padding, dilation, bias)
    (3, 24, 3, 2, 1, 1, False),
    (24, 40, 1, 1, 0, 1, True),
    (40, 72, 3, 1, 2, 2, True),
    (5, 7, 3, 1, 1, 1, True),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("pads", [(16, 0), (0, 16), (8, 8)])
def test_a_padded_convolution_computes_the_unpadded_values(case, fmt, pads) -> None:
    cin, cout, k, stride, pad, dil, bias = case
    conv = nn.Conv2d(cin, cout, k, stride, pad, dil, bias=bias).eval().to(memory_format=fmt)
    padded = PaddedConv2d.from_conv(conv, pad_in=-(-cin // pads[0]) * pads[0] if pads[0] else cin,
                                    pad_out=-(-cout // pads[1]) * pads[1] if pads[1] else cout)
    x = torch.randn(2, cin, 11, 9).contiguous(memory_format=fmt)
    with torch.no_grad():
        want, got = conv(x), padded(x)
    assert got.shape == want.shape
    assert got.stride() == want.stride()  # the same format comes out
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_steered_padded_convolution_keeps_its_state_dict_and_follows_its_weights() -> None:
    from memlayout.plan.steer.boundary import Boundary
    from memlayout.plan.steer.steering import Steering, steer

    net = nn.Sequential(nn.Conv2d(3, 5, 3)).eval()
    keys = {k: v.shape for k, v in net.state_dict().items()}
    steer(net, Steering(boundaries=(("0", Boundary(padding=(8, 8))),)), key="k",
          input_label=None, outputs=(), plan=None)
    assert {k: v.shape for k, v in net.state_dict().items()} == keys  # no padded copies in it
    assert type(net[0]) is nn.Conv2d and not list(net[0].buffers())
    x = torch.randn(1, 3, 6, 6)
    other = nn.Conv2d(3, 5, 3).eval()
    for change in ("load", "in place"):
        if change == "load":
            net.load_state_dict({f"0.{k}": v for k, v in other.state_dict().items()})
        else:
            with torch.no_grad():
                net[0].weight.mul_(2)
                other.weight.mul_(2)
        with torch.no_grad():
            torch.testing.assert_close(net(x), other(x), rtol=1e-5, atol=1e-6)


def test_variants_only_for_plain_convolutions_with_odd_channels() -> None:
    assert variants(nn.Conv2d(16, 32, 3), (16, 8)) == {}
    assert variants(nn.Conv2d(24, 24, 3, groups=24), (16,)) == {}  # depthwise: not padded
    assert variants(nn.Conv2d(3, 16, 3, padding="same"), (16,)) == {}
    assert set(variants(nn.Conv2d(3, 16, 3), (16, 8))) == {"in16", "in8"}
    assert all(k in (4, 8, 16) for k in block_sizes("cpu", None))
    assert block_sizes("cuda", torch.float16) == (8,)


def _eligible(model: nn.Module, blocks: tuple[int, ...]) -> set[str]:
    return {p for p, m in model.named_modules() if p and variants(m, blocks)}


def test_the_plan_reports_both_costs_and_pads_only_where_measured_faster(tmp_path) -> None:
    net, x = odd_channels_small()
    opt = optimize(net, x, cache=tmp_path / "c.sqlite", guard=False, rounds=2, blocked=False)
    plan = opt.plan
    assert plan.verification.ok
    blocks = block_sizes("cpu", None)
    assert {p.module for p in plan.padding} == _eligible(net, blocks)
    for p in plan.padding:
        seconds = p.seconds
        assert seconds[UNPADDED] is not None and seconds[UNPADDED] > 0
        assert set(seconds) == {UNPADDED, *variants(net.get_submodule(p.module), blocks)}
        assert all(v is not None and v > 0 for v in seconds.values())
        alone = decide(seconds, _race(p), 0.02)  # its own measurements decide
        if p.reverted:  # faster alone, but the whole model padded was not
            assert p.reverted == alone and p.chosen == UNPADDED
            assert p.whole_model is None or p.whole_model <= 1.0
        else:
            assert p.chosen == alone
            assert p.chosen == UNPADDED or p.whole_model > 1.0
        assert type(opt.get_submodule(p.module)) is nn.Conv2d  # the model's own module
        assert (p.module in _padded(opt)) == (p.chosen != UNPADDED)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), net(x), rtol=1e-4, atol=1e-5)
    assert "padded channels:" in plan.summary()


def _race(choice: PadChoice) -> Race:
    """The race a choice records, as the medians it keeps (all that ``decide`` weighs)."""
    return Race(UNPADDED, {n: Ratio(UNPADDED, n, m, (m,)) for n, m in (choice.ratios or {}).items()},
                rounds=1)


def _padded(opt: nn.Module) -> set[str]:
    """The convolutions a planned model runs padded (for the example's shape)."""
    key = opt.memlayout.example
    return {path for path, m in opt.named_modules() if "forward" in m.__dict__
            and key in m.forward.boundaries and m.forward.boundaries[key].padding}


def _pad_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every convolution that can be padded is, whatever was measured."""
    monkeypatch.setattr(padding_mod, "decide",
                        lambda seconds, race, margin: max(s for s in seconds if s != UNPADDED))
    monkeypatch.setattr(padding_mod, "whole_model_ratio", lambda *args, **kwargs: 2.0)


def test_padding_everything_verifies_equal(tmp_path, monkeypatch) -> None:
    _pad_everything(monkeypatch)
    net, x = odd_channels_small()
    opt = optimize(net, x, cache=tmp_path / "c.sqlite", guard=False, rounds=1, blocked=False)
    assert _padded(opt) == _eligible(net, block_sizes("cpu", None))
    assert opt.plan.verification.ok
    with torch.no_grad():
        torch.testing.assert_close(opt(x), net(x), rtol=1e-4, atol=1e-5)
    # state dicts load both ways, the padded copies following
    fresh = odd_channels_small()[0]
    opt.load_state_dict(fresh.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(opt(x), fresh(x), rtol=1e-4, atol=1e-5)


def test_padding_the_whole_model_must_be_faster_too(tmp_path, monkeypatch) -> None:
    _pad_everything(monkeypatch)
    monkeypatch.setattr(padding_mod, "whole_model_ratio", lambda *args, **kwargs: 0.9)
    net, x = odd_channels_small()
    opt = optimize(net, x, cache=tmp_path / "c.sqlite", guard=False, rounds=1, blocked=False)
    assert not _padded(opt)
    assert all(p.chosen == UNPADDED and p.reverted and p.whole_model == 0.9
               for p in opt.plan.padding)
    assert "left unpadded" in opt.plan.summary()


def test_a_padding_that_changes_values_is_never_returned(tmp_path, monkeypatch) -> None:
    # blocks of 16 pad every convolution of odd_channels_small, so the wrong weights change its
    # output far beyond float32's tolerance (with AVX2's 8 only the 3-channel stem pads, and
    # its error can end up inside the tolerance)
    as_cpu(monkeypatch, AVX512)
    _pad_everything(monkeypatch)
    from memlayout.plan.steer import forward

    real = forward.padded_weights

    def off(conv, pad_in, pad_out):  # noqa: ANN001, ANN202  a bug: the padded copy is not the weights
        weight, bias = real(conv, pad_in, pad_out)
        return weight + 0.1, bias

    monkeypatch.setattr(forward, "padded_weights", off)
    net, x = odd_channels_small()
    before = copy.deepcopy(net.state_dict())
    with pytest.raises(LayoutVerificationError):
        optimize(net, x, cache=tmp_path / "c.sqlite", guard=False, rounds=1, blocked=False,
                 fallback=False)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    # by default: the model run in one format, unpadded, verified, and the plan says so
    with pytest.warns(UserWarning, match="failed verification"):
        opt = optimize(net, x, cache=tmp_path / "c.sqlite", guard=False, rounds=1,
                       blocked=False)
    assert not _padded(opt)
    assert opt.plan.padding == () and opt.plan.verification.ok
    with torch.no_grad():
        torch.testing.assert_close(opt(x), net.eval()(x))
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


# ---------------------------------------------------------------- blocked (mkldnn) formats

def test_mkldnn_chains_are_measured_and_reported_with_their_values_checked() -> None:
    from memlayout.plan.candidates import blocked

    ok, why = blocked.available()
    if not ok:
        pytest.skip(f"no mkldnn here: {why}")
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.GroupNorm(2, 8), nn.Conv2d(8, 8, 3), nn.ReLU()).eval()
    record = blocked.measure_blocked(net, (torch.randn(1, 3, 16, 16),), rounds=2)
    assert record.available and record.applied is False
    assert [c.children for c in record.chains] == [["0", "1", "2"], ["4", "5"]]
    for c in record.chains:
        assert c.seconds["planned"] > 0 and c.seconds["mkldnn"] > 0 and c.ratio > 0
        assert c.max_error < 1e-4  # the blocked run computes the same values
    wins = sum(c.ratio > 1 for c in record.chains)
    assert record.note.startswith(f"{wins} of 2 chains faster in mkldnn")


def test_no_mkldnn_is_said_in_the_plan(monkeypatch) -> None:
    from memlayout.plan.candidates import blocked
    from memlayout.plan.report.describe import blocked_summary
    from memlayout.plan.report.records import BlockedReport

    monkeypatch.setattr(blocked, "available", lambda: (False, "no mkldnn in this build"))
    record = blocked.measure_blocked(nn.Conv2d(3, 4, 1), (torch.randn(1, 3, 4, 4),))
    assert record == BlockedReport(available=False, note="no mkldnn in this build")
    assert "unavailable: no mkldnn in this build" in blocked_summary(record)
