"""The coverage table of docs/real-models.md: every real-model family tried, built at a tiny
configuration with random weights (those of tests/models where a test checks it), planned
with the analytical costs (``measure=False``), one markdown row each: how it was captured,
the convolution calls planned of those one forward makes, and the verification.

    PYTHONPATH=src:. OMP_WAIT_POLICY=PASSIVE python benchmarks/real_models_coverage.py [--train] [NAME ...]

``--train`` adds a column: a training step planned and verified the same way. A library not
installed gives a row saying so. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# ultralytics offline and quiet, its settings file in a folder of its own (before its import)
os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("YOLO_VERBOSE", "False")
os.environ.setdefault("YOLO_CONFIG_DIR", tempfile.mkdtemp(prefix="ultralytics-"))

import memlayout  # noqa: E402

#: a model and its example: forward's positional and keyword arguments
Example = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]


def _tests(module: str) -> Any:
    import importlib

    return importlib.import_module(f"tests.models.{module}")


def real(name: str) -> Callable[[], Example]:
    """A model of tests/models/test_real_models.py."""
    return lambda: _tests("test_real_models").MODELS[name]()


def built(module: str, name: str, batch: int = 1) -> Callable[[], Example]:
    """A ``(build, inputs)`` entry of a tests/models module's ``MODELS``."""
    def example() -> Example:
        build, inputs = _tests(module).MODELS[name]
        return build(), inputs(batch), {}
    return example


def yolo(name: str) -> Callable[[], Example]:
    def example() -> Example:
        import ultralytics

        tests = _tests("test_ultralytics")
        return tests.built(ultralytics, name), tests.images(1), {}
    return example


def mask_rcnn() -> Example:
    tests = _tests("test_detection")
    return tests.mask_rcnn(), tests.images(2), {}


def mask2former() -> Example:
    tests = _tests("test_mask2former")
    return tests.mask2former(), tests.images(1), {}


def timm_model(name: str, **kwargs: Any) -> Callable[[], Example]:
    def example() -> Example:
        import timm

        return timm.create_model(name, pretrained=False, num_classes=4, **kwargs), \
            (torch.randn(1, 3, 64, 64),), {}
    return example


def smp_model(arch: str, size: int = 64, batch: int = 1) -> Callable[[], Example]:
    def example() -> Example:
        import segmentation_models_pytorch as smp

        return getattr(smp, arch)("resnet18", encoder_weights=None, classes=2), \
            (torch.randn(batch, 3, size, size),), {}
    return example


def monai_model(build: Callable[[Any], nn.Module], size: int = 16) -> Callable[[], Example]:
    def example() -> Example:
        from monai.networks import nets

        return build(nets), (torch.randn(1, 1, size, size, size),), {}
    return example


def diffusers_model(build: Callable[[Any], tuple[nn.Module, tuple[Any, ...], dict[str, Any]]]
                    ) -> Callable[[], Example]:
    def example() -> Example:
        import diffusers

        return build(diffusers)
    return example


def _no_mid_block(d: Any) -> Example:
    small = _tests("test_real_models").SMALL_CONDITIONED
    return d.UNet2DConditionModel(**small, mid_block_type=None), \
        (torch.randn(1, 4, 8, 8), torch.tensor([10])), \
        {"encoder_hidden_states": torch.randn(1, 3, 16)}


def _controlnet(d: Any) -> Example:
    model = d.ControlNetModel(
        in_channels=4, block_out_channels=(16, 32), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), cross_attention_dim=16,
        norm_num_groups=8, attention_head_dim=8, conditioning_embedding_out_channels=(8, 16))
    return model, (torch.randn(1, 4, 8, 8), torch.tensor([10])), \
        {"encoder_hidden_states": torch.randn(1, 3, 16),
         "controlnet_cond": torch.randn(1, 3, 16, 16)}


def _vq(d: Any) -> Example:
    model = d.VQModel(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                      up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32),
                      layers_per_block=1, latent_channels=4, norm_num_groups=8,
                      num_vq_embeddings=32)
    return model, (torch.randn(1, 3, 16, 16),), {}


def _tiny_autoencoder(d: Any) -> Example:
    model = d.AutoencoderTiny(encoder_block_out_channels=(16, 16, 16, 16),
                              decoder_block_out_channels=(16, 16, 16, 16))
    return model, (torch.randn(1, 3, 32, 32),), {}


def detector(name: str) -> Callable[[], Example]:
    """A torchvision detector with a ResNet-18 FPN backbone (SSDlite: its own MobileNetV3),
    64 px images, few proposals."""
    def example() -> Example:
        from torchvision.models import detection
        from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
        from torchvision.ops.feature_pyramid_network import LastLevelP6P7

        small = dict(min_size=64, max_size=64)
        if name == "ssdlite":
            model = detection.ssdlite320_mobilenet_v3_large(
                weights=None, weights_backbone=None, num_classes=3, detections_per_img=4)
        else:
            returned = [2, 3, 4] if name in ("retinanet", "fcos") else None
            extra = ({"extra_blocks": LastLevelP6P7(256, 256)}
                     if returned else {})
            backbone = resnet_fpn_backbone(backbone_name="resnet18", weights=None,
                                           trainable_layers=5, returned_layers=returned,
                                           **extra)
            cls = {"fasterrcnn": detection.FasterRCNN, "keypointrcnn": detection.KeypointRCNN,
                   "retinanet": detection.RetinaNet, "fcos": detection.FCOS}[name]
            heads = ({"rpn_post_nms_top_n_test": 16, "box_detections_per_img": 4}
                     if name.endswith("rcnn") else {"detections_per_img": 4})
            model = cls(backbone, num_classes=3, **small, **heads)
        size = 320 if name == "ssdlite" else 64
        return model, ([torch.rand(3, size, size), torch.rand(3, size, size * 3 // 4)],), {}
    return example


def video(name: str) -> Callable[[], Example]:
    def example() -> Example:
        import torchvision

        return getattr(torchvision.models.video, name)(num_classes=4), \
            (torch.randn(1, 3, 4, 32, 32),), {}
    return example


#: label -> the model and its example
MODELS: dict[str, tuple[str, Callable[[], Example]]] = {
    "unet2d": ("diffusers `UNet2DModel` (attention blocks)", real("unet2d")),
    "autoencoder_kl": ("diffusers `AutoencoderKL`", real("autoencoder_kl")),
    "unet2d_condition": ("diffusers `UNet2DConditionModel` (cross-attention, keyword input)",
                         real("unet2d_condition")),
    "unet2d_text_time": ("diffusers `UNet2DConditionModel` (`text_time`: a dict input)",
                         real("unet2d_text_time")),
    "unet2d_no_mid": ("diffusers `UNet2DConditionModel` (`mid_block_type=None`)",
                      diffusers_model(_no_mid_block)),
    "unet1d": ("diffusers `UNet1DModel` (1-d, `F.conv1d` in forward)", real("unet1d")),
    "controlnet": ("diffusers `ControlNetModel`", diffusers_model(_controlnet)),
    "vq": ("diffusers `VQModel`", diffusers_model(_vq)),
    "autoencoder_tiny": ("diffusers `AutoencoderTiny`", diffusers_model(_tiny_autoencoder)),
    "smp_unet": ("smp `Unet` (resnet18)", real("smp_unet")),
    "smp_deeplabv3plus": ("smp `DeepLabV3Plus` (resnet18)", real("smp_deeplabv3plus")),
    **{f"smp_{arch.lower()}": (f"smp `{arch}` (resnet18)", smp_model(arch, *size))
       for arch, size in (("FPN", ()), ("UnetPlusPlus", ()), ("MAnet", ()), ("Linknet", ()),
                          ("PSPNet", (64, 2)), ("PAN", (128,)), ("Segformer", ()),
                          ("UPerNet", (64, 2)))},
    "timm_mobilevitv2": ("timm `mobilevitv2_050`", real("timm_mobilevitv2")),
    "timm_coatnet": ("timm `coatnet_nano_rw_224`", real("timm_coatnet")),
    **{f"timm_{name}": (f"timm `{name}`", timm_model(name, **kwargs)) for name, kwargs in (
        ("convnextv2_atto", {}), ("efficientvit_b0", {}), ("efficientvit_m0", {"img_size": 64}),
        ("fastvit_t8", {}), ("levit_128s", {"img_size": 64}),
        ("maxvit_tiny_tf_224", {"img_size": 64}), ("regnetx_002", {}), ("resnet18d", {}),
        ("repvit_m0_9", {}), ("efficientformerv2_s0", {"img_size": 64}),
        ("ghostnetv2_100", {}), ("mobilenetv4_conv_small", {}))},
    "monai_unet3d": ("MONAI `UNet` (3-d)", real("monai_unet3d")),
    "monai_basic_unet3d": ("MONAI `BasicUNet` (3-d)", real("monai_basic_unet3d")),
    "monai_segresnet": ("MONAI `SegResNet` (3-d)", monai_model(
        lambda n: n.SegResNet(spatial_dims=3, in_channels=1, out_channels=2, init_filters=8))),
    "monai_attention_unet": ("MONAI `AttentionUnet` (3-d)", monai_model(
        lambda n: n.AttentionUnet(spatial_dims=3, in_channels=1, out_channels=2,
                                  channels=(8, 16, 32), strides=(2, 2)))),
    "monai_dynunet": ("MONAI `DynUNet` (3-d)", monai_model(
        lambda n: n.DynUNet(spatial_dims=3, in_channels=1, out_channels=2,
                            kernel_size=(3, 3, 3), strides=(1, 2, 2), upsample_kernel_size=(2, 2),
                            filters=(8, 16, 32)))),
    "monai_vnet": ("MONAI `VNet` (3-d)", monai_model(
        lambda n: n.VNet(spatial_dims=3, in_channels=1, out_channels=2))),
    "monai_densenet121": ("MONAI `DenseNet121` (3-d)", monai_model(
        lambda n: n.DenseNet121(spatial_dims=3, in_channels=1, out_channels=2), size=32)),
    "swin_unetr_2d": ("MONAI `SwinUNETR` (2-d)", built("test_swin", "swin_unetr_2d")),
    "swin_unetr_3d": ("MONAI `SwinUNETR` (3-d)", built("test_swin", "swin_unetr_3d")),
    "swin3d": ("torchvision `SwinTransformer3d` (`swin3d_t`'s class)",
               built("test_swin", "swin3d")),
    "swin_v2": ("torchvision Swin V2", built("test_swin", "swin_v2")),
    **{f"video_{name}": (f"torchvision `{name}`", video(name))
       for name in ("r3d_18", "mc3_18", "r2plus1d_18")},
    "mask_rcnn": ("torchvision `MaskRCNN` (resnet18 FPN, a list of 2 images)", mask_rcnn),
    **{name: (f"torchvision `{cls}`{how}", detector(name)) for name, cls, how in (
        ("fasterrcnn", "FasterRCNN", " (resnet18 FPN)"),
        ("keypointrcnn", "KeypointRCNN", " (resnet18 FPN)"),
        ("retinanet", "RetinaNet", " (resnet18 FPN)"), ("fcos", "FCOS", " (resnet18 FPN)"),
        ("ssdlite", "ssdlite320_mobilenet_v3_large", ""))},
    **{f"ultralytics_{name}": (f"ultralytics `{name}`" + (" (the bare `DetectionModel`)"
                                                          if name == "detection_model" else ""),
                               yolo(name))
       for name in ("yolov8n", "yolov8n-seg", "yolov8n-pose", "yolo11n", "detection_model",
                    "rtdetr")},
    **{f"kornia_{name}": (f"kornia {label}", built("test_kornia", name)) for name, label in (
        ("gaussian_blur", "`GaussianBlur2d` before a CNN"),
        ("random_gaussian_blur", "`RandomGaussianBlur` before a CNN"),
        ("spatial_gradient", "`SpatialGradient` inside a CNN"), ("keynet", "`KeyNet`"))},
    "mask2former": ("HF `Mask2FormerForUniversalSegmentation` (Swin backbone)", mask2former),
}


#: models whose training step is planned at batch 2 (the example's image twice): a BatchNorm
#: over a 1x1 map (a classifier's head, a network's deepest stage) needs more than one value
#: per channel in training
TRAIN_AT_BATCH_2 = frozenset({
    "smp_pan", "timm_efficientvit_m0", "timm_levit_128s", "timm_repvit_m0_9",
    "timm_ghostnetv2_100", "timm_mobilenetv4_conv_small", "monai_vnet", "monai_densenet121"})
#: models whose training step takes more than images (torchvision's detectors: targets)
NOT_TRAINED = frozenset({"mask_rcnn", "fasterrcnn", "keypointrcnn", "retinanet", "fcos",
                         "ssdlite"})


def plan_of(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
            train: bool) -> Any:
    """The plan of ``model`` on its example (analytical costs, no cache); the exception that
    stopped it, or ``None``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return memlayout.optimize(model.train(train), args, kwargs=kwargs, measure=False,
                                      cache=False, memory=False, train=train).plan, None
    except Exception as exc:  # a row says why, the table goes on
        return None, exc


def capture_of(plan: Any) -> str:
    parts = "whole" if plan.regions == [""] else f"{len(plan.regions)} parts"
    return f"{' + '.join(plan.coverage.methods)}, {parts}"


def result_of(plan: Any, error: BaseException | None, *, via: str = "") -> str:
    """``49 of 49 (100 %), verified``, or why not."""
    if plan is None:
        return f"fails: {type(error).__name__}: {str(error).strip().splitlines()[0][:160]}"
    c = plan.coverage
    coverage = f"{c.planned} of {c.total} ({100 * c.fraction:.0f} %){via}"
    fell_back = [n for n in plan.notes if "failed verification" in n]
    if not plan.verification.ok:
        return f"{coverage}, not verified"
    if fell_back:
        return f"{coverage}, the plan failed verification; {plan.guard.kept} kept, verified"
    if plan.verification.float64_error is not None:
        return f"{coverage}, verified (float64 re-check)"
    return f"{coverage}, verified"


def doubled(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The example with each image tensor given twice along the batch."""
    return tuple(torch.cat([a, a]) if isinstance(a, torch.Tensor) and a.dim() >= 3 else a
                 for a in args)


def row(name: str, *, train: bool) -> str:
    label, example = MODELS[name]
    try:
        torch.manual_seed(0)
        model, args, kwargs = example()
    except Exception as exc:  # not installed, or the library changed its API
        return f"| {label} | | not built: {type(exc).__name__}: {str(exc).splitlines()[0][:100]} |"
    plan, error = plan_of(model, args, kwargs, train=False)
    cells = [label, capture_of(plan) if plan is not None else "", result_of(plan, error)]
    if train and name in NOT_TRAINED:
        cells.append("takes targets: not tried")
    elif train:
        at_2 = name in TRAIN_AT_BATCH_2
        step, error = plan_of(model, doubled(args) if at_2 else args, kwargs, train=True)
        via = ""
        if step is not None and plan is not None and capture_of(step) != capture_of(plan):
            via = f" via {capture_of(step)}"
        cells.append(result_of(step, error, via=via) + (" (batch 2)" if at_2 else ""))
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", action="store_true", help="also plan a training step")
    parser.add_argument("names", nargs="*", help=f"models to plan (all): {', '.join(MODELS)}")
    args = parser.parse_args(argv)
    names = args.names or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    head = ["model", "capture", "inference"] + (["training step"] if args.train else [])
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    start = time.perf_counter()
    for name in names:
        print(row(name, train=args.train), flush=True)
    print(f"\n{len(names)} models in {time.perf_counter() - start:.0f} s; torch "
          f"{torch.__version__}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
