"""ultralytics YOLO (YOLOv8 detection, segmentation and pose, YOLO11) and RT-DETR, built from
the packaged yaml configurations with random weights, 64 px: planned whole, verified, a drop-in
(the original's outputs on other inputs and batch sizes, its state dict both ways, ``names``,
``stride``, ``yaml``, ``fuse()``), in inference and training, fp32 and bf16.

The ``Detect`` head makes its anchors when the input's shape changes and stores them on itself:
a model never called at the example's size is traced making them (on a throwaway copy, see
``memlayout.plan.capture.trace.throwaway``). ultralytics runs offline here: no update check,
no download, its settings in a temporary folder (``YOLO_OFFLINE``, ``YOLO_CONFIG_DIR``).
Needs the ``models`` extra."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import memlayout
from memlayout.tensors import iter_tensors
from tests.support.real import (
    assert_a_planned_drop_in,
    assert_same_outputs,
    calibrated,
)

SIZE = 64


def yolo(config: str) -> Callable[[Any], nn.Module]:
    """The model ``YOLO(config)`` holds (a ``DetectionModel``, ``SegmentationModel``, ...)."""
    return lambda ultralytics: ultralytics.YOLO(config).model


def detection_model(ultralytics: Any) -> nn.Module:
    """The bare ``DetectionModel``, never called at the example's size."""
    from ultralytics.nn.tasks import DetectionModel

    return DetectionModel("yolov8n.yaml", verbose=False)


def rtdetr(ultralytics: Any) -> nn.Module:
    """RT-DETR-l's packaged yaml at a quarter of its widths and a third of its depths, its
    decoder small: hidden 64, 50 queries, 2 heads, 2 layers, feed-forward 128."""
    from ultralytics.nn.tasks import RTDETRDetectionModel, yaml_model_load

    config = yaml_model_load("rtdetr-l.yaml")
    *head, (sources, repeats, decoder, args) = config["head"]
    assert decoder == "RTDETRDecoder"
    small = [args[0], 64, 50, 4, 2, 2, 128]  # nc, hd, nq, ndp, nh, ndl, d_ffn
    config = {**config, "head": [*head, [sources, repeats, decoder, small]],
              "scales": {"t": [0.33, 0.25, 1024]}, "scale": "t"}
    return RTDETRDetectionModel(config, verbose=False)


MODELS: dict[str, Callable[[Any], nn.Module]] = {
    "yolov8n": yolo("yolov8n.yaml"), "yolov8n-seg": yolo("yolov8n-seg.yaml"),
    "yolov8n-pose": yolo("yolov8n-pose.yaml"), "yolo11n": yolo("yolo11n.yaml"),
    "detection_model": detection_model, "rtdetr": rtdetr}


def images(batch: int) -> tuple[torch.Tensor]:
    return (torch.rand(batch, 3, SIZE, SIZE),)


def built(ultralytics: Any, name: str) -> nn.Module:
    """The model, its batch norms calibrated on random images (``tests.support.real``)."""
    return calibrated(MODELS[name](ultralytics), images(2))


@pytest.mark.parametrize("name", list(MODELS))
def test_a_yolo_model_is_planned_whole_verified_and_a_drop_in(ultralytics: Any,
                                                               name: str) -> None:
    assert_a_planned_drop_in(lambda: built(ultralytics, name), images)


def test_the_planned_yolo_keeps_its_attributes_and_fuses(ultralytics: Any) -> None:
    model = built(ultralytics, "yolov8n").eval()
    x = images(1)
    opt = memlayout.optimize(model, x, measure=False, cache=False, memory=False)
    assert opt.plan.conversions  # a plan that converts somewhere: not the original as it was
    assert opt.names == model.names and opt.yaml == model.yaml
    assert torch.equal(opt.stride, model.stride)
    fused = copy.deepcopy(model).fuse(verbose=False)
    assert opt.fuse(verbose=False) is opt and opt.is_fused()
    with torch.no_grad():
        for xs in (x, images(2)):
            assert_same_outputs(opt(*xs), fused(*xs))


def test_a_yolo_training_step_is_planned_and_verified(ultralytics: Any) -> None:
    model = built(ultralytics, "yolov8n").train()
    reference = copy.deepcopy(model)
    x = images(2)
    opt = memlayout.optimize(model, x, measure=False, cache=False, memory=False, train=True)
    plan = opt.plan
    assert plan.verification.ok and plan.verification.train
    assert plan.coverage.planned >= 0.95 * plan.coverage.total > 0
    xs = images(2)
    got, want = opt(*xs), reference(*xs)
    assert_same_outputs(got, want)
    for out in (got, want):
        sum(t.square().mean() for t in iter_tensors(out)).backward()
    grads = dict(reference.named_parameters())
    trained = 0
    for name, p in opt.named_parameters():
        want = grads[name].grad
        assert (p.grad is None) == (want is None) == (not p.requires_grad), name  # DFL's is fixed
        if want is not None:
            assert p.grad.stride() == p.stride(), name
            torch.testing.assert_close(p.grad, want, rtol=1e-3,
                                       atol=1e-3 * want.abs().max().item())
            trained += 1
    assert trained > 0


def test_a_yolo_model_is_planned_under_bf16_autocast(ultralytics: Any) -> None:
    model = built(ultralytics, "yolov8n").eval()
    x = images(1)
    opt = memlayout.optimize(model, x, dtype="bf16", measure=False, cache=False, memory=False)
    assert opt.plan.verification.ok
    assert opt.plan.coverage.planned == opt.plan.coverage.total > 0
    xs = images(1)
    with torch.no_grad():
        exact = model(*xs)  # float32: what both bf16 runs round away from
        with torch.autocast("cpu", torch.bfloat16):
            want = model(*xs)
        got = opt(*xs)
    # the planned model's bf16 kernels round in another order than eager's: on a new input it
    # is as far from float32 as eager bf16 is (a random-weight head amplifies either's error)
    for g, w, e in zip(iter_tensors(got), iter_tensors(want), iter_tensors(exact), strict=True):
        planned_error = (g.float() - e).norm() / e.norm()
        eager_error = (w.float() - e).norm() / e.norm()
        assert planned_error <= 2 * eager_error + 1e-3, (planned_error, eager_error)
