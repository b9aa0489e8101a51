"""Hugging Face Mask2Former (a Swin backbone, a multi-scale deformable-attention pixel
decoder, a masked-attention transformer decoder) from a tiny configuration with random
weights: planned whole, verified, a drop-in. Needs transformers; nothing is downloaded."""

from __future__ import annotations

import torch
from torch import nn

from tests.support.real import assert_a_planned_drop_in, installed

SIZE = 64


def mask2former() -> nn.Module:
    hf = installed("transformers", "pip install transformers")
    backbone = hf.SwinConfig(image_size=SIZE, embed_dim=16, depths=[1, 1, 1, 1],
                             num_heads=[1, 1, 1, 1], window_size=4,
                             out_features=["stage1", "stage2", "stage3", "stage4"])
    config = hf.Mask2FormerConfig(
        backbone_config=backbone, use_pretrained_backbone=False, feature_size=32,
        mask_feature_size=32, hidden_dim=32, encoder_layers=1, decoder_layers=2,
        num_queries=8, encoder_feedforward_dim=64, dim_feedforward=64, num_attention_heads=2,
        num_labels=3)
    return hf.Mask2FormerForUniversalSegmentation(config)


def images(batch: int) -> tuple[torch.Tensor]:
    return (torch.rand(batch, 3, SIZE, SIZE),)


def test_mask2former_is_planned_whole_verified_and_a_drop_in() -> None:
    assert_a_planned_drop_in(mask2former, images)
