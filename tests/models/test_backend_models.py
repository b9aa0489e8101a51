"""``torch.compile(model, backend="memlayout")`` on real third-party models at test size (timm,
diffusers, smp, torchvision detection, ultralytics; random weights, nothing downloaded): every
graph Dynamo hands over (graph breaks make several) planned, verified, none dropped, and the
compiled model computes the original's outputs and, in training, its gradients (a detector
trains on targets and returns its losses), within float32's tolerance or, where the model's own
float32 rounding is larger (measured against the model in float64), within twice that.

The planned graphs run eagerly (``inner="eager"``) with the analytical costs: what is checked
is the planning of Dynamo's graphs and the rewrite that runs them, not Inductor (its compile of
each model takes minutes on two cores; ``tests/plan/compilers/test_backend.py`` compiles with
it, and ``memlayout bench --modes compile-memlayout`` times it on the zoo and real models).
Needs the ``models`` extra."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn

import memlayout
from memlayout.plan.compare import float64
from memlayout.tensors import iter_tensors, mean_square_loss
from tests.models import test_detection, test_real_models
from tests.support.real import assert_same_outputs, calibrated, differ, seeded

Example = tuple[nn.Module, tuple[Any, ...]]


def _from_real_models(name: str) -> Callable[[], Example]:
    def build() -> Example:
        model, args, kwargs = test_real_models.MODELS[name]()
        assert not kwargs
        return model, args
    return build


def yolov8n() -> Example:
    """YOLOv8n's packaged configuration at 64 px, its batch norms calibrated (a random YOLO's
    feature maps otherwise fade to nothing: any two would compare equal). Built with the
    ``ultralytics`` fixture active (offline; what its import replaces is put back)."""
    from ultralytics.nn.tasks import DetectionModel

    x = torch.rand(2, 3, 64, 64)
    return calibrated(DetectionModel("yolov8n.yaml", verbose=False), (x,)), (x,)


def mask_rcnn() -> Example:
    """Mask R-CNN (ResNet-18 FPN) on a list of two images of different aspects: Dynamo breaks
    its graph at the data-dependent steps (proposals, NMS, the box and mask heads)."""
    return test_detection.mask_rcnn(), test_detection.images(2)


MODELS: dict[str, Callable[[], Example]] = {
    "timm_mobilevitv2": _from_real_models("timm_mobilevitv2"),
    "diffusers_unet2d": _from_real_models("unet2d"),
    "smp_unet": _from_real_models("smp_unet"),
    "yolov8n": yolov8n,
    "mask_rcnn": mask_rcnn,
}


def _build(name: str, request: pytest.FixtureRequest) -> Example:
    if name == "yolov8n":
        request.getfixturevalue("ultralytics")  # tests/models/conftest.py
    return MODELS[name]()


def _training_args(name: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What a training step passes: a batch of two at least (batch norm in training mode over
    one sample of 2x2 features normalizes each channel to its mean: a pooled head then
    computes its bias, and every gradient is rounding noise); torchvision detection takes
    the targets beside the images (and returns its losses, which the step backpropagates)."""
    if name == "mask_rcnn":
        return (*args, test_detection.targets(*args))
    x, *rest = args
    return (torch.cat([x, torch.randn_like(x)]) if len(x) == 1 else x, *rest)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _compiled(model: nn.Module) -> nn.Module:
    return torch.compile(copy.deepcopy(model), backend=memlayout.backend(
        cache=False, measure=False, inner="eager"))


def _assert_every_graph_planned_and_verified() -> None:
    graphs = memlayout.backend_report().graphs
    planned = [g for g in graphs if g.planned]
    assert planned, memlayout.backend_report().render()
    assert not any(g.fallback for g in graphs), memlayout.backend_report().render()
    assert all(g.verification for g in planned)


@pytest.mark.parametrize("name", list(MODELS))
def test_inference_through_the_backend_computes_the_models_outputs(
        name: str, request: pytest.FixtureRequest) -> None:
    model, args = _build(name, request)
    model.eval()
    compiled = _compiled(model)
    with torch.no_grad():
        assert_same_outputs(seeded(compiled, args), seeded(model, args))
        # other values, same shapes: the graphs are reused, and still compute the model
        other = tuple(torch.rand_like(a) if isinstance(a, torch.Tensor) and a.is_floating_point()
                      else a for a in args) if name != "mask_rcnn" else test_detection.images(2)
        assert differ(seeded(model, other), seeded(model, args))
        assert_same_outputs(seeded(compiled, other), seeded(model, other))
    _assert_every_graph_planned_and_verified()
    if name == "mask_rcnn":  # graph breaks: several graphs, each planned on its own
        assert sum(g.planned for g in memlayout.backend_report().graphs) >= 2


def _step(model: nn.Module, args: tuple[Any, ...]) -> tuple[list[torch.Tensor], list[Any]]:
    """One training step's outputs and parameter gradients (``mean_square_loss``)."""
    out = seeded(model, args)
    loss = mean_square_loss(out)
    assert loss is not None
    loss.backward()
    return ([t.detach() for t in iter_tensors(out)],
            [p.grad for p in model.parameters() if p.requires_grad])


def _distance(want: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    """The largest difference of two lists of tensors, each relative to its reference's
    largest magnitude (1 at least), as ``assert_same_outputs`` scales its tolerance."""
    return max(((g.double() - w.double()).abs().max() / max(1.0, w.abs().max().item())).item()
               for w, g in zip(want, got, strict=True))


@pytest.mark.parametrize("name", list(MODELS))
def test_a_training_step_through_the_backend_has_the_models_gradients(
        name: str, request: pytest.FixtureRequest) -> None:
    model, args = _build(name, request)
    model.train()
    args = _training_args(name, args)
    compiled, wide = _compiled(model), float64(model)
    got_out, got_grads = _step(compiled, args)
    want_out, want_grads = _step(model, args)
    # the same parameters unused (smp's encoder at depth 3 leaves its last stage out)
    assert [g is None for g in got_grads] == [g is None for g in want_grads]
    got_grads, want_grads = ([g for g in grads if g is not None]
                             for grads in (got_grads, want_grads))
    # the tolerance: float32's, or twice the model's own rounding where that is larger (a
    # detector's losses sum over sampled boxes: eager fp32 is ~1e-3 from float64 there)
    exact_out, exact_grads = _step(wide, float64(args))
    own = max(_distance(exact_out, want_out),
              _distance([g for g in exact_grads if g is not None], want_grads))
    tol = max(1e-3, 2 * own)
    assert_same_outputs(got_out, want_out, rtol=tol, atol=max(1e-4, tol))
    # the gradients in units of the step's largest: a layer's far below it is rounding
    scale = max(g.abs().max().item() for g in want_grads)
    assert_same_outputs([g / scale for g in got_grads], [g / scale for g in want_grads],
                        rtol=tol, atol=max(1e-4, tol))
    # the running statistics moved alike
    for (key, mine), theirs in zip(compiled.state_dict().items(), model.state_dict().values(),
                                   strict=True):
        if mine.is_floating_point():
            torch.testing.assert_close(mine, theirs, rtol=1e-3, atol=1e-4, msg=key)
    _assert_every_graph_planned_and_verified()
    trained = [g for g in memlayout.backend_report().graphs if g.planned and g.train]
    assert len(trained) >= (2 if name == "mask_rcnn" else 1)  # its backbone and RPN head
