"""Weight storage as a planner choice: ``optimize(weights="contiguous")`` keeps every
parameter contiguous (what FSDP's ``fully_shard`` takes) while activations run channels-last;
each channels-last convolution reads its weight as it is or converts it per call, as measured.
Checked against eager: outputs and gradients equal, gradients in their parameters' strides."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from memlayout.errors import PlanError
from memlayout.layout import Format, strides_for
from memlayout.plan.pipeline import optimize
from memlayout.plan.steer import build
from memlayout.plan.weights import PER_CALL, convert_per_call
from memlayout.train.ddp import grad_layout_mismatches
from tests.support.planted import replace_steering


class Net(nn.Module):
    """Convolutions (3x3, 1x1, grouped), GroupNorm, a residual add and a linear head: no
    BatchNorm, so one training step is a pure function of the weights and the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.body = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, groups=4), nn.ReLU(),
                                  nn.Conv2d(16, 16, 1))
        self.gn = nn.GroupNorm(4, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        x = self.gn(x + self.body(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def _x() -> torch.Tensor:
    return torch.randn(2, 3, 12, 12).contiguous(memory_format=torch.channels_last)


def _contiguous(t: torch.Tensor) -> bool:
    return tuple(t.stride()) == strides_for(tuple(t.shape), Format.CONTIGUOUS)


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = model(x)
    out.square().sum().backward()
    return out.detach(), {k: p.grad for k, p in model.named_parameters()}


def _check_against_eager(model: nn.Module, opt: nn.Module, x: torch.Tensor) -> None:
    reference = copy.deepcopy(model).train()
    want, want_grads = _step(reference, x.contiguous())
    got, got_grads = _step(opt, x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    names = [k.removeprefix("module.") for k in got_grads]
    assert names == list(want_grads)
    for name, g in zip(names, got_grads.values(), strict=True):
        torch.testing.assert_close(g, want_grads[name], rtol=1e-4, atol=1e-5)
    assert grad_layout_mismatches(opt) == []
    conv_weights = [p for p in opt.parameters() if p.dim() == 4]
    # a 1x1 weight's gradient may carry other strides on its size-1 dims: still contiguous
    assert conv_weights and all(_contiguous(p) and p.grad.is_contiguous() for p in conv_weights)


def test_contiguous_weights_train_like_eager_with_channels_last_activations() -> None:
    model, x = Net(), _x()
    opt = optimize(model, x, train=True, weights="contiguous", measure=False, cache=False)
    chosen = {c.name: c.format for c in opt.plan.nodes}
    assert "channels_last" in chosen.values()  # activations planned, weights left alone
    assert all(_contiguous(p) for p in opt.parameters())
    assert any("weights='contiguous'" in note for note in opt.plan.notes)
    _check_against_eager(model, opt, x)


def test_a_new_batch_size_is_planned_on_the_same_contiguous_weights() -> None:
    model, x = Net(), _x()
    opt = optimize(model, x, train=True, weights="contiguous", measure=False, cache=False)
    weights = [id(p) for p in opt.parameters()]
    small = torch.randn(3, 3, 12, 12).contiguous(memory_format=torch.channels_last)
    _check_against_eager(model, opt, small)
    assert opt.memlayout.replans == 1 and [id(p) for p in opt.parameters()] == weights
    assert all(_contiguous(p) for p in opt.parameters())


def test_converted_weights_stay_the_default() -> None:
    model, x = Net(), _x()
    opt = optimize(model, x, train=True, measure=False, cache=False)
    assert not _contiguous(opt.stem.weight)  # converted once to channels-last


def test_measured_storage_is_recorded_per_channels_last_convolution(tmp_path) -> None:
    model, x = Net(), _x()
    opt = optimize(model, x, train=True, weights="contiguous", cache=tmp_path / "c.sqlite",
                   guard=False, rounds=1, memory=False, padding=False)
    assert all(_contiguous(p) for p in opt.parameters())
    _check_against_eager(model, opt, x)
    # a second plan reads both variants' timings from the cache: nothing measured
    again = optimize(model, x, train=True, weights="contiguous", cache=tmp_path / "c.sqlite",
                     guard=False, rounds=1, memory=False, padding=False, reuse=False)
    assert again.plan.measured == 0 and again.plan.notes == opt.plan.notes


def test_per_call_storage_against_eager(monkeypatch) -> None:
    """Every channels-last convolution made to convert its weight per call (as the measured
    choice would where that is faster): same training step, weights still contiguous."""
    real = build.steering_of

    def per_call_everywhere(solution, options, storage=None):  # noqa: ANN001, ANN202
        return real(solution, options, {(s.region.path, n): PER_CALL
                                        for s in solution.regions for n in s.table.nodes})

    replace_steering(monkeypatch, per_call_everywhere)
    model, x = Net(), _x()
    opt = optimize(model, x, train=True, weights="contiguous", measure=False, cache=False)
    key = opt.memlayout.example
    per_call = [m for m in opt.modules() if "forward" in m.__dict__
                and m.forward.boundaries.get(key) is not None
                and m.forward.boundaries[key].weight_label == 1]
    assert per_call and all(type(m) is nn.Conv2d for m in per_call)  # the model's own class
    assert set(opt.state_dict()) == set(model.state_dict())
    # it pickles (memlayout train sends rank 0's planned model to the other ranks) with its
    # modules' own classes
    buf = io.BytesIO()
    torch.save(opt, buf)
    assert b"PerCall" not in buf.getvalue()
    buf.seek(0)
    copied = torch.load(buf, weights_only=False)
    assert [type(m) for m in copied.modules()] == [type(m) for m in opt.modules()]
    _check_against_eager(model, opt, x)
    _check_against_eager(model, copied, x)


@pytest.mark.parametrize("memory_format", [torch.channels_last, torch.contiguous_format])
def test_per_call_convolution_against_the_plain_one(memory_format) -> None:
    conv = nn.Conv2d(4, 6, 3)
    per_call = convert_per_call(copy.deepcopy(conv))
    x = torch.randn(2, 4, 9, 9).contiguous(memory_format=memory_format)
    want, want_grads = _step(conv, x)
    got, got_grads = _step(per_call, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got.is_contiguous(memory_format=memory_format)
    for k, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[k], rtol=1e-5, atol=1e-6)
        assert g.stride() == per_call.get_parameter(k).stride()


def test_unknown_weight_storage_is_refused() -> None:
    with pytest.raises(PlanError, match="weights must be one of"):
        optimize(Net(), _x(), weights="channels_last", measure=False, cache=False)
