"""What a planned model's plan is chosen by (``memlayout.plan.steer.state``): the shape, dtype
and device type of every tensor argument, and the model's train/eval mode. A call that
differs in one of them runs a plan made for it; one that differs in anything else (strides,
values, autograd) runs the same plan."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import memlayout
from memlayout.plan.steer.state import PlannedState, shape_signature
from memlayout.tensors import iter_tensors


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
}

#: calls that differ in what a plan does not depend on: one plan serves both
SAME: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "values": (lambda: (_x(),), lambda: (_x() * 10,)),
    "strides": (lambda: (_x(),), lambda: (_x().to(memory_format=torch.channels_last),)),
    "a strided slice": (lambda: (_x(),), lambda: (torch.randn(2, 3, 10, 20)[..., ::2],)),
    "requires grad": (lambda: (_x(),), lambda: (_x().requires_grad_(),)),
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
    for (shape, dtype, device), t in zip(signature, tensors, strict=True):
        assert shape == tuple(t.shape)
        assert getattr(torch, dtype) is t.dtype
        assert device == t.device.type
    hash(signature)  # a plan is held under it


@pytest.mark.parametrize(("first", "second"), DIFFERENT.values(), ids=DIFFERENT.keys())
def test_calls_a_plan_does_not_fit_have_different_signatures(
        first: Callable[[], Any], second: Callable[[], Any]) -> None:
    assert shape_signature(first()) != shape_signature(second())


@pytest.mark.parametrize(("first", "second"), SAME.values(), ids=SAME.keys())
def test_calls_one_plan_serves_have_one_signature(
        first: Callable[[], Any], second: Callable[[], Any]) -> None:
    assert shape_signature(first()) == shape_signature(second())


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
