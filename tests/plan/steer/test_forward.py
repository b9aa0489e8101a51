"""A steered module's forward (``memlayout.plan.steer.forward``): the user's own ``forward``
runs, with the plan's conversions at its boundary, the user's hooks fire as on the original,
results come back in the strides and values the original returns, a returned parameter or
buffer as the object itself, and ``torch.jit.script`` is refused with memlayout's error."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import memlayout
from memlayout import Format
from memlayout.errors import MemlayoutError, ScriptError
from memlayout.plan.graph import Label
from memlayout.plan.steer import boundary
from memlayout.plan.steer.boundary import Boundary
from memlayout.plan.steer.forward import RootForward, SteeredForward, steered
from memlayout.plan.steer.state import output_formats
from memlayout.plan.steer.steering import Steering, steer
from memlayout.tensors import iter_tensors
from tests.support.formats import torch_formats

CONTIGUOUS, CHANNELS_LAST = int(Label.CONTIGUOUS), int(Label.CHANNELS_LAST)


class FeatureMap(nn.Module):
    """Two convolutions; hands back the feature map."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 16, 3, padding=1)
        self.b = nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Pooled(nn.Module):
    """Feature map and pooled logits; with ``features_only`` the feature map alone."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.conv = nn.Conv2d(16, 16, 3, padding=1)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, features_only: bool = False) -> Any:
        f = self.conv(torch.relu(self.bn(self.stem(x))))
        if features_only:
            return f
        return f, self.head(f.mean((2, 3)))


class ChannelsLastOut(FeatureMap):
    """Hands its feature map back in channels last, whatever its input's format."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).contiguous(memory_format=torch.channels_last)


class WithInputView(nn.Module):
    """Hands back a view of its input beside its feature map."""

    def __init__(self) -> None:
        super().__init__()
        self.body = FeatureMap()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.body(x), x[:, :2]


class Video(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv3d(3, 16, 3, padding=1)
        self.b = nn.Conv3d(16, 16, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Signal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv1d(3, 16, 3, padding=1)
        self.b = nn.Conv1d(16, 16, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its channels innermost in memory, by torch's own permute and copy."""
    order = (0, *range(2, t.dim()), 1)
    return t.permute(order).contiguous().permute(sorted(range(t.dim()), key=order.__getitem__))


#: small models, and the input each is planned and called with
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "feature map": (FeatureMap, lambda: torch.randn(2, 3, 12, 12)),
    "feature map and logits": (Pooled, lambda: torch.randn(2, 3, 12, 12)),
    "channels-last result": (ChannelsLastOut, lambda: torch.randn(2, 3, 12, 12)),
    "a view of the input": (WithInputView, lambda: torch.randn(2, 3, 12, 12)),
    "H == W == 1": (Pooled, lambda: torch.randn(2, 3, 1, 1)),
    "C == 1 result": (lambda: nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                                            nn.Conv2d(16, 1, 3, padding=1)),
                      lambda: torch.randn(2, 3, 12, 12)),
    "rank 5": (Video, lambda: torch.randn(2, 3, 6, 6, 6)),
    "rank 3": (Signal, lambda: torch.randn(2, 3, 16)),
}

#: the format a call's input comes in
INPUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "contiguous input": lambda x: x,
    "channels-last input": _channels_last,
}


def _plan(model: nn.Module, x: torch.Tensor, **options: Any) -> nn.Module:
    return memlayout.optimize(copy.deepcopy(model), x, measure=False, cache=False, **options)


def _long_strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides that say where elements are: those of the dims longer than 1."""
    return tuple(s for s, n in zip(t.stride(), t.shape, strict=True) if n > 1)


def assert_as_the_original(got: Any, want: Any) -> None:
    """Every tensor of ``got`` in the formats and strides of ``want``'s, with its values."""
    got_tensors, want_tensors = list(iter_tensors(got)), list(iter_tensors(want))
    assert type(got) is type(want) and len(got_tensors) == len(want_tensors)
    for g, w in zip(got_tensors, want_tensors, strict=True):
        assert torch_formats(g) == torch_formats(w)
        assert _long_strides(g) == _long_strides(w)
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arrive", INPUTS.values(), ids=INPUTS.keys())
@pytest.mark.parametrize(("make", "example"), MODELS.values(), ids=MODELS.keys())
def test_results_come_back_in_the_originals_strides_and_values(
        make: Callable[[], nn.Module], example: Callable[[], torch.Tensor],
        arrive: Callable[[torch.Tensor], torch.Tensor]) -> None:
    model, x = make().eval(), arrive(example())
    planned = _plan(model, x)
    with torch.no_grad():
        assert_as_the_original(planned(x), model(x))


#: the format a model is planned in, and the other one it is called in
CROSSED: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], ...]] = {
    "contiguous example, channels-last call": (INPUTS["contiguous input"],
                                               INPUTS["channels-last input"]),
    "channels-last example, contiguous call": (INPUTS["channels-last input"],
                                               INPUTS["contiguous input"]),
}


@pytest.mark.parametrize(("planned_in", "called_in"), CROSSED.values(), ids=CROSSED.keys())
@pytest.mark.parametrize(("make", "example"), MODELS.values(), ids=MODELS.keys())
def test_a_call_in_another_format_than_the_examples_comes_back_as_the_original_returns_it(
        make: Callable[[], nn.Module], example: Callable[[], torch.Tensor],
        planned_in: Callable[[torch.Tensor], torch.Tensor],
        called_in: Callable[[torch.Tensor], torch.Tensor]) -> None:
    model, x = make().eval(), example()
    planned = _plan(model, planned_in(x))
    with torch.no_grad():
        for call in (called_in(x), planned_in(x), called_in(x)):
            assert_as_the_original(planned(call), model(call))


@pytest.mark.parametrize("arrive", INPUTS.values(), ids=INPUTS.keys())
@pytest.mark.parametrize(("make", "example"), MODELS.values(), ids=MODELS.keys())
def test_a_call_of_another_shape_comes_back_as_the_original_returns_it(
        make: Callable[[], nn.Module], example: Callable[[], torch.Tensor],
        arrive: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """A plan made on first sight is captured on the live parameters, some converted: its
    results still come back as the original (parameters in their own formats) returns them."""
    model, x = make().eval(), arrive(example())
    planned = _plan(model, x)
    bigger = arrive(torch.cat([example(), example()]))
    with torch.no_grad():
        assert_as_the_original(planned(bigger), model(bigger))
    assert planned.memlayout.replans == 1


def test_a_call_with_keywords_of_another_shape_comes_back_as_the_original_returns_it() -> None:
    model, x = Pooled().eval(), torch.randn(2, 3, 12, 12)
    planned = _plan(model, x)
    bigger = torch.randn(3, 3, 12, 12)
    with torch.no_grad():
        assert_as_the_original(planned(bigger, features_only=True),
                               model(bigger, features_only=True))
        assert_as_the_original(planned(bigger), model(bigger))


def test_a_result_of_another_structure_comes_back_as_the_original_returns_it() -> None:
    model, x = Pooled().eval(), torch.randn(2, 3, 12, 12)
    planned = _plan(model, x)
    with torch.no_grad():
        for call in (x, _channels_last(x)):
            assert_as_the_original(planned(call, features_only=True),
                                   model(call, features_only=True))


def test_the_plan_of_these_models_changes_formats_inside() -> None:
    """The tests above are about a plan that converts: a parameter in another format than
    the original's, and a boundary that converts."""
    model, x = Pooled().eval(), torch.randn(2, 3, 12, 12)
    planned = _plan(model, x)
    assert any(torch_formats(p) != torch_formats(q)
               for p, q in zip(model.parameters(), planned.parameters(), strict=True))
    assert any(b.inputs or b.outputs for m in planned.modules() if steered(m)
               for b in steered(m).boundaries.values())


def test_these_checks_fail_when_a_boundary_converts_into_the_other_format(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The bar for the tests above: a plan whose conversions go into the other format hands
    back a result in other strides than the original's."""
    model, x = FeatureMap().eval(), torch.randn(2, 3, 12, 12)
    planned = _plan(model, x)
    real = boundary.to_label
    monkeypatch.setattr(boundary, "to_label", lambda t, label: real(t, 1 - label))
    with torch.no_grad(), pytest.raises(AssertionError):
        assert_as_the_original(planned(x), model(x))


# ---------------------------------------------------------------- the user's forward and hooks


class SeenConv(nn.Conv2d):
    """A convolution whose own ``forward`` notes each input it is given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x)
        return super().forward(x)


class Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = SeenConv(3, 16, 3, padding=1)
        self.conv = SeenConv(16, 16, 3, padding=1)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.conv(torch.relu(self.stem(x)))


def test_each_call_runs_the_users_own_forward_once() -> None:
    model, x = Counted().eval(), torch.randn(2, 3, 12, 12)
    planned = _plan(model, x)
    assert isinstance(steered(planned), RootForward)
    calls, stem, conv = planned.calls, len(planned.stem.seen), len(planned.conv.seen)
    with torch.no_grad():
        planned(x)
    assert planned.calls == calls + 1
    assert len(planned.stem.seen) == stem + 1 and len(planned.conv.seen) == conv + 1


def _hand_steered(boundary_of_conv: Boundary) -> nn.Sequential:
    """``Sequential(SeenConv)`` steered by hand: the convolution's boundary is the one given,
    under the plan key ``"example"``."""
    net = nn.Sequential(SeenConv(3, 16, 3, padding=1))
    steer(net, Steering(boundaries=(("0", boundary_of_conv),)), key="example",
          input_label=None, outputs=(), plan=None)
    return net


def test_the_users_forward_gets_its_input_in_the_planned_format_and_hooks_see_the_callers() -> None:
    net = _hand_steered(Boundary(inputs=((0, CHANNELS_LAST, 4),), outputs=((0, CONTIGUOUS, 4),)))
    conv = net[0]
    assert isinstance(steered(conv), SteeredForward)
    pre_seen: list[torch.Tensor] = []
    post_seen: list[torch.Tensor] = []
    conv.register_forward_pre_hook(lambda m, args: pre_seen.append(args[0]))
    conv.register_forward_hook(lambda m, args, out: post_seen.append(out))
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        y = net(x)
    assert len(pre_seen) == 1 and pre_seen[0] is x  # the argument as the caller passed it
    (inside,) = conv.seen
    assert Format.CHANNELS_LAST in torch_formats(inside) and torch.equal(inside, x)
    assert post_seen[0] is y  # the result the steered module returns: converted on exit
    assert y.is_contiguous()
    with torch.no_grad():
        torch.testing.assert_close(y, nn.Conv2d.forward(conv, x))


def test_a_module_converts_by_the_plan_the_call_in_progress_runs() -> None:
    net = _hand_steered(Boundary(inputs=((0, CHANNELS_LAST, 4),)))
    conv, state = net[0], net.memlayout
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        conv(x)  # outside a call: the example's plan
        state.activate("another shape")  # a plan with no boundary here: nothing converted
        conv(x)
        state.activate("example")
        state.enabled = False  # steering off: the module's own forward alone
        conv(x)
    assert [Format.CHANNELS_LAST in torch_formats(t) for t in conv.seen] == \
        [True, False, False]
    assert conv.seen[1] is x and conv.seen[2] is x


def test_hooks_fire_once_per_call_and_change_results_as_on_the_original() -> None:
    model, x = Pooled().eval(), torch.randn(2, 3, 12, 12)
    planned = _plan(model, x)
    fired: dict[str, int] = {}

    def count(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            fired[name] = fired.get(name, 0) + 1
        return hook

    for net in (model, planned):
        net.stem.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
        net.conv.register_forward_hook(lambda m, args, out: out + 1)
    for name in ("stem", "bn", "conv"):
        planned.get_submodule(name).register_forward_pre_hook(count(f"{name} pre"))
        planned.get_submodule(name).register_forward_hook(count(name))
    root_args: list[Any] = []
    root_out: list[Any] = []
    planned.register_forward_pre_hook(lambda m, args: root_args.append(args))
    planned.register_forward_hook(lambda m, args, out: root_out.append(out))
    with torch.no_grad():
        got, want = planned(x), model(x)
    assert fired == {f"{n}{s}": 1 for n in ("stem", "bn", "conv") for s in ("", " pre")}
    assert root_args[0][0] is x and root_out[0] is got
    assert_as_the_original(got, want)


def test_a_steered_forward_keeps_the_originals_signature() -> None:
    model, x = Pooled().eval(), torch.randn(2, 3, 12, 12)
    planned = _plan(model, x)
    assert inspect.signature(planned.forward) == inspect.signature(model.forward)
    for name, module in planned.named_modules():
        if steered(module) is not None:
            original = model.get_submodule(name)
            assert inspect.signature(module.forward) == inspect.signature(original.forward)


# ---------------------------------------------------------------- what a result is


class ReturnsOwnTensors(nn.Module):
    """Hands back its convolution's weight and a buffer beside its result."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.conv = nn.Conv2d(16, 16, 3, padding=1)
        self.register_buffer("grid", torch.randn(1, 16, 12, 12))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.conv(torch.relu(self.stem(x))) + self.grid, self.conv.weight, self.grid


class Kernel(nn.Module):
    """A module whose result is its own parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 3, 3, 3))

    def forward(self) -> nn.Parameter:
        return self.weight


class UsesKernel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kernel = Kernel()
        self.conv = nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.kernel()
        return self.conv(nn.functional.conv2d(x, k, padding=1)), k


#: models handing back their own tensors, and the attribute each result position names
OWN_RESULTS: dict[str, tuple[Callable[[], nn.Module], dict[int, str]]] = {
    "weight and buffer of the root": (ReturnsOwnTensors, {1: "conv.weight", 2: "grid"}),
    "parameter a child returns": (UsesKernel, {1: "kernel.weight"}),
}


def _own_tensor(model: nn.Module, name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    return module._parameters[attr] if attr in module._parameters else module._buffers[attr]


@pytest.mark.parametrize("arrive", INPUTS.values(), ids=INPUTS.keys())
@pytest.mark.parametrize(("make", "owned"), OWN_RESULTS.values(), ids=OWN_RESULTS.keys())
def test_a_returned_parameter_or_buffer_comes_back_as_the_object_itself(
        make: Callable[[], nn.Module], owned: dict[int, str],
        arrive: Callable[[torch.Tensor], torch.Tensor]) -> None:
    model, x = make().eval(), arrive(torch.randn(2, 3, 12, 12))
    planned = _plan(model, x)
    with torch.no_grad():
        got, want = planned(x), model(x)
    for position, name in owned.items():
        assert got[position] is _own_tensor(planned, name)
        torch.testing.assert_close(got[position], want[position])
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)


def test_a_returned_parameter_is_the_object_even_when_its_format_was_changed() -> None:
    """The case where handing back a copy would be the easy mistake: the plan stored the
    weight in another format than the original's, which the original returned."""
    model, x = ReturnsOwnTensors().eval(), torch.randn(2, 3, 12, 12)
    planned = _plan(model, x)
    assert torch_formats(planned.conv.weight) != torch_formats(model.conv.weight)
    with torch.no_grad():
        _, weight, _ = planned(x)
    assert weight is planned.conv.weight


# ---------------------------------------------------------------- TorchScript


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_torch_jit_script_of_a_planned_model_is_refused_with_memlayouts_error() -> None:
    model, x = FeatureMap().eval(), torch.randn(2, 3, 12, 12)
    torch.jit.script(copy.deepcopy(model))  # the original scripts: the refusal is the plan's
    planned = _plan(model, x)
    steered_children = [m for name, m in planned.named_modules() if name and steered(m)]
    assert steered_children
    for module in (planned, *steered_children):
        with pytest.raises(ScriptError) as caught:
            torch.jit.script(module)
        assert isinstance(caught.value, MemlayoutError)
        assert "torch.jit.trace" in str(caught.value)  # it says what to do instead
    with torch.no_grad():
        assert_as_the_original(planned(x), model(x))  # and the model still runs


class Noisy(FeatureMap):
    """Draws dropout masks and counts batch statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(16)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.bn(super().forward(x)))


@pytest.mark.filterwarnings("ignore:memlayout. random masks")
@pytest.mark.parametrize("arrive", INPUTS.values(), ids=INPUTS.keys())
def test_the_originals_formats_are_read_on_a_copy_leaving_the_model_and_the_rng_alone(
        arrive: Callable[[torch.Tensor], torch.Tensor]) -> None:
    model = Noisy().train()
    planned = _plan(model, torch.randn(2, 3, 12, 12), train=True)
    state = planned.memlayout
    assert state.original_strides  # the plan converted parameters: there is something to undo
    x = arrive(torch.randn(4, 3, 12, 12))
    rng = torch.get_rng_state()
    before = {k: (v.clone(), v.stride()) for k, v in planned.state_dict().items()}
    formats = state._original_outputs(planned, (x,), {})
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in planned.state_dict().items():  # running statistics, and parameter strides
        assert torch.equal(v, before[k][0]) and v.stride() == before[k][1]
    with torch.no_grad():
        want = output_formats(model(x), (x,), state.ranks)
    assert formats == want
