"""Real third-party models at the sizes their users run them (random weights, nothing
downloaded), as ``memlayout bench`` file specs: each factory returns ``(module, args)`` or
``(module, args, kwargs)``.

Configurations are the libraries' published ones where they fit two CPU cores (the DDPM
CIFAR-10 UNet, Stable Diffusion's VAE, smp's resnet34 encoders, timm's own models); the input
sizes are what those models are trained at, or the smallest common size where that would take
minutes a call here (the VAE at 128 px, a 3-d UNet at 64^3). See docs/real-models.md.

    OMP_WAIT_POLICY=PASSIVE memlayout bench benchmarks/real_models.py:ddpm_unet \\
        --modes nchw,nhwc,nhwc-again,planned --rounds 9 --threads 2
"""

from __future__ import annotations

import torch


def _seeded() -> torch.Generator:
    torch.manual_seed(0)
    return torch.Generator().manual_seed(0)


def ddpm_unet():
    """diffusers ``UNet2DModel``, google/ddpm-cifar10-32's configuration (35.7 M parameters,
    attention at 16x16), batch 4 at 32x32."""
    from diffusers import UNet2DModel

    gen = _seeded()
    model = UNet2DModel(
        sample_size=32, in_channels=3, out_channels=3, layers_per_block=2,
        block_out_channels=(128, 256, 256, 256),
        down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D"))
    return model.eval(), (torch.randn(4, 3, 32, 32, generator=gen), torch.tensor([500]))


def sd_vae():
    """diffusers ``AutoencoderKL``, Stable Diffusion 1.x's VAE configuration (83.7 M
    parameters), one 128x128 image encoded and decoded."""
    from diffusers import AutoencoderKL

    gen = _seeded()
    model = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2,
        block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4)
    return model.eval(), (torch.randn(1, 3, 128, 128, generator=gen),)


def small_sd_unet():
    """diffusers ``UNet2DConditionModel`` with cross-attention on 77 text tokens: Stable
    Diffusion's block structure at a fifth of its widths, 32x32 latents (256 px images),
    batch 2, ``encoder_hidden_states`` as a keyword input."""
    from diffusers import UNet2DConditionModel

    gen = _seeded()
    model = UNet2DConditionModel(
        sample_size=32, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(64, 128, 256, 256),
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        cross_attention_dim=192, attention_head_dim=8)
    return model.eval(), (torch.randn(2, 4, 32, 32, generator=gen), torch.tensor([500])), \
        {"encoder_hidden_states": torch.randn(2, 77, 192, generator=gen)}


def smp_unet():
    """segmentation_models_pytorch ``Unet`` with a resnet34 encoder, 2 images of 256x256."""
    import segmentation_models_pytorch as smp

    gen = _seeded()
    model = smp.Unet("resnet34", encoder_weights=None, classes=5)
    return model.eval(), (torch.randn(2, 3, 256, 256, generator=gen),)


def smp_deeplabv3plus():
    """segmentation_models_pytorch ``DeepLabV3Plus`` with a resnet34 encoder (dilated, output
    stride 16), 2 images of 256x256."""
    import segmentation_models_pytorch as smp

    gen = _seeded()
    model = smp.DeepLabV3Plus("resnet34", encoder_weights=None, classes=5)
    return model.eval(), (torch.randn(2, 3, 256, 256, generator=gen),)


def mobilevitv2():
    """timm ``mobilevitv2_050`` at its own 256x256, batch 8."""
    import timm

    gen = _seeded()
    model = timm.create_model("mobilevitv2_050", pretrained=False)
    return model.eval(), (torch.randn(8, 3, 256, 256, generator=gen),)


def coatnet():
    """timm ``coatnet_nano_rw_224`` at its own 224x224, batch 4."""
    import timm

    gen = _seeded()
    model = timm.create_model("coatnet_nano_rw_224", pretrained=False)
    return model.eval(), (torch.randn(4, 3, 224, 224, generator=gen),)


def monai_unet3d():
    """MONAI 3-d ``UNet`` (the 5-level, 2-residual-unit configuration of MONAI's tutorials),
    one 64^3 single-channel volume."""
    from monai.networks.nets import UNet

    gen = _seeded()
    model = UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(16, 32, 64, 128, 256),
                 strides=(2, 2, 2, 2), num_res_units=2)
    return model.eval(), (torch.randn(1, 1, 64, 64, 64, generator=gen),)


def yolov8n():
    """ultralytics ``DetectionModel`` from its packaged ``yolov8n.yaml`` (80 classes), one
    640x640 image, in eval mode (the detection head's decoded boxes out)."""
    import os
    import tempfile

    # offline and quiet, its settings file in a folder of its own (before its import)
    os.environ.setdefault("YOLO_OFFLINE", "1")
    os.environ.setdefault("YOLO_VERBOSE", "False")
    os.environ.setdefault("YOLO_CONFIG_DIR", tempfile.mkdtemp(prefix="ultralytics-"))
    from ultralytics.nn.tasks import DetectionModel

    gen = _seeded()
    model = DetectionModel("yolov8n.yaml", verbose=False)
    return model.eval(), (torch.randn(1, 3, 640, 640, generator=gen),)


MODELS = ("ddpm_unet", "sd_vae", "small_sd_unet", "smp_unet", "smp_deeplabv3plus",
          "mobilevitv2", "coatnet", "monai_unet3d", "yolov8n")
