"""A plan changes no result: a model whose forward updates state, shares weights, is given in
train mode, changes its input in place or sits on the meta device is planned equal to the
original (repeated calls, state, gradients, parameters) or refused with a ``MemlayoutError``
that says why; never returned different."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from memlayout.errors import LayoutVerificationError, MemlayoutError, PlanError
from memlayout.plan.graph import Request
from memlayout.plan.pipeline import optimize
from memlayout.tensors import iter_tensors
from tests.support.planted import add_to_the_plan


class CallCounter(nn.Module):
    """A buffer counting calls that scales the output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.conv(x) * self.calls


class AttributeCounter(nn.Module):
    """The same with a plain Python int (a trace holds it as a constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.conv(x) * self.calls


class InPlaceCounter(nn.Module):
    """A buffer counter updated with an in-place tensor op (``torch.fx`` runs it while tracing
    and records no update either)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.conv(x) * self.calls


class Tied(nn.Module):
    """Two convolutions sharing one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.a = nn.Conv2d(8, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(self.stem(x))))


class InPlaceInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.conv(x)


class InPlaceAdd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x += 1
        return self.conv(F.relu(x, inplace=True))


class ReturnsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, self.conv(x)


class ReadOnlyBuffer(nn.Module):
    """A rank-4 buffer read, never written (the rewrite may convert it)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.register_buffer("scale", torch.rand(1, 8, 1, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) * self.scale


class UnusedWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.unused = nn.Parameter(torch.randn(8, 8, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class Frozen(nn.Module):
    """A frozen stem (``requires_grad=False``) before a trained convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1).requires_grad_(False)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.relu(self.stem(x)))


class InPlaceModuleOnInput(nn.Module):
    """``nn.ReLU(inplace=True)`` applied to the input itself, which is also returned."""

    def __init__(self) -> None:
        super().__init__()
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.relu(x)
        return {"input": x, "features": self.conv(y)}


class FunctionalTie(nn.Module):
    """One weight used by its module and functionally by another path."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.a = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.a(self.stem(x)))
        return F.conv2d(y, self.a.weight, padding=1)


class SharedModule(nn.Module):
    """One convolution called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.relu(self.conv(self.stem(x))))


class ModulesInAList(nn.Module):
    """Submodules also held in a plain list attribute, a stage that torch.fx cannot trace
    (data-dependent control flow: planned per submodule) and a call counter on that stage."""

    def __init__(self) -> None:
        super().__init__()
        self.stage = _Stage()
        self.head = nn.Conv2d(8, 4, 1)
        self.order = [self.stage, self.head]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.order:
            x = m(x)
        return x


class _Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.conv(x)
        return y if bool(y.mean() > -1e9) else -y


def _batchnorm_in_train_mode() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 1)).train()


def _cumulative_batchnorm() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=None)).train()


#: adversarial models: each must come back equal to the original or be refused
ADVERSARIAL: dict[str, Callable[[], nn.Module]] = {
    "call counter buffer": CallCounter,
    "call counter attribute": AttributeCounter,
    "call counter updated in place": InPlaceCounter,
    "tied weights": Tied,
    "train mode batchnorm": _batchnorm_in_train_mode,
    "cumulative batchnorm": _cumulative_batchnorm,
    "in-place input mul_": InPlaceInput,
    "in-place input += and relu": InPlaceAdd,
    "returns its input": ReturnsInput,
    "read-only rank-4 buffer": ReadOnlyBuffer,
    "unused rank-4 parameter": UnusedWeight,
    "requires_grad=False conv": Frozen,
    "in-place module on the returned input": InPlaceModuleOnInput,
    "weight used by a module and functionally": FunctionalTie,
    "one module called twice": SharedModule,
    "modules in a list, an untraceable stage": ModulesInAList,
}

#: how it is planned: analytic costs as given, a channels-last plan (conversions on every
#: boundary), a training plan, and measured costs with the guard (every candidate run many
#: times)
HOW: dict[str, dict[str, Any]] = {
    "analytic": {"measure": False},
    "channels_last": {"measure": False, "input_format": "channels_last"},
    "training": {"measure": False, "train": True},
    "guarded": {"measure": True, "guard": True, "rounds": 1, "guard_rounds": 1,
                "padding": False, "memory": False},
}


def _x(n: int = 2, size: int = 8) -> torch.Tensor:
    return torch.randn(n, 3, size, size)


def _close(a: Any, b: Any) -> bool:
    ts, us = list(iter_tensors(a)), list(iter_tensors(b))
    return len(ts) == len(us) and all(
        t.shape == u.shape and bool((t.detach().float() - u.detach().float()).abs().max()
                                    <= 1e-4 * max(t.detach().abs().max().item(), 1e-3))
        for t, u in zip(ts, us, strict=True))


def _projected(outputs: Any) -> Any:
    """A loss with a well-conditioned gradient: each output that trains, summed against
    fixed random weights. (A mean square is not: a batch-normalized output's mean square
    is about 1 whatever the weights, so its gradient is round-off.)"""
    total: Any = 0
    for t in iter_tensors(outputs):
        if t.requires_grad:
            g = torch.Generator().manual_seed(t.numel())
            total = total + (t.float() * torch.randn(t.shape, generator=g)).mean()
    return total


def _equivalent(reference: nn.Module, opt: nn.Module, x: torch.Tensor) -> None:
    """Same mode, parameters (count, ties, requires_grad), state, two calls (outputs, the
    inputs after them, buffers), gradients (which parameters get one, and their values),
    and one SGD step later the same again."""
    assert opt.training == reference.training
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    got_params = {k: p
                  for k, p in opt.named_parameters(remove_duplicate=False)}
    assert got_params.keys() == ref_params.keys()
    assert len(list(opt.parameters())) == len(list(reference.parameters()))
    for k, p in ref_params.items():
        assert got_params[k].requires_grad == p.requires_grad
        twins = [j for j, q in ref_params.items() if q is p]
        assert all(got_params[j] is got_params[k] for j in twins), f"{k} untied"
    for k, v in reference.state_dict().items():
        assert torch.equal(opt.state_dict()[k], v), f"{k} is not the caller's state"
    sgd_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    sgd_opt = torch.optim.SGD(opt.parameters(), lr=0.1)
    for _ in range(2):  # a call, a step, a call: every call compared
        for _call in range(2):
            xr, xo = x.clone(), x.clone()
            want, got = reference(xr), opt(xo)
            assert _close(want, got)
            assert torch.equal(xr, xo), "the caller's input differs after the call"
        for k, b in reference.named_buffers():
            assert _close(b, opt.state_dict()[k]), f"buffer {k}"
        loss_ref, loss_opt = _projected(want), _projected(got)
        if not isinstance(loss_ref, torch.Tensor):
            return  # nothing trains
        loss_ref.backward()
        loss_opt.backward()
        for k, p in ref_params.items():
            g = got_params[k].grad
            assert (p.grad is None) == (g is None), f"gradient of {k}"
            assert p.grad is None or _close(p.grad, g), f"gradient of {k}"
        sgd_ref.step()
        sgd_opt.step()
        sgd_ref.zero_grad()
        sgd_opt.zero_grad()


@pytest.mark.parametrize("how", list(HOW))
@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_an_adversarial_model_is_planned_equal_or_refused(name: str, how: str, tmp_path) -> None:
    torch.manual_seed(0)
    model = ADVERSARIAL[name]()
    reference = copy.deepcopy(model)
    x = _x()
    try:
        opt = optimize(model, x, cache=tmp_path / "costs.sqlite", **HOW[how])
    except MemlayoutError as exc:
        assert "please report" not in str(exc), str(exc)  # a cause the caller can act on
        return
    for k, v in reference.state_dict().items():  # the caller's model is untouched
        assert torch.equal(model.state_dict()[k], v)
    _equivalent(reference, opt, x)


def test_a_call_counter_starts_from_the_caller_s_state_after_guarded_planning(
        tmp_path, monkeypatch) -> None:
    """Capture, cost measurement, the guard's timing and verification all ran the model:
    none of those calls shows in the returned model (the guard keeps eager NCHW here, which
    runs the counter as the original does, whatever this machine measures)."""
    from memlayout.timing import Race

    monkeypatch.setattr(Race, "kept", lambda self, default=None, margin=0.0: "all_contiguous")
    model = CallCounter().eval()
    opt = optimize(model, _x(), cache=tmp_path / "c.sqlite", **HOW["guarded"])
    assert opt.plan.guard.kept == "all_contiguous" and opt.plan.guard.source == "measured"
    assert float(opt.state_dict()["calls"]) == 0.0 == float(model.calls)
    x = _x()
    with torch.no_grad():
        for _ in range(3):
            assert _close(model(x), opt(x))


@pytest.mark.parametrize("counter", [CallCounter, AttributeCounter])
def test_a_per_call_state_update_is_kept_on_every_call(counter: type[nn.Module]) -> None:
    # torch.fx runs ``self.calls += 1`` once while tracing and records no update; the planned
    # model must still count every call (capture keeps it, or verification refuses the plan)
    torch.manual_seed(0)
    model = counter().eval()
    reference = copy.deepcopy(model)
    opt = optimize(model, _x(), measure=False, cache=False)
    _equivalent(reference, opt, _x())
    x = _x()
    for _ in range(3):
        torch.testing.assert_close(opt(x), reference(x))


def test_tied_weights_stay_one_parameter_through_a_channels_last_plan() -> None:
    torch.manual_seed(0)
    model = Tied().eval()
    opt = optimize(model, _x(), measure=False, cache=False, input_format="channels_last")
    assert opt.plan.counts["channels_last"] > 0
    assert len(list(opt.parameters())) == len(list(model.parameters())) == 5
    assert opt.a.weight is opt.b.weight
    assert opt.a.weight.stride() == (72, 1, 24, 8)  # converted once, channels-last
    _equivalent(copy.deepcopy(model), opt, _x())


def test_an_inference_plan_comes_back_in_the_caller_s_mode() -> None:
    model = _batchnorm_in_train_mode()
    opt = optimize(model, _x(), measure=False, cache=False)
    assert model.training and opt.training and not opt.plan.train and opt.plan.mode == "train"
    reference = copy.deepcopy(model)
    x = _x()
    assert _close(reference(x), opt(x))  # train mode: batch statistics, as the original
    assert _close(reference[1].running_mean, opt.state_dict()["1.running_mean"])
    assert opt.memlayout.replans == 0  # planned in the mode it runs in
    opt.eval()
    reference.eval()
    with torch.no_grad():
        assert _close(reference(x), opt(x))
    assert opt.memlayout.replans == 1  # the other mode: planned on first sight


def test_an_eval_model_stays_in_eval_mode() -> None:
    model = _batchnorm_in_train_mode().eval()
    assert not optimize(model, _x(), measure=False, cache=False).training


def test_an_in_place_change_of_the_input_reaches_the_caller_s_tensor() -> None:
    torch.manual_seed(0)
    model = InPlaceInput().eval()
    opt = optimize(model, _x(), measure=False, cache=False)
    x = _x()
    xr, xo = x.clone(), x.clone()
    with torch.no_grad():
        assert _close(model(xr), opt(xo))
    assert torch.equal(xr, xo) and torch.equal(xo, 2 * x)


def test_an_in_place_change_hidden_by_a_conversion_is_refused_naming_the_op(monkeypatch) -> None:
    """Planted: the model's input converted on entry although the forward changes it in place
    (the plan never does that), so the change lands on a copy; verification names the
    in-place op on the input."""
    from memlayout.plan.steer.boundary import Boundary

    add_to_the_plan(monkeypatch, "", Boundary(inputs=((0, 1, 4),)))
    model = InPlaceInput().eval()
    with pytest.raises(LayoutVerificationError, match=r"in place \(mul_ \(\.mul_\) on input x\)"):
        optimize(model, _x(), measure=False, cache=False, fallback=False)
    # by default the model run in one format is kept instead; neither converts an input the
    # forward changes in place, so it changes the caller's tensor as the original does
    with pytest.warns(UserWarning, match=r"in place \(mul_"):
        opt = optimize(model, _x(), measure=False, cache=False)
    x = _x()
    xr, xo = x.clone(), x.clone()
    with torch.no_grad():
        assert _close(model(xr), opt(xo))
    assert torch.equal(xr, xo) and opt.plan.guard.kept in ("all_channels_last", "all_contiguous")


def test_an_in_place_change_with_an_input_format_is_refused_naming_the_op() -> None:
    with pytest.raises(LayoutVerificationError, match=r"mul_ \(\.mul_\) on input x.*input_format"):
        optimize(InPlaceInput().eval(), _x(), measure=False, cache=False,
                 input_format="channels_last")


@pytest.mark.parametrize("where", ["weights", "inputs"])
def test_a_meta_device_model_is_one_clear_error_before_any_work(where: str) -> None:
    with torch.device("meta" if where == "weights" else "cpu"):
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
    x = _x().to("meta") if where == "inputs" else _x()
    with pytest.raises(PlanError, match="meta device") as info:
        optimize(model, x, measure=False, cache=False)
    if where == "weights":
        assert "to_empty" in str(info.value)


def test_verification_records_the_semantic_checks() -> None:
    model = Tied().eval()
    opt = optimize(model, _x(), measure=False, cache=False)
    # the input after each of two calls, the second call's output, every buffer after both,
    # and each parameter (a tied one once): what the checks compare, counted from the model
    expected = 2 * 1 + 1 + len(list(model.buffers())) + len(list(model.parameters()))
    assert len(list(model.parameters())) < len(dict(model.named_parameters(remove_duplicate=False)))
    assert opt.plan.verification.semantics == expected


def test_every_user_of_a_shared_weight_is_tied_to_one_format() -> None:
    """The min cut ties every node that uses one tensor (through its module, or functionally
    through the module's attribute), so the one converted tensor is in the format each of
    them was planned for."""
    from memlayout.plan.capture.regions import capture
    from memlayout.plan.costs.measure import measure_costs
    from memlayout.plan.solve.formulate import formulate

    captured = capture(FunctionalTie().eval(), (_x(),))
    region = captured.regions[0]
    table = measure_costs(region.gm, region.inputs, measure=False, cache=None)
    form = formulate(region.gm, table, input_label=None, output_label=Request.KEEP)
    tied = {frozenset(t) for t in form.seconds.ties}
    assert frozenset({"a", "conv2d"}) in tied
    opt = optimize(FunctionalTie().eval(), _x(), measure=False, cache=False,
                   input_format="channels_last")
    formats = {n.name: n.format for n in opt.plan.nodes}
    assert formats["a"] == formats["conv2d"] == "channels_last"
    assert len(list(opt.parameters())) == 4  # stem and a: weight and bias each
