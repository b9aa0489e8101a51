"""Model specs -> ``nn.Module`` + example input. The one model-spec parser (L1).

Specs:

- ``torchvision:NAME``: any ``torchvision.models.list_models()`` name, built with
  ``weights=None`` (and ``weights_backbone=None``): nothing is downloaded. Classification and
  segmentation models take ``(N, 3, S, S)``; video models ``(N, 3, T, S, S)``; for detection
  models the spec builds the detector's feature backbone (``model.backbone``, e.g. ResNet + FPN),
  the layout-relevant part, which takes ``(N, 3, S, S)`` and returns a dict of feature maps.
- ``path/to/file.py:factory``: ``factory()`` returns ``(module, args)`` or ``(module, args,
  kwargs)`` (``args``: one tensor or a tuple of forward's positional arguments; ``kwargs``: its
  keyword inputs, e.g. a diffusers UNet's ``encoder_hidden_states``), used as given
  (``--batch`` / ``--image-size`` do not apply: ``ModelSpec.note`` says so). A module alone
  gets an invented ``(N, 3, S, S)`` input unless its first convolution says otherwise (a
  ``Conv3d``, a ``Conv2d`` with 1 input channel): such a model must bring its input.
- ``timm:NAME`` when timm is installed (``pretrained=False``).

>>> spec = load_model("torchvision:resnet18", batch=2, image_size=64)
>>> type(spec.module).__name__, tuple(spec.example_input.shape), spec.kind
('ResNet', (2, 3, 64, 64), 'classification')
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memlayout.errors import ModelSpecError
from memlayout.layout import Format
from memlayout.tensors import iter_tensors, meta_weights

# Defaults per kind: (image size, channels-last format of the model's activations).
_DEFAULT_SIZE = {"classification": 224, "segmentation": 224, "detection": 224, "video": 112,
                 "custom": 224, "timm": 224}
VIDEO_FRAMES = 8
# Models whose own input size is not their kind's: inception_v3's auxiliary classifier (run in
# training) needs 299x299 (at 224 its 5x5 convolution sees a 3x3 map and fails).
_NATIVE_SIZE = {"inception_v3": 299}


@dataclass
class ModelSpec:
    """A built model: the module (eval mode), an example input, and what kind of model it is.

    ``fmt`` is the channels-last format that fits its activations (rank 4 or rank 5).
    """

    spec: str
    module: nn.Module
    example_input: Any
    kind: str
    fmt: Format
    example_kwargs: dict[str, Any] = field(default_factory=dict)  # forward's keyword inputs
    note: str = ""  # how the example input was made, when flags did not make it

    @property
    def name(self) -> str:
        return self.spec.split(":", 1)[-1]


def load_model(spec: str, *, batch: int = 8, image_size: int | None = None,
               seed: int = 0) -> ModelSpec:
    """Build the model a spec names, with a random example input (seeded).

    Raises ``ModelSpecError`` for an unknown or unbuildable spec, listing close matches.
    """
    if batch < 1:
        raise ModelSpecError(f"batch must be >= 1, got {batch}")
    if image_size is not None and image_size < 1:
        raise ModelSpecError(f"image size must be >= 1, got {image_size}")
    source, sep, name = spec.partition(":")
    if not sep or not name:
        raise ModelSpecError(
            f"model spec {spec!r} is not SOURCE:NAME; use torchvision:NAME, timm:NAME "
            "or path/to/file.py:factory"
        )
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if source == "torchvision":
            return _torchvision(spec, name, batch, image_size, generator)
        if source == "timm":
            return _timm(spec, name, batch, image_size, generator)
        if source.endswith(".py"):
            return _file(spec, Path(source), name, batch, image_size, generator)
    raise ModelSpecError(
        f"unknown model source {source!r} in {spec!r}; use torchvision:NAME, timm:NAME "
        "or path/to/file.py:factory"
    )


def torchvision_kind(name: str) -> str | None:
    """``classification``, ``segmentation``, ``detection``, ``video``, ``optical_flow``,
    ``quantization``, or ``None`` for a name torchvision does not know."""
    import torchvision.models as tvm  # seconds to import; only torchvision specs need it

    for kind, module in (("segmentation", tvm.segmentation), ("detection", tvm.detection),
                         ("video", tvm.video), ("optical_flow", tvm.optical_flow),
                         ("quantization", tvm.quantization)):
        if name in tvm.list_models(module=module):
            return kind
    return "classification" if name in tvm.list_models() else None


def _torchvision(spec: str, name: str, batch: int, image_size: int | None,
                 generator: torch.Generator) -> ModelSpec:
    import torchvision.models as tvm

    kind = torchvision_kind(name)
    if kind is None:
        raise ModelSpecError(_unknown(spec, name, tvm.list_models(), "torchvision:"))
    if kind in ("optical_flow", "quantization"):
        raise ModelSpecError(
            f"{spec!r} is a torchvision {kind} model, which memlayout does not build; "
            "use a classification, segmentation, detection or video model"
        )
    builder = tvm.get_model_builder(name)
    kwargs: dict[str, Any] = {"weights": None}
    if "weights_backbone" in inspect.signature(builder).parameters:
        kwargs["weights_backbone"] = None
    if name in ("inception_v3", "googlenet"):
        kwargs["init_weights"] = True  # silences the "default init will change" warning
    try:
        module = builder(**kwargs)
    except Exception as exc:  # a torchvision builder failing is a spec problem to the user
        raise ModelSpecError(f"building {spec!r} failed: {exc}") from exc
    fmt = Format.CHANNELS_LAST
    if kind == "detection":
        module = module.backbone
    size = image_size or _NATIVE_SIZE.get(name) or _DEFAULT_SIZE[kind]
    if kind == "video":
        fmt = Format.CHANNELS_LAST_3D
        example = torch.randn(batch, 3, VIDEO_FRAMES, size, size, generator=generator)
    else:
        example = torch.randn(batch, 3, size, size, generator=generator)
    return ModelSpec(spec, module.eval(), example, kind, fmt)


def _timm(spec: str, name: str, batch: int, image_size: int | None,
          generator: torch.Generator) -> ModelSpec:
    try:
        import timm
    except ImportError as exc:
        raise ModelSpecError(f"{spec!r} needs timm, which is not installed (pip install timm)") from exc
    known = timm.list_models()
    if name not in known:
        raise ModelSpecError(_unknown(spec, name, known, "timm:"))
    module = timm.create_model(name, pretrained=False)
    channels, height, width = module.default_cfg.get("input_size", (3, 224, 224))
    if image_size:
        height = width = image_size
    example = torch.randn(batch, channels, height, width, generator=generator)
    return ModelSpec(spec, module.eval(), example, "timm", Format.CHANNELS_LAST)


def _file(spec: str, path: Path, factory: str, batch: int, image_size: int | None,
          generator: torch.Generator) -> ModelSpec:
    if not path.is_file():
        raise ModelSpecError(f"model file {str(path)!r} in {spec!r} does not exist")
    mod_name = f"memlayout_user_{abs(hash(str(path.resolve())))}"
    loader = importlib.util.spec_from_file_location(mod_name, path)
    if loader is None or loader.loader is None:
        raise ModelSpecError(f"cannot import {str(path)!r} as Python")
    user = importlib.util.module_from_spec(loader)
    sys.modules[mod_name] = user
    try:
        loader.loader.exec_module(user)
    except Exception as exc:
        raise ModelSpecError(f"importing {str(path)!r} failed: {exc}") from exc
    fn = getattr(user, factory, None)
    if not callable(fn):
        names = [n for n, v in vars(user).items() if callable(v) and not n.startswith("_")]
        raise ModelSpecError(_unknown(spec, factory, names, f"{path}:"))
    try:
        made = fn()
    except Exception as exc:  # the user's code: one message naming file, factory, exception
        raise ModelSpecError(
            f"{spec!r}: {factory}() in {str(path)!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    module, args, kwargs = made, None, {}
    if isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], nn.Module):
        module, args = made[0], made[1]
        kwargs = made[2] if len(made) == 3 else {}
        if not isinstance(kwargs, dict):
            raise ModelSpecError(f"{spec!r}: {factory}() returned kwargs of type "
                                 f"{type(kwargs).__name__}; expected a dict of keyword inputs")
    if not isinstance(module, nn.Module):
        raise ModelSpecError(
            f"{spec!r}: {factory}() returned {type(made).__name__}; expected an nn.Module, "
            "(nn.Module, args) or (nn.Module, args, kwargs)"
        )
    _check_values(spec, factory, module, args, kwargs)
    note = ""
    if args is None:
        args = _invented_input(spec, factory, module, batch, image_size, generator)
        note = (f"input invented for a 2-d image model: {tuple(args.shape)}; return "
                f"(module, args) from {factory}() for another")
    else:
        note = (f"the example input is {factory}()'s own; --batch and --image-size do not "
                "apply to it")
    tensors = [args] if isinstance(args, torch.Tensor) else [
        a for a in (args if isinstance(args, (tuple, list)) else ()) if isinstance(a, torch.Tensor)]
    rank = tensors[0].dim() if tensors else 4
    fmt = Format.CHANNELS_LAST_3D if rank == 5 else Format.CHANNELS_LAST
    return ModelSpec(spec, module.eval(), args, "custom", fmt, dict(kwargs), note)


def _check_values(spec: str, factory: str, module: nn.Module, args: Any,
                  kwargs: dict[str, Any]) -> None:
    """``ModelSpecError`` for weights or inputs on the meta device (a factory that built
    under ``torch.device("meta")``): shapes without values, nothing can run on them."""
    meta = meta_weights(module)
    if meta:
        raise ModelSpecError(
            f"{spec!r}: {factory}() built {meta}: shapes without values, so nothing can run, "
            "be measured or verified. Materialize "
            f"them in {factory}(), e.g. module.to_empty(device='cpu') then reset_parameters() "
            "per module or load_state_dict from a checkpoint")
    if any(t.is_meta for t in iter_tensors((args, kwargs))):
        raise ModelSpecError(f"{spec!r}: {factory}() returned example inputs on the meta device "
                             "(shapes without values); return real tensors, e.g. "
                             "torch.randn(shape)")


def _invented_input(spec: str, factory: str, module: nn.Module, batch: int,
                    image_size: int | None, generator: torch.Generator) -> torch.Tensor:
    """``(batch, 3, S, S)`` unless the module says it takes something else: its first
    convolution is not a 3-channel ``Conv2d`` (a 3-d, 1-d or 1-channel model), which is a
    ``ModelSpecError``."""
    first = next((m for m in module.modules() if isinstance(m, nn.modules.conv._ConvNd)), None)
    if first is None or (type(first) is nn.Conv2d and first.in_channels == 3):
        size = image_size or _DEFAULT_SIZE["custom"]
        return torch.randn(batch, 3, size, size, generator=generator)
    what = f"its first convolution is {first!r}"
    raise ModelSpecError(
        f"{spec!r}: {factory}() returned only a module and {what}, so no input can be assumed "
        f"for it; return (module, example_input) or (module, args, kwargs) from {factory}()"
    )


def _unknown(spec: str, name: str, known: list[str], prefix: str) -> str:
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
    hint = ("; did you mean: " + ", ".join(prefix + c for c in close)) if close else ""
    return f"unknown model {spec!r}{hint}"
