"""uint8 batch -> normalized model input, on the device, in one pass, staying channels-last.

``(x / 255 - mean) / std`` (what ``ToTensor`` + ``Normalize`` compute) is ``x * scale + shift``
with ``scale = 1 / (255 std)`` and ``shift = -mean / std``: one ``addcmul`` that reads uint8 and
writes the model's dtype, computed in float32 and rounded once. Moving the batch to the device
before converting moves 1 byte per value instead of 4. ``scale`` and ``shift`` are copied to
a device once per (values, dtype, device) and reused: a batch makes no blocking copy of them.

>>> x = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
>>> y = to_model_input(x, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
>>> y.dtype, y.stride(), y.unique().tolist()
(torch.float32, (48, 1, 12, 3), [-1.0])

Values agree with ``ToTensor`` + ``Normalize`` within float32 rounding (the two orders of
operations round differently by about one unit in the last place).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from memlayout.data.collate import DataPipelineError
from memlayout.layout import Format, strides_for

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

Stat = float | Sequence[float] | torch.Tensor


def _per_channel(name: str, value: Stat, channels: int) -> list[float]:
    vals = value.flatten().tolist() if isinstance(value, torch.Tensor) else (
        [float(value)] if isinstance(value, (int, float)) else [float(v) for v in value])
    if len(vals) == 1:
        vals = vals * channels
    if len(vals) != channels:
        raise DataPipelineError(
            f"{name} has {len(vals)} values for a batch of {channels} channels; give one value "
            f"or {channels} (e.g. the ImageNet {name} for RGB, one value for grayscale)"
        )
    return vals


def to_model_input(
    batch: torch.Tensor,
    mean: Stat,
    std: Stat,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    *,
    non_blocking: bool = True,
) -> torch.Tensor:
    """``(batch / 255 - mean) / std`` as ``dtype`` on ``device`` (default: the batch's), with
    canonical channels-last strides whatever the batch's strides (C == 1 included).

    ``batch`` is a uint8 ``(N, C, H, W)`` tensor (the output of the channels-last collate);
    ``mean`` and ``std`` are in the 0..1 units of ``torchvision.transforms.Normalize``.

    On an accelerator this is one kernel over the whole batch. On CPU, whose kernels convert a
    uint8 operand to float in a whole-size temporary first, it is two passes with no temporary:
    a cast copy into the output, then an in-place multiply-add (float32 / float64 outputs; for
    bf16 / fp16 the one addcmul, temporaries and all, so that the value is rounded once).
    Both are whole-batch ops: per-image ops open one parallel region per image, which costs
    little on idle cores and a lot on oversubscribed ones.

    >>> to_model_input(torch.zeros(1, 1, 2, 2, dtype=torch.uint8), 0.5, 0.25).stride()
    (4, 1, 2, 1)
    """
    if not isinstance(batch, torch.Tensor) or batch.dtype != torch.uint8 or batch.dim() != 4:
        got = (f"{batch.dtype} tensor of shape {tuple(batch.shape)}"
               if isinstance(batch, torch.Tensor) else type(batch).__name__)
        raise DataPipelineError(
            f"to_model_input needs a uint8 (N, C, H, W) batch, got a {got}; pass the images "
            "batch of memlayout.data.channels_last_loader / collate_channels_last"
        )
    if not dtype.is_floating_point:
        raise DataPipelineError(f"dtype {dtype} is not a floating dtype; use float32, bfloat16 or float16")
    channels = batch.shape[1]
    means = _per_channel("mean", mean, channels)
    stds = _per_channel("std", std, channels)
    if any(s == 0 for s in stds):
        raise DataPipelineError(f"std {stds} has a zero; every channel needs std != 0")
    dev = torch.device(device) if device is not None else batch.device
    x = batch.to(dev, non_blocking=non_blocking)
    # float64 output computes in float64; every other dtype computes in float32, rounds once.
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    scale, shift = affine_constants(
        tuple(1.0 / (255.0 * s) for s in stds),
        tuple(-m / s for m, s in zip(means, stds, strict=True)), compute, dev)
    shape = tuple(x.shape)
    out = torch.empty_strided(shape, strides_for(shape, Format.CHANNELS_LAST), dtype=dtype, device=dev)
    return _affine_into(out, x, scale, shift, cast_first=dev.type == "cpu" and dtype == compute)


#: at most this many (values, dtype, device) pairs of constants held on their devices
CONSTANTS_HELD = 16
_constants: OrderedDict[tuple[tuple[float, ...], tuple[float, ...], torch.dtype, torch.device],
                        tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
_constants_lock = threading.Lock()  # a loader's pinning thread may normalize too


def affine_constants(scale: tuple[float, ...], shift: tuple[float, ...], dtype: torch.dtype,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``scale`` and ``shift`` as ``(C, 1, 1)`` tensors of ``dtype`` on ``device``, copied there
    on first use and the same tensors after (least recently used dropped past
    ``CONSTANTS_HELD``). Read them, never write them.

    >>> a = affine_constants((2.0, 3.0), (0.5, 0.5), torch.float32, torch.device("cpu"))
    >>> a[0].shape, a[0] is affine_constants((2.0, 3.0), (0.5, 0.5), torch.float32,
    ...                                      torch.device("cpu"))[0]
    (torch.Size([2, 1, 1]), True)
    """
    key = (scale, shift, dtype, device)
    with _constants_lock:
        held = _constants.get(key)
        if held is not None:
            _constants.move_to_end(key)
            return held
    made = (torch.tensor(scale, dtype=dtype, device=device).view(-1, 1, 1),
            torch.tensor(shift, dtype=dtype, device=device).view(-1, 1, 1))
    # a tensor made under a tracer or a fake mode (torch.compile, FakeTensorMode) belongs to
    # that trace: only plain tensors are kept
    if all(type(t) is torch.Tensor for t in made) and not _compiling():
        with _constants_lock:
            _constants[key] = made
            while len(_constants) > CONSTANTS_HELD:
                _constants.popitem(last=False)
    return made


def _compiling() -> bool:
    compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(compiling is not None and compiling())


def _affine_into(out: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                 *, cast_first: bool) -> torch.Tensor:
    """``out = x * scale + shift``: one addcmul reading uint8, or (``cast_first``) a cast copy
    into ``out`` and an in-place addcmul there (``out`` must then have ``scale``'s dtype)."""
    if cast_first:
        out.copy_(x)
        torch.addcmul(shift, out, scale, out=out)
    else:
        torch.addcmul(shift, x, scale, out=out)
    return out
