"""A planned model that is, or holds, a ``torch.fx.GraphModule`` saves, loads and copies with
its plan and steering, and computes what the original does.

The models are written under ``from __future__ import annotations``: their traced code has a
``str`` global (the annotation ``torch.Tensor``), which torch 2.10 to 2.12 cannot pickle in
a GraphModule of its own."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable

import pytest
import torch
from torch import fx, nn

import memlayout
from memlayout import Format, format_of
from memlayout.plan.steer.state import PlannedState


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x))) + x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.block = Block(16)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(x)).mean((2, 3)))


class Outer(nn.Module):
    """A plain model around a traced one."""

    def __init__(self) -> None:
        super().__init__()
        self.body = fx.symbolic_trace(Net())
        self.scale = nn.Parameter(torch.ones(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


MODELS: dict[str, Callable[[], nn.Module]] = {
    "traced model": lambda: fx.symbolic_trace(Net()),
    "traced child": Outer,
}


def _graph_modules(model: nn.Module) -> list[fx.GraphModule]:
    return [m for m in model.modules() if isinstance(m, fx.GraphModule)]


def _steered(model: nn.Module) -> set[str]:
    return {p for p, m in model.named_modules() if "forward" in m.__dict__}


@pytest.mark.parametrize("make", MODELS.values(), ids=MODELS.keys())
def test_a_planned_graph_module_saves_loads_and_copies(make: Callable[[], nn.Module]) -> None:
    torch.manual_seed(0)
    model, x = make().eval(), torch.randn(2, 3, 12, 12)
    # what makes torch's own pickling fail before 2.14: a forward-reference annotation
    assert any(isinstance(v, str) for gm in _graph_modules(model)
               for v in gm.recompile().globals.values())
    planned = memlayout.optimize(model, x, measure=False, cache=False)
    stem = "stem" if isinstance(model, fx.GraphModule) else "body.stem"
    assert format_of(planned.get_submodule(stem).weight) is Format.CHANNELS_LAST  # a real plan
    buf = io.BytesIO()
    torch.save(planned, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    with torch.no_grad():
        want = model(x)
        for other in (loaded, copy.deepcopy(planned)):
            assert isinstance(other.memlayout, PlannedState) and other.plan == planned.plan
            assert _steered(other) == _steered(planned) and "" in _steered(other)
            assert format_of(other.get_submodule(stem).weight) is Format.CHANNELS_LAST
            torch.testing.assert_close(other(x), want, rtol=1e-4, atol=1e-5)
            assert other(x).stride() == want.stride()
