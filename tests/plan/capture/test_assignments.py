"""A forward that assigns attributes as it runs (what it computes for a new input shape, a value
set on first use): tracing runs that Python on Proxies or fake tensors, and what it assigns must
stay on a throwaway copy. The model that capture runs eagerly, and the one that is verified and
returned, hold only what their own calls assigned."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import memlayout
from memlayout.plan.capture.regions import capture


class Grid(nn.Module):
    """As an ultralytics ``Detect`` head: a grid made when the input's shape changes and kept
    on the module for the next call of that shape, its first value a class attribute.
    torch.fx cannot branch on the shape (a Proxy); torch.export can, and leaves the grid it
    traced (a fake tensor) on the module: it restores the attributes a module's ``__dict__``
    held, not those it did not."""

    shape: torch.Size | None = None
    grid = torch.empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shape != x.shape:
            h, w = x.shape[-2:]
            self.grid = torch.arange(h * w, dtype=x.dtype).view(1, 1, h, w) / (h * w)
            self.shape = x.shape
        return x * self.grid


class Anchored(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = Grid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x))


class LazyScale(nn.Module):
    """A value set on the first call: torch.fx traces the assignment of a Proxy to it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.scale = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            self.scale = x.shape[-1] ** -0.5
        return self.conv(x) * self.scale


CASES = {"export": (Anchored, "torch.export"), "fx": (LazyScale, "torch.fx")}


def own_attributes(model: nn.Module) -> dict[str, object]:
    """Every module's attributes (not its parameters, buffers or children), by path."""
    return {f"{path}:{k}": v for path, m in model.named_modules()
            for k, v in vars(m).items() if not k.startswith("_")}


def traced(attributes: dict[str, object]) -> list[str]:
    return [k for k, v in attributes.items() if isinstance(v, (FakeTensor, torch.fx.Proxy))]


@pytest.mark.parametrize("case", list(CASES))
def test_capture_traces_a_copy_and_runs_the_model_as_it_was(case: str) -> None:
    cls, method = CASES[case]
    model, x = cls().eval(), torch.randn(2, 3, 8, 8)
    captured = capture(model, (x,))
    assert captured.coverage.methods == (method,)
    assert captured.coverage.planned == captured.coverage.total == 1
    # the model holds what its own call assigned, and the graph was checked against that call
    called = _fresh(cls, model)
    with torch.no_grad():
        torch.testing.assert_close(captured.output, called(x))
    assert not traced(own_attributes(model))
    assert own_attributes(model).keys() == own_attributes(called).keys()


def _fresh(cls: type[nn.Module], like: nn.Module) -> nn.Module:
    fresh = cls().eval()
    fresh.load_state_dict(like.state_dict())
    return fresh


@pytest.mark.parametrize("case", list(CASES))
def test_a_model_that_assigns_attributes_in_forward_plans_verifies_and_runs(case: str) -> None:
    cls, method = CASES[case]
    model, x = cls().eval(), torch.randn(2, 3, 8, 8)
    reference = copy.deepcopy(model)
    before = own_attributes(model)
    opt = memlayout.optimize(model, x, measure=False, cache=False, memory=False)
    assert opt.plan.verification.ok and opt.plan.coverage.methods == (method,)
    assert own_attributes(model) == before  # the caller's model: never called
    assert not traced(own_attributes(opt))
    with torch.no_grad():  # another input, another batch size, another image size
        for other in (torch.randn(2, 3, 8, 8), torch.randn(3, 3, 8, 8), torch.randn(1, 3, 6, 10)):
            torch.testing.assert_close(opt(other), reference(other), rtol=1e-4, atol=1e-5)
    assert not traced(own_attributes(opt))
