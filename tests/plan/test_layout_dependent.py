"""What a forward does that depends on more than its values: casts back after an autocast
region (the float64 re-check runs the model's own code), returning its own parameters (the
object, not a copy), being compiled from source (``torch.jit.script``), drawing random masks
(dropout draws in memory order). Each through ``memlayout.optimize``, checked against the
original model itself.

``measure=False``: the analytical costs put these convolutions channels-last, so the plans
really change layouts (asserted where it matters)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import memlayout
from memlayout.errors import LayoutVerificationError, MemlayoutError
from memlayout.plan.costs import measure
from tests.support.planted import corrupt_the_plan_at


def _plan(model: nn.Module, x: torch.Tensor, **kw: Any) -> nn.Module:
    return memlayout.optimize(model, x, measure=False, cache=False, **kw)


def _x() -> torch.Tensor:
    return torch.randn(2, 3, 16, 16)


def _channels_last(planned: nn.Module, *names: str) -> None:
    formats = {n.name: n.format for n in planned.plan.nodes}
    assert all(formats[n] == "channels_last" for n in names), formats


class CastBack(nn.Module):
    """A bf16 autocast region whose result is cast back to float32 before the head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3, padding=1)
        self.bn = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 32, 3, padding=1)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(x)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.conv2(x)
        return self.head(y.float().mean((2, 3)))


def _rounding_beyond_tolerance(monkeypatch: Any) -> None:
    """Every float32 comparison fails (tolerance 1e-9), and the plan differs from the
    original by rounding alone (a float32 round trip through 1.0, which float64 keeps):
    only the float64 re-check can verify it."""
    from memlayout.plan import compare

    monkeypatch.setitem(compare.TOLERANCE, torch.float32, (1e-9, 1e-12))
    corrupt_the_plan_at(monkeypatch, "conv", lambda out: (out + 1.0) - 1.0)


@pytest.mark.parametrize("train", [False, True])
def test_a_cast_back_after_an_autocast_region_stays_float64_in_the_recheck(
        monkeypatch: Any, train: bool) -> None:
    _rounding_beyond_tolerance(monkeypatch)
    model = CastBack().train(train)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to a model run in one format
        opt = _plan(model, _x(), train=train)
    record = opt.plan.verification
    assert record.check == "float64 re-check" and record.train == train
    assert record.float64_error is not None and record.float64_error <= 1e-9
    assert not opt.plan.notes


class FixedFloat32(CastBack):
    """A plain tensor attribute (not a buffer): ``.double()`` leaves it float32, so no
    float64 copy of this model runs."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.randn(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x))).mean((2, 3)) @ self.table


@pytest.mark.parametrize("train", [False, True])
def test_a_model_that_cannot_run_in_float64_is_refused_not_crashed(
        monkeypatch: Any, train: bool) -> None:
    _rounding_beyond_tolerance(monkeypatch)
    with pytest.raises(LayoutVerificationError) as err:
        _plan(FixedFloat32().train(train), _x(), train=train, fallback=False)
    if train:
        assert "float64 re-check could not run" in str(err.value)
    # by default, the model run in one format (equal to the original) is kept instead
    with pytest.warns(UserWarning, match="failed verification"):
        opt = _plan(FixedFloat32().train(train), _x(), train=train)
    assert opt.plan.verification.ok


class ReturnsItsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 32, 3, padding=1)
        self.register_buffer("grid", torch.randn(1, 32, 4, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.conv2(self.conv(x)), self.conv2.weight, self.grid


@pytest.mark.parametrize("output_format", ["keep", "channels_last"])
def test_a_returned_parameter_or_buffer_is_that_object(output_format: str) -> None:
    model, x = ReturnsItsWeight(), _x()
    opt = _plan(model, x, output_format=output_format)
    _channels_last(opt, "conv", "conv2")
    assert opt.conv2.weight.is_contiguous(memory_format=torch.channels_last)  # planned
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            out, weight, grid = opt(x)
        assert weight is opt.conv2.weight and grid is opt.grid
        torch.testing.assert_close(out, model(x)[0], rtol=1e-4, atol=1e-5)


def test_torch_jit_script_of_a_planned_model_is_refused_in_one_line() -> None:
    model, x = CastBack().eval(), _x()
    torch.jit.script(model)  # the original scripts
    opt = _plan(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.script is deprecated
        with pytest.raises(MemlayoutError, match="torch.jit.script") as err:
            torch.jit.script(opt)
    message = str(err.value)
    assert "\n" not in message
    assert all(route in message for route in ("torch.jit.trace", "torch.export",
                                              "script the original"))
    assert not hasattr(opt.forward, "__globals__")  # what asks with a default gets it
    with torch.no_grad():  # the supported routes work
        torch.testing.assert_close(torch.jit.trace(opt, (x,), check_trace=False)(x), model(x))


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.conv = nn.Conv2d(32, 32, 3, padding=1)
        self.drop = nn.Dropout(0.5)
        self.conv2 = nn.Conv2d(32, 32, 3, padding=1)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv2(self.drop(self.conv(self.stem(x)))).mean((2, 3)))


@pytest.mark.parametrize("train", [True, False])
def test_dropout_drawn_in_another_memory_order_is_warned_about_once(train: bool) -> None:
    model, x = Dropped().train(), _x()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt = _plan(model, x, train=train)
    _channels_last(opt, "conv", "conv2")
    # what the warning says: the same seed draws other masks than the original's ...
    torch.manual_seed(1)
    want = model(x)
    torch.manual_seed(1)
    assert not torch.allclose(opt(x), want)
    # ... once, naming the module
    said = [str(w.message) for w in seen if "random masks" in str(w.message)]
    assert len(said) == 1 and "drop (Dropout)" in said[0]
    assert opt.plan.verification.redrawn == ["drop (Dropout)"]
    assert any("drop (Dropout)" in n for n in opt.plan.notes)


@pytest.mark.parametrize("train", [True, False])
def test_same_draws_drops_the_elements_the_original_drops(train: bool) -> None:
    model, x = Dropped().train(), _x()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: the masks are the original's
        opt = _plan(model, x, train=train, same_draws=True)
    _channels_last(opt, "conv", "conv2")
    assert opt.plan.verification.redrawn == ["drop (Dropout)"]
    for seed in (1, 2):
        torch.manual_seed(seed)
        want = model(x)
        torch.manual_seed(seed)
        got = opt(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        if train:  # and the gradients through the masks
            model.zero_grad(), opt.zero_grad()
            want.square().sum().backward()
            got.square().sum().backward()
            torch.testing.assert_close(opt.conv.weight.grad, model.conv.weight.grad,
                                       rtol=1e-3, atol=1e-4)


def test_no_warning_where_the_masks_are_drawn_as_in_the_original() -> None:
    model, x = Dropped().eval(), _x()  # eval: dropout draws nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = _plan(model, x)
    assert opt.plan.verification.redrawn == []
    model.train()
    x_last = x.contiguous(memory_format=torch.channels_last)
    with warnings.catch_warnings():  # the original, fed channels-last, draws channels-last too
        warnings.simplefilter("error")
        opt = _plan(model, x_last, train=True)
    _channels_last(opt, "conv", "conv2")
    assert opt.plan.verification.redrawn == []


def _storage_view(y: torch.Tensor) -> torch.Tensor:
    raw = torch.empty(0, dtype=y.dtype).set_(y.detach().untyped_storage())
    return y + raw[: y.numel()].view(y.shape)


#: Python that computes with a value's layout: each gives other values on another layout
LAYOUT_READS: dict[str, Any] = {
    "is_contiguous": lambda y: y * 2 if y.is_contiguous() else y,
    "stride": lambda y: y * (y.stride(1) / 64),
    "data_ptr": lambda y: y + 1 if y.data_ptr() == y.contiguous().data_ptr() else y,
    "untyped_storage": _storage_view,
}


class ReadsLayout(nn.Module):
    """Convolutions around a read of an activation's layout (``LAYOUT_READS``), in the
    model's own forward."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.conv = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 32, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.conv(x))
        return self.conv2(LAYOUT_READS[self.kind](y))


class Reader(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return LAYOUT_READS[self.kind](y)


class ReadsInASubmodule(nn.Module):
    """The read in a submodule between convolutions, more convolutions after it."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3, padding=1)
        self.reader = Reader(kind)
        self.conv2 = nn.Conv2d(32, 32, 3, padding=1)
        self.conv3 = nn.Conv2d(32, 32, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv3(F.relu(self.conv2(self.reader(F.relu(self.conv(x))))))


def _same_as_original(planned: nn.Module, model: nn.Module, x: torch.Tensor) -> None:
    """On ``x``, and on ``x`` channels-last, which the planned model plans anew."""
    for arrives in (x, x.contiguous(memory_format=torch.channels_last)):
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.testing.assert_close(planned(arrives), model(arrives), rtol=1e-4, atol=1e-4)
        # the new plan holds by itself: no fallback after a failed verification
        assert not any("failed verification" in str(w.message) for w in caught)


def _named(planned: nn.Module, call: str, module: str) -> bool:
    return any(f"{module}: .{call}() at test_layout_dependent.py:" in note
               for note in planned.plan.notes)


@pytest.mark.parametrize("kind", sorted(LAYOUT_READS))
def test_layout_reading_code_is_named_and_sees_the_original_layouts(kind: str) -> None:
    torch.manual_seed(0)
    model, x = ReadsLayout(kind).eval(), _x()
    with pytest.warns(UserWarning, match="reads layouts") as caught:
        planned = _plan(model, x)
    assert _named(planned, kind, "the model")
    # kept by the plan itself, not by a fallback after a failed verification
    assert not any("failed verification" in str(w.message) for w in caught)
    _same_as_original(planned, model, x)


@pytest.mark.parametrize("train", [False, True])
def test_a_reading_submodule_keeps_its_formats_and_the_rest_is_planned(
        train: bool, monkeypatch) -> None:
    # costs that put every node channels-last, the reader's values included, but for the pins
    analytic = measure.analytical_seconds
    monkeypatch.setattr(measure, "analytical_seconds", lambda gm, n, label: analytic(
        gm, n, label) * (1.0 if label == 1 else 20.0))
    torch.manual_seed(0)
    model, x = ReadsInASubmodule("is_contiguous"), _x()
    model.train(train)
    with pytest.warns(UserWarning, match="reads layouts") as caught:
        planned = _plan(model, x, train=train)
    assert _named(planned, "is_contiguous", "reader")
    assert not any("failed verification" in str(w.message) for w in caught)
    # after the read the plan is free again: the last convolution (conv3) runs channels-last
    assert planned.plan.nodes[-1].format == "channels_last", planned.plan.nodes
    if train:  # the example's plan, in its own mode
        with torch.no_grad():
            torch.testing.assert_close(planned(x), model(x), rtol=1e-4, atol=1e-4)
    else:
        _same_as_original(planned, model, x)


def test_a_reading_submodule_replanned_in_the_other_mode_keeps_the_original_formats(
        monkeypatch) -> None:
    """A plan made later (the training plan called in eval mode, an input in the other
    format) is made on the live weights: they keep their own formats in a model that reads
    layouts, so that plan sees the layouts the original's code reads too."""
    analytic = measure.analytical_seconds
    monkeypatch.setattr(measure, "analytical_seconds", lambda gm, n, label: analytic(
        gm, n, label) * (1.0 if label == 1 else 20.0))
    torch.manual_seed(0)
    model, x = ReadsInASubmodule("is_contiguous").train(), _x()
    planned = _plan(model, x, train=True)
    assert planned.plan.weights == "contiguous"
    assert all(p.is_contiguous() for p in planned.parameters())  # as the original's
    model.eval(), planned.eval()
    _same_as_original(planned, model, x)


def test_a_declared_input_format_with_layout_reads_is_refused_in_one_line() -> None:
    with pytest.raises(MemlayoutError) as refused:
        _plan(ReadsLayout("stride").eval(), _x(), input_format="channels_last")
    message = str(refused.value)
    assert "\n" not in message and ".stride() at test_layout_dependent.py:" in message


def test_a_declared_input_format_is_verified_on_the_other_format_too(monkeypatch: Any) -> None:
    """With the reads hidden from capture, the verification's call on an input in the other
    format than the declared one still catches a model whose results depend on it."""
    from memlayout.plan.capture.reads import LayoutReads

    monkeypatch.setattr(LayoutReads, "_record", lambda self, call: None)
    model, x = ReadsLayout("is_contiguous").eval(), _x()
    with pytest.raises(LayoutVerificationError, match="arrives contiguous"):
        _plan(model, x, input_format="channels_last")


class Shuffled(nn.Module):
    """ShuffleNet's channel shuffle between convolutions: ``view``s of values it has just
    made contiguous itself, which read no layout."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 32, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchvision.models.shufflenetv2 import channel_shuffle

        return self.conv2(channel_shuffle(F.relu(self.conv(x)), 4))


@pytest.mark.parametrize("input_format", [None, "channels_last"])
def test_views_that_read_no_layout_are_not_taken_for_layout_reads(input_format) -> None:
    torch.manual_seed(0)
    model, x = Shuffled().eval(), _x()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planned = _plan(model, x, input_format=input_format)
    assert not any("reads layouts" in str(w.message) for w in caught)
    with torch.no_grad():
        torch.testing.assert_close(planned(x), model(x), rtol=1e-4, atol=1e-4)


class FlatFirst(nn.Module):
    """A forward that flattens its input with ``view``: it runs on contiguous inputs only."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.view(x.shape[0], -1).sigmoid().view(x.shape))


def test_a_declared_format_the_original_alone_runs_in_is_verified_on_it_only() -> None:
    """With ``input_format="contiguous"``, the original does not run on a channels-last
    input at all: nothing to compare there, and the plan (which converts such an input on
    entry) runs it."""
    model, x = FlatFirst().eval(), _x()
    planned = _plan(model, x, input_format="contiguous")
    with torch.no_grad():
        got = planned(x.contiguous(memory_format=torch.channels_last))
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-4)


def test_same_draws_holds_in_a_plan_applied_from_its_json(tmp_path) -> None:
    model, x = Dropped().train(), _x()
    opt = _plan(model, x, train=True, same_draws=True)
    path = tmp_path / "plan.json"
    path.write_text(opt.plan.to_json())
    applied = memlayout.apply(Dropped().train(), path, x)
    applied.load_state_dict(model.state_dict())
    assert applied.plan.verification.draws == opt.plan.verification.draws != []
    torch.manual_seed(3)
    want = model(x)
    torch.manual_seed(3)
    torch.testing.assert_close(applied(x), want, rtol=1e-4, atol=1e-5)


class ViewsAll(nn.Module):
    """A ``view`` that flattens an activation: channels-last strides refuse it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 32, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.conv(x))
        return self.conv2(y.view(y.shape[0], -1).softmax(-1).view(y.shape))


def test_a_view_the_planned_layout_refuses_is_caught_by_the_verification() -> None:
    """A view reads no value through the layout: it runs or raises. The planned model in
    which it raises is given up by the verification for one in which it runs."""
    torch.manual_seed(0)
    model, x = ViewsAll().eval(), _x()
    planned = _plan(model, x)
    with torch.no_grad():
        torch.testing.assert_close(planned(x), model(x), rtol=1e-4, atol=1e-4)


class ReadsWithKeywords(ReadsLayout):
    def forward(self, x: torch.Tensor, *, gain: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * gain


def test_a_read_is_named_by_the_users_module_path_under_keyword_inputs() -> None:
    torch.manual_seed(0)
    model, x = ReadsWithKeywords("stride").eval(), _x()
    with pytest.warns(UserWarning, match="reads layouts"):
        planned = _plan(model, x, kwargs={"gain": torch.full((1,), 2.0)})
    assert _named(planned, "stride", "the model"), planned.plan.notes
