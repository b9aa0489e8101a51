"""Verification of a model whose inputs are inside a container (a detector takes a list of
images): the float64 re-check and the search for the first divergent module run on float64
copies of those inputs too, not on the float32 images beside float64 weights."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from memlayout.errors import LayoutVerificationError
from memlayout.plan.check.semantics import module_state
from memlayout.plan.check.verification import verify_model
from memlayout.plan.pipeline import optimize
from tests.support.planted import corrupt_the_plan_at


class Images(nn.Module):
    """As torchvision's detectors: its input a list of images (two batches here, indexed:
    torch.fx traces it, and the analytical costs put its convolution modules
    channels-last)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(8, 4, 3, padding=1))

    def forward(self, images: list[torch.Tensor]) -> torch.Tensor:
        return self.body(torch.cat([images[0], images[1]]))


def _images() -> tuple[list[torch.Tensor]]:
    return ([torch.randn(1, 3, 8, 8), torch.randn(2, 3, 8, 8)],)


def test_a_rounding_level_mismatch_on_a_list_of_images_passes_through_float64(
        monkeypatch) -> None:
    from memlayout.plan import compare as v

    monkeypatch.setitem(v.TOLERANCE, torch.float32, (1e-9, 1e-12))
    # a difference of rounding only, stated: on some CPUs the two layouts' convolutions
    # agree to the bit, and a float32 round trip through 1.0 loses what float64 keeps
    corrupt_the_plan_at(monkeypatch, "body", lambda out: (out + 1.0) - 1.0)
    opt = optimize(Images().eval(), _images(), measure=False, cache=False, memory=False,
                   output_format=None)
    record = opt.plan.verification
    assert opt.plan.guard is None and not opt.plan.notes  # the plan itself, no fallback
    assert record.max_error > 1e-9
    assert record.float64_error is not None and record.float64_error <= 1e-9
    assert record.check == "float64 re-check"


def test_a_wrong_plan_on_a_list_of_images_names_the_module(monkeypatch) -> None:
    corrupt_the_plan_at(monkeypatch, "body", lambda out: out * 1.5)
    with pytest.raises(LayoutVerificationError,
                       match="first module whose output differs: body") as err:
        optimize(Images().eval(), _images(), measure=False, cache=False, memory=False,
                 output_format=None, fallback=False)
    assert err.value.node == "body (Sequential)"


def test_verification_calls_each_model_twice() -> None:
    """The original and the planned model are each called twice from the caller's state (the
    second call finds a forward that changes with each call); the planned model's first call
    is the output check as well, not a call of its own."""
    calls: dict[int, int] = {}

    class Counted(Images):
        def forward(self, images: list[torch.Tensor]) -> torch.Tensor:
            calls[id(self)] = calls.get(id(self), 0) + 1
            return super().forward(images)

    reference = Counted().eval()
    planned = copy.deepcopy(reference)
    record = verify_model(reference, planned, _images(), dtype=None, device=torch.device("cpu"),
                          train=False, state=module_state(reference))
    assert record.ok
    assert calls == {id(reference): 2, id(planned): 2}


@pytest.mark.parametrize("train", [False, True])
def test_a_plan_exact_in_float64_but_coarse_in_its_dtype_is_not_rounding(train) -> None:
    """A planned model whose body rounds its output to whole numbers in float32
    (``(out + 2**23) - 2**23``: exact in float64, so the float64 copies agree) is half a unit
    from the float64 result, where the original's own float32 run is within 1e-6 of it: a
    kernel that computes something else in the run dtype, not rounding. Verification fails,
    inference and training; the same planned model with the original's float32 run as coarse
    (the original rounds to halves itself) passes on the float64 re-check."""
    from memlayout.plan.check.training import verify_training

    def rounding(step: float):
        return lambda module, args, out: (out + step) - step

    reference = Images().train(train)
    planned = copy.deepcopy(reference)
    planned.body.register_forward_hook(rounding(2.0 ** 23))
    device = torch.device("cpu")

    def verify(ref: nn.Module) -> None:
        if train:
            verify_training(ref, planned, _images(), dtype=None, device=device)
        else:
            verify_model(ref, planned, _images(), dtype=None, device=device, train=False,
                         state=module_state(ref))
    with pytest.raises(LayoutVerificationError, match="farther"):
        verify(reference)
    reference.body.register_forward_hook(rounding(2.0 ** 22))  # its own run rounds to halves
    verify(reference)
