"""What a real third-party model is checked for once planned: whole (the convolution calls
planned, against a count made where Python makes them), verified, the same outputs as the
original on other inputs and at another batch size, and a state dict that loads both ways."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import memlayout
from memlayout.tensors import iter_tensors
from tests.support.counting import conv_calls

#: random inputs of a model at a batch size: forward's positional arguments
Inputs = Callable[[int], tuple[Any, ...]]


def assert_same_outputs(got: Any, want: Any, *, rtol: float = 1e-3, atol: float = 1e-4) -> None:
    """Every output tensor equal within ``rtol`` and ``atol`` relative to the largest
    magnitude of its reference (as verification compares: a detector's box coordinates are
    pixels, its scores probabilities; another kernel's rounding scales with the values)."""
    got, want = list(iter_tensors(got)), list(iter_tensors(want))
    assert len(got) == len(want) and got
    for g, w in zip(got, want, strict=True):
        scale = max(1.0, w.detach().abs().max().item()) if w.is_floating_point() and w.numel() else 1.0
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol * scale)


def differ(a: Any, b: Any) -> bool:
    """Whether two outputs differ anywhere (another model's weights: the check can fail)."""
    pairs = list(zip(iter_tensors(a), iter_tensors(b), strict=True))
    return any(x.shape != y.shape or not torch.allclose(x, y, rtol=1e-3, atol=1e-4)
               for x, y in pairs)


def assert_a_planned_drop_in(build: Callable[[], nn.Module], inputs: Inputs, *,
                             batch: int = 1, other_batch: int = 2,
                             **options: Any) -> tuple[nn.Module, nn.Module]:
    """Plan ``build()`` (eval mode) on ``inputs(batch)`` and check it: planned whole (>= 95 %
    of the convolution calls), verified, the original's outputs on a second random input and
    at ``other_batch`` (planned on first sight), and the state dict of a second model
    (other random weights) loaded into the planned one, and the planned one's into the
    original. Returns ``(original, planned)``."""
    model = build().eval()
    args = inputs(batch)
    opt = memlayout.optimize(model, args, measure=False, cache=False, memory=False, **options)
    coverage = opt.plan.coverage
    assert coverage.total == conv_calls(model, *args) > 0
    assert coverage.planned >= 0.95 * coverage.total, coverage.text()
    assert opt.plan.verification.ok, opt.plan.verification
    assert type(opt) is type(model) and list(opt.state_dict()) == list(model.state_dict())
    with torch.no_grad():
        for xs in (args, inputs(batch), inputs(other_batch)):
            assert_same_outputs(seeded(opt, xs), seeded(model, xs))
    plans = opt.memlayout.plans  # the example's, and the other batch size's
    assert len(plans) == 2 and all(p.verification.ok for p in plans.values())
    fresh = build().eval()
    xs = inputs(batch)
    with torch.no_grad():
        assert differ(seeded(opt, xs), seeded(fresh, xs))
        opt.load_state_dict(fresh.state_dict())
        model.load_state_dict(opt.state_dict())
        assert_same_outputs(seeded(opt, xs), seeded(fresh, xs))
        assert_same_outputs(seeded(model, xs), seeded(fresh, xs))
    return model, opt


def seeded(model: nn.Module, args: tuple[Any, ...]) -> Any:
    """``model(*args)`` from one RNG state (a random augmentation draws the same parameters
    in both models), the caller's RNG kept."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return model(*args)


def calibrated(model: nn.Module, args: tuple[Any, ...]) -> nn.Module:
    """``model`` with its batch norms' running statistics those of one forward on ``args`` in
    train mode. Random weights then keep their activations' scale through a deep network;
    uncalibrated, a random YOLO's feature maps fade to 1e-9 by its last stage, and any two
    random models compute nearly the same (a comparison of them could not fail)."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average: after one batch, that batch's statistics
    training = model.training
    with torch.no_grad():
        model.train()(*args)
    for m, momentum in zip(norms, momenta, strict=True):
        m.momentum = momentum
    return model.train(training)


def installed(module: str, reason: str) -> Any:
    """The library, or the test skipped saying it is not installed (an optional extra)."""
    return pytest.importorskip(module, reason=f"{module} is not installed ({reason})")
