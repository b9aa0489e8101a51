"""What a planned model's plan is chosen by (``memlayout.plan.steer.state``): the shape, dtype,
device type and memory format (as torch's ops read it from the strides) of every tensor
argument, and the model's train/eval mode. A call that differs in one of them runs a plan made
for it; one that differs in anything else (strides torch reads as the same format, values,
autograd) runs the same plan. A plan that converts its inputs on arrival (``input_format``)
serves them in either format."""

from __future__ import annotations

import copy
import itertools
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import memlayout
from memlayout.layout import Format
from memlayout.plan.steer.state import PlannedState, propagated_format, shape_signature
from memlayout.tensors import iter_tensors
from tests.support.formats import TORCH_FORMATS


class Net(nn.Module):
    """A convolution, a batch norm (its result depends on the mode) and a convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.relu(self.bn(self.stem(x))))


def _x(n: int = 2, size: int = 10) -> torch.Tensor:
    return torch.randn(n, 3, size, size)


def _last(t: torch.Tensor) -> torch.Tensor:
    """``t`` laid out channels innermost by torch's own permutes: (N, H, W, C) data seen as
    (N, C, H, W), also where C == 1 (``contiguous(memory_format=...)`` leaves that as it is)."""
    order = (0, *range(2, t.dim()), 1)
    nhwc = t.permute(order).clone(memory_format=torch.contiguous_format)  # fresh strides
    return nhwc.permute(sorted(range(t.dim()), key=order.__getitem__))


def _gray(n: int = 2) -> torch.Tensor:
    return torch.randn(n, 1, 10, 10)


#: one image batch in two memory formats torch's ops read apart: a convolution hands each
#: its result in other strides
FORMATS_DIFFERENT: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "channels last": (lambda: (_x(),), lambda: (_x().to(memory_format=torch.channels_last),)),
    "channels last, rank 5": (lambda: (torch.randn(2, 3, 4, 5, 6),),
                              lambda: (_last(torch.randn(2, 3, 4, 5, 6)),)),
    "C == 1 laid out channels last": (lambda: (_gray(),), lambda: (_last(_gray()),)),
    "H == W == 1 laid out channels last": (
        lambda: (torch.randn(2, 3, 1, 1),),
        lambda: (torch.randn(2, 3, 1, 1).to(memory_format=torch.channels_last),)),
    "a slice of a channels-last batch": (
        lambda: (_x(),), lambda: (_last(torch.randn(2, 3, 10, 20))[..., ::2],)),
}

#: one image batch in two strides torch's ops read as one format: a convolution hands both
#: its result in the same strides
FORMATS_SAME: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "a strided slice": (lambda: (_x(),), lambda: (torch.randn(2, 3, 10, 20)[..., ::2],)),
    "C == 1 converted to channels last (a no-op)": (
        lambda: (_gray(),), lambda: (_gray().contiguous(memory_format=torch.channels_last),)),
    "C == 1, another stride for C": (
        lambda: (_gray(),), lambda: (_gray().as_strided((2, 1, 10, 10), (100, 7, 10, 1)),)),
    "H == W == 1 converted to channels last (a no-op)": (
        lambda: (torch.randn(2, 3, 1, 1),),
        lambda: (torch.randn(2, 3, 1, 1).contiguous(memory_format=torch.channels_last),)),
    "channels last, two slices": (lambda: (_last(_x(size=20))[..., ::2],),
                                  lambda: (_last(_x(size=20))[..., 10:],)),
}

#: calls of one model a plan for the first does not fit: shape_signature tells them apart
DIFFERENT: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "batch": (lambda: (_x(2),), lambda: (_x(3),)),
    "image size": (lambda: (_x(size=10),), lambda: (_x(size=12),)),
    "dtype": (lambda: (_x(),), lambda: (_x().half(),)),
    "device type": (lambda: (_x(),), lambda: (_x().to("meta"),)),
    "one more tensor": (lambda: (_x(),), lambda: (_x(), torch.randn(2, 8))),
    "a tensor in a list": (lambda: ([_x()],), lambda: ([_x(), _x()],)),
    "a keyword tensor's shape": (lambda: ((_x(),), {"mask": torch.ones(2, 10)}),
                                 lambda: ((_x(),), {"mask": torch.ones(2, 12)})),
    **{f"memory format: {name}": pair for name, pair in FORMATS_DIFFERENT.items()},
}

#: calls that differ in what a plan does not depend on: one plan serves both
SAME: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "values": (lambda: (_x(),), lambda: (_x() * 10,)),
    "requires grad": (lambda: (_x(),), lambda: (_x().requires_grad_(),)),
    **{f"strides: {name}": pair for name, pair in FORMATS_SAME.items()},
}


#: arguments of every kind a forward is given
ARGUMENTS: dict[str, Callable[[], Any]] = {
    "one image batch": lambda: (_x(),),
    "image and a flag": lambda: (_x(), True, "mean"),
    "nested": lambda: ([_x(), (torch.randn(4).double(), None)], {"ids": torch.arange(6)}),
    "meta tensors": lambda: (_x().to("meta"), torch.zeros(3, dtype=torch.bfloat16)),
    "no tensors": lambda: (3, "mean"),
}


@pytest.mark.parametrize("make", ARGUMENTS.values(), ids=ARGUMENTS.keys())
def test_a_signature_is_the_shape_dtype_and_device_type_of_each_tensor(
        make: Callable[[], Any]) -> None:
    args = make()
    tensors = list(iter_tensors(args))
    signature = shape_signature(args)
    assert len(signature) == len(tensors)
    for (shape, dtype, device, fmt), t in zip(signature, tensors, strict=True):
        assert shape == tuple(t.shape)
        assert getattr(torch, dtype) is t.dtype
        assert device == t.device.type
        assert fmt == propagated_format(t)
    hash(signature)  # a plan is held under it


@pytest.mark.parametrize(("first", "second"), DIFFERENT.values(), ids=DIFFERENT.keys())
def test_calls_a_plan_does_not_fit_have_different_signatures(
        first: Callable[[], Any], second: Callable[[], Any]) -> None:
    assert shape_signature(first()) != shape_signature(second())


@pytest.mark.parametrize(("first", "second"), SAME.values(), ids=SAME.keys())
def test_calls_one_plan_serves_have_one_signature(
        first: Callable[[], Any], second: Callable[[], Any]) -> None:
    assert shape_signature(first()) == shape_signature(second())


def _convolved(x: torch.Tensor) -> tuple[int, ...]:
    """The strides of a convolution's result on ``x`` (torch's own format propagation; the
    result is larger than ``x``: where ``x`` is 1 x 1, the result's strides still tell)."""
    conv = (nn.Conv2d if x.dim() == 4 else nn.Conv3d)(x.shape[1], 4, 3, padding=2)
    with torch.no_grad():
        return conv(x).stride()


FORMAT_PAIRS = {**{k: (*v, False) for k, v in FORMATS_DIFFERENT.items()},
                **{k: (*v, True) for k, v in FORMATS_SAME.items()}}


@pytest.mark.parametrize(("first", "second", "same"), FORMAT_PAIRS.values(),
                         ids=FORMAT_PAIRS.keys())
def test_two_strides_share_a_signature_where_a_convolution_returns_one_format_for_both(
        first: Callable[[], Any], second: Callable[[], Any], same: bool) -> None:
    (a,), (b,) = first(), second()
    assert (_convolved(a) == _convolved(b)) is same
    assert (shape_signature((a,)) == shape_signature((b,))) is same


def _strided(rank: int) -> list[torch.Tensor]:
    """Every dense layout (each dim order) of every shape of ``rank`` dims with sizes 0 to 2,
    and each with the stride of a size-1 dim set otherwise (0, 1, 5)."""
    found = []
    for shape in itertools.product((0, 1, 2), repeat=rank):
        for order in itertools.permutations(range(rank)):
            dense = torch.empty([shape[d] for d in order]).permute(
                sorted(range(rank), key=order.__getitem__))
            found.append(dense)
            for d in (d for d in range(rank) if shape[d] == 1):
                for stride in (0, 1, 5):
                    strides = list(dense.stride())
                    strides[d] = stride
                    found.append(dense.as_strided(dense.shape, strides))
    return found


@pytest.mark.parametrize("rank", [4, 5])
def test_the_memory_format_of_a_signature_is_the_one_torch_reads_from_the_strides(
        rank: int) -> None:
    if not hasattr(torch.ops.aten, "is_strides_like_format"):
        pytest.skip("this torch has no aten::is_strides_like_format")
    last = TORCH_FORMATS[Format.CHANNELS_LAST if rank == 4 else Format.CHANNELS_LAST_3D]
    tensors = _strided(rank)
    assert len({t.stride() for t in tensors}) > 100
    for t in tensors:
        like = torch.ops.aten.is_strides_like_format(t, last)
        assert propagated_format(t) == (str(last).removeprefix("torch.") if like
                                        else "contiguous"), (t.shape, t.stride())


def test_other_ranks_have_no_memory_format() -> None:
    assert {propagated_format(t) for t in (torch.zeros(2, 3, 4).transpose(1, 2),
                                           torch.zeros(3, 4).t(), torch.zeros(()))} == \
        {"contiguous"}


# ---------------------------------------------------------------- the plan a call runs


class Calls:
    """What a planned model's state was asked to plan, and which plan a call ran (read by a
    pre-hook of a module inside the model while the call is in progress; the last one read:
    planning a new signature runs the model too, before the call's own forward)."""

    def __init__(self, planned: nn.Module) -> None:
        self.model = planned
        self.state: PlannedState = planned.memlayout
        self.planned: list[tuple[bool, Any, Any]] = []  # (training, key, plan's mode)
        self._seen: list[Any] = []
        replanner = self.state.replanner
        assert replanner is not None

        def recording(model: nn.Module, args: Any, kwargs: Any, key: Any) -> Any:
            plan = replanner(model, args, kwargs, key)
            self.planned.append((model.training, key, plan.mode))
            return plan

        self.state.replanner = recording
        planned.bn.register_forward_pre_hook(lambda m, args: self._seen.append(self.state.active))

    def active(self, x: torch.Tensor) -> Any:
        """The key of the plan ``model(x)`` runs."""
        self._seen.clear()
        self.model(x)
        return self._seen[-1]


def _planned(train: bool) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    model, x = Net().train(train), _x()
    planned = memlayout.optimize(copy.deepcopy(model), x, measure=False, cache=False,
                                 train=train)
    assert planned.plan.mode == ("train" if train else "eval")
    return model, planned, x


@pytest.mark.parametrize("planned_in", ["eval", "train"])
def test_a_call_in_the_other_mode_is_planned_in_that_mode(planned_in: str) -> None:
    _, planned, x = _planned(train=planned_in == "train")
    other = "eval" if planned_in == "train" else "train"
    calls = Calls(planned)
    example = calls.state.example
    assert example == shape_signature((x,))

    planned.train(planned_in == "train")
    assert calls.active(x) == example  # the example's own plan
    assert calls.planned == []

    planned.train(other == "train")
    key = calls.active(x)
    assert key != example  # the same shapes, another mode: another plan, made for that mode
    assert [e for e in key if e in example] == list(example)
    assert calls.planned == [(other == "train", key, other)]

    for mode_now, expected in ((planned_in, example), (other, key), (planned_in, example)):
        planned.train(mode_now == "train")
        assert calls.active(x) == expected
    assert len(calls.planned) == 1  # each mode planned once


def test_the_key_of_a_call_differs_by_mode_alone() -> None:
    _, planned, x = _planned(train=False)
    state: PlannedState = planned.memlayout
    in_eval = state.key_for(planned.eval(), (x,), {})
    in_train = state.key_for(planned.train(), (x,), {})
    assert in_eval == state.example and in_train != in_eval
    assert state.key_for(planned.train(), (x,), {}) == in_train  # planned once, then held


def test_a_call_of_another_shape_runs_the_plan_made_for_its_signature() -> None:
    _, planned, x = _planned(train=False)
    calls = Calls(planned)
    bigger = _x(n=3, size=14)
    assert calls.active(bigger) == shape_signature((bigger,))
    assert [key for _, key, _ in calls.planned] == [shape_signature((bigger,))]
    assert calls.active(x) == calls.state.example
    assert calls.active(bigger) == shape_signature((bigger,))
    assert len(calls.planned) == 1


def test_a_call_in_the_other_mode_computes_what_the_original_does_in_that_mode() -> None:
    model, planned, x = _planned(train=False)
    model.train()
    planned.train()
    with torch.no_grad():
        torch.testing.assert_close(planned(x), model(x))  # batch statistics, not running ones
    torch.testing.assert_close(planned.bn.running_mean, model.bn.running_mean)
    torch.testing.assert_close(planned.bn.running_var, model.bn.running_var)


def test_a_call_in_another_memory_format_runs_the_plan_made_for_it() -> None:
    _, planned, x = _planned(train=False)
    calls = Calls(planned)
    last = x.to(memory_format=torch.channels_last)
    assert calls.active(last) == shape_signature((last,)) != calls.state.example
    assert calls.active(x) == calls.state.example
    assert calls.active(_last(x)) == shape_signature((last,))  # one format, one plan
    assert [key for _, key, _ in calls.planned] == [shape_signature((last,))]


#: inputs converted on arrival: to a format asked for, or to the one the plan chose
ARRIVAL: dict[str, dict[str, Any]] = {
    "channels_last asked for": {"input_format": "channels_last"},
    "contiguous asked for": {"input_format": "contiguous"},
    "chosen by the plan": {"input_format": "auto"},
}


@pytest.mark.parametrize("options", ARRIVAL.values(), ids=ARRIVAL.keys())
@pytest.mark.parametrize("example_format", [torch.contiguous_format, torch.channels_last],
                         ids=["contiguous example", "channels-last example"])
def test_a_plan_that_converts_its_inputs_on_arrival_serves_either_format(
        options: dict[str, Any], example_format: torch.memory_format) -> None:
    x = _x().contiguous(memory_format=example_format)
    planned = memlayout.optimize(Net().eval(), x, measure=False, cache=False, **options)
    assert planned.plan.input_format is not None
    calls = Calls(planned)
    for call in (x, x.contiguous(), x.to(memory_format=torch.channels_last), _last(x)):
        assert calls.active(call) == calls.state.example
    assert calls.planned == []


def test_the_plans_held_show_the_examples_and_the_other_modes() -> None:
    _, planned, x = _planned(train=False)
    state: PlannedState = planned.memlayout
    planned.train()(x)
    assert state.replans == 1
    assert {key: plan.mode for key, plan in state.plans.items()} == {
        state.example: "eval", (*state.example, ((), "train", "mode", "")): "train"}
    assert state.plans[state.example] is planned.plan


class _Stub:
    """A plan's stand-in: the mode it was made in, outputs as they come."""

    def __init__(self, mode: str) -> None:
        self.mode, self.output_format = mode, None


@pytest.mark.parametrize("planned_in", ["eval", "train"])
def test_a_signature_names_the_mode_of_a_call_in_the_other_mode(planned_in: str) -> None:
    from memlayout.plan.steer.state import Argument, Mode

    x, conv = _x(), nn.Conv2d(3, 8, 3)
    made: list[Any] = []
    other = "eval" if planned_in == "train" else "train"
    state = PlannedState(plan=_Stub(planned_in), key=shape_signature((x,)), dtype=None,  # type: ignore[arg-type]
                         ranks=(4, 5), input_label=None, outputs=(),
                         replanner=lambda m, a, k, key: made.append(key) or _Stub(other))
    conv.train(planned_in == "train")
    assert state.key_for(conv, (x,), {}) == state.example  # the plan's own mode: its key
    conv.train(other == "train")
    key = state.key_for(conv, (x,), {})
    assert key[-1] == Mode(mode=other) and isinstance(key[-1], Mode)
    assert key[:-1] == state.example and all(isinstance(e, Argument) for e in key[:-1])
    assert made == [key]
    # the record is the tuple it stands for: keys held by earlier pickles still match
    assert Mode(mode=other) == ((), other, "mode", "")
    assert pickle.loads(pickle.dumps(key)) == key
