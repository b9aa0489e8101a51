"""torchvision's Mask R-CNN through the Python API, as a user calls it (a list of images of
different sizes), with a ResNet-18 FPN backbone, 64 px images and few proposals, random
weights: planned whole (the backbone, the RPN head, which takes a list of feature maps, and
the mask head, each captured where the whole model is not), verified, a drop-in; and a plan
that fails verification gives way to the model run in one format, with a warning saying why."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import memlayout
from tests.support.planted import corrupt_the_plan_at
from tests.support.real import assert_a_planned_drop_in, assert_same_outputs, seeded

SIZE = 64


def mask_rcnn() -> nn.Module:
    detection = pytest.importorskip("torchvision.models.detection")
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone

    backbone = resnet_fpn_backbone(backbone_name="resnet18", weights=None, trainable_layers=5)
    return detection.MaskRCNN(backbone, num_classes=3, min_size=SIZE, max_size=SIZE,
                              rpn_pre_nms_top_n_test=64, rpn_post_nms_top_n_test=16,
                              box_detections_per_img=4, box_score_thresh=0.0)


def images(batch: int) -> tuple[list[torch.Tensor]]:
    """``batch`` images, every other one of another aspect (the model batches them padded)."""
    return ([torch.rand(3, SIZE, SIZE * 3 // 4 if i % 2 else SIZE) for i in range(batch)],)


def targets(images: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """What a training step takes beside ``images``: two objects in each image (a box a third
    of its size, its class, its mask), at places drawn from a fixed seed."""
    draw = torch.Generator().manual_seed(1)
    out = []
    for image in images:
        h, w = image.shape[1:]
        corner = torch.rand(2, 2, generator=draw) * torch.tensor([w / 2, h / 2])
        boxes = torch.cat([corner, corner + torch.tensor([w / 3, h / 3])], dim=1)
        masks = torch.zeros(2, h, w, dtype=torch.uint8)
        for mask, (x0, y0, x1, y1) in zip(masks, boxes.int().tolist(), strict=True):
            mask[y0:y1, x0:x1] = 1
        out.append({"boxes": boxes, "labels": torch.tensor([1, 2]), "masks": masks})
    return out


def test_mask_rcnn_is_planned_whole_verified_and_a_drop_in() -> None:
    _, opt = assert_a_planned_drop_in(mask_rcnn, images, batch=2, other_batch=1)
    plan = opt.plan
    assert "rpn.head" in plan.regions  # a part called with a list, captured alone
    assert not plan.notes  # the plan itself, no fallback


def test_a_mask_rcnn_plan_that_fails_verification_gives_way_to_one_format(monkeypatch) -> None:
    corrupt_the_plan_at(monkeypatch, "roi_heads.mask_predictor",
                        lambda out: pytree.tree_map(lambda t: t * 1.5, out))
    model, x = mask_rcnn().eval(), images(2)
    with pytest.warns(UserWarning, match="failed verification"):
        opt = memlayout.optimize(model, x, measure=False, cache=False, memory=False)
    plan = opt.plan
    assert plan.verification.ok and plan.guard.kept in ("all_channels_last", "all_contiguous")
    assert len(plan.notes) == 1 and "failed verification" in plan.notes[0]
    with torch.no_grad():
        for xs in (x, images(2)):
            assert_same_outputs(seeded(opt, xs), seeded(model, xs))
