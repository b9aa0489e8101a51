"""Swin transformers, whose shifted-window attention makes tensors in ``forward`` (masks,
relative positions) that ``torch.export`` lifts as constants of the graph: MONAI's
``SwinUNETR`` in 2-d and 3-d, torchvision's ``SwinTransformer3d`` (``swin3d_t``'s class) and
Swin V2, at tiny widths and depths with random weights: planned whole, verified, a drop-in.

Needs the ``models`` extra (MONAI's Swin needs ``einops``)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch
from torch import nn

from tests.support.real import Inputs, assert_a_planned_drop_in, installed


def swin_unetr(spatial_dims: int) -> nn.Module:
    installed("einops", "the models extra: MONAI's SwinUNETR needs it")
    nets = installed("monai.networks.nets", "the models extra: pip install monai")
    # a shifted block in the first stage: its attention mask is made in forward
    return nets.SwinUNETR(in_channels=1, out_channels=2, feature_size=12,
                          spatial_dims=spatial_dims, depths=(2, 1, 1, 1),
                          num_heads=(1, 1, 1, 1))


def swin3d() -> nn.Module:
    video = installed("torchvision.models.video.swin_transformer", "torchvision")
    return video.SwinTransformer3d(patch_size=[2, 4, 4], embed_dim=16, depths=[2, 1],
                                   num_heads=[1, 1], window_size=[2, 4, 4], num_classes=4)


def swin_v2() -> nn.Module:
    swin = installed("torchvision.models.swin_transformer", "torchvision")
    return swin.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 1],
                                num_heads=[1, 1], window_size=[4, 4], num_classes=4,
                                block=swin.SwinTransformerBlockV2,
                                downsample_layer=swin.PatchMergingV2)


def images(*size: int) -> Inputs:
    return lambda batch: (torch.randn(batch, *size),)


#: (the model, its inputs at a batch size). SwinUNETR halves its input five times and
#: instance-normalizes the smallest map, which needs more than one element: 64 px
MODELS: dict[str, tuple[Callable[[], nn.Module], Inputs]] = {
    "swin_unetr_2d": (partial(swin_unetr, 2), images(1, 64, 64)),
    "swin_unetr_3d": (partial(swin_unetr, 3), images(1, 64, 32, 32)),
    "swin3d": (swin3d, images(3, 4, 32, 32)),
    "swin_v2": (swin_v2, images(3, 32, 32)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_a_swin_model_is_planned_whole_verified_and_a_drop_in(name: str) -> None:
    build, inputs = MODELS[name]
    model, opt = assert_a_planned_drop_in(build, inputs)
    # the constants export lifts out of forward (a shifted window's mask) stay on the graph
    # analysis traced: the planned model, the original's own tree, gains none of them
    assert not any(k.startswith("lifted_tensor") for m in opt.modules() for k in vars(m))
    assert [k for k, _ in opt.named_buffers()] == [k for k, _ in model.named_buffers()]
