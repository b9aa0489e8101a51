"""Collate decoded images straight into one channels-last uint8 batch.

Decoded images are HWC in memory: PIL images, numpy ``(H, W, C)`` arrays, and torchvision.io
decode results (``(C, H, W)`` tensors whose strides are HWC). The usual path permutes each one
to a contiguous CHW tensor (a copy), stacks them (a copy) and converts the batch to
channels-last (a copy). Here each sample is written once, into its slot of one NHWC buffer,
and the batch comes back NCHW-shaped with canonical channels-last strides. Every other field
(labels, names, boxes) is collated by ``torch.utils.data.default_collate``'s own rules.

What counts as an image: a PIL image with 8-bit bands, a ``uint8`` numpy array of rank 3
(H, W, C), a ``uint8`` tensor of rank 3 (C, H, W; a plain tensor or ``tv_tensors.Image``).

>>> import numpy as np
>>> imgs = [np.full((4, 5, 3), i, dtype=np.uint8) for i in range(2)]
>>> x, y = collate_channels_last([(imgs[0], 0), (imgs[1], 1)])
>>> tuple(x.shape), x.stride(), y
((2, 3, 4, 5), (60, 1, 15, 3), tensor([0, 1]))
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image, ImageMode
from torch.utils.data import DataLoader, Dataset, get_worker_info
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as F

from memlayout.data.copies import note_copy, order_of
from memlayout.errors import DataPipelineError, MixedImageSizeError
from memlayout.layout import Format, strides_for

try:  # the documented way to extend default_collate (torch >= 1.13)
    from torch.utils.data._utils.collate import collate as _collate
    from torch.utils.data._utils.collate import default_collate_fn_map as _DEFAULT_MAP
except ImportError:  # pragma: no cover - guarded private path
    _collate = None
    _DEFAULT_MAP = {}

Fit = Literal["error", "resize", "center_crop"]
FITS: tuple[str, ...] = ("error", "resize", "center_crop")
CHW = tuple[int, int, int]  # (C, H, W) sizes


def is_image(x: Any) -> bool:
    """Whether the collate writes ``x`` into the channels-last batch (see the module doc).

    >>> is_image(np.zeros((4, 4, 3), np.uint8)), is_image(torch.zeros(3, 4, 4)), is_image(7)
    (True, False, False)
    """
    if isinstance(x, Image.Image):
        return True
    if isinstance(x, np.ndarray):
        return x.dtype == np.uint8 and x.ndim == 3
    if isinstance(x, torch.Tensor):
        plain = type(x) is torch.Tensor or isinstance(x, tv_tensors.Image)
        return plain and x.dtype == torch.uint8 and x.dim() == 3
    return False


def _chw_size(x: Any) -> tuple[int, int, int]:
    """(C, H, W) of an image without touching its pixels."""
    if isinstance(x, Image.Image):
        mode = ImageMode.getmode(x.mode)
        if mode.typestr != "|u1":
            raise DataPipelineError(
                f"PIL image of mode {x.mode!r} has {mode.typestr} pixels, expected 8-bit bands "
                "(L, RGB, RGBA, ...); convert it in the loader, e.g. img.convert('L') or 'RGB'"
            )
        return (len(mode.bands), x.height, x.width)
    if isinstance(x, np.ndarray):
        h, w, c = x.shape
        return (c, h, w)
    c, h, w = x.shape
    return (c, h, w)


def _hwc_array(x: Image.Image | np.ndarray) -> np.ndarray:
    """The (H, W, C) pixels of a PIL image (after the one packing copy PIL makes: its RGB storage
    is 4 bytes per pixel) or of an array (itself)."""
    arr = np.asarray(x)
    return arr[:, :, None] if arr.ndim == 2 else arr  # single-band PIL image: (H, W)


def _as_chw_array(x: Any) -> np.ndarray:
    """A (C, H, W) numpy view over a CPU image's HWC pixels (no copy beyond PIL's packing)."""
    if isinstance(x, torch.Tensor):
        return x.detach().as_subclass(torch.Tensor).numpy()
    return _hwc_array(x).transpose(2, 0, 1)


def _as_chw_tensor(x: Image.Image | np.ndarray) -> torch.Tensor:
    """A (C, H, W) tensor view over the HWC pixels (copied only if read-only or not dense)."""
    return torch.from_numpy(np.require(_hwc_array(x), requirements=["C", "W"])).permute(2, 0, 1)


def _write(dst: torch.Tensor, x: Any) -> None:
    """Write image ``x`` into ``dst``, a (C, H, W) slot of the batch: one pass, no permute copy
    of the source, whatever its strides."""
    if dst.device.type == "cpu" and not (isinstance(x, torch.Tensor) and x.device.type != "cpu"):
        src, out = _as_chw_array(x), dst.numpy()
        np.copyto(out, src)  # single-threaded: see memlayout.data.copies
        note_copy("numpy.copyto", out.nbytes,
                  layout=order_of(src.shape, src.strides) != order_of(out.shape, out.strides))
        return
    dst.copy_(x.as_subclass(torch.Tensor) if isinstance(x, torch.Tensor) else _as_chw_tensor(x))


def _fit(x: Any, size: tuple[int, int], fit: str) -> Any:
    if isinstance(x, np.ndarray):
        x = _as_chw_tensor(x)
    if fit == "resize":
        return F.resize(x, list(size), antialias=True)
    return F.center_crop(x, list(size))


def _indices(idx: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(i) for i in idx[:limit])
    more = f", ... ({len(idx)} in all)" if len(idx) > limit else ""
    return f"sample{'s' if len(idx) > 1 else ''} {shown}{more}"


def _mixed_error(sizes: list[CHW], expected: tuple[int, int] | None) -> MixedImageSizeError:
    groups: dict[CHW, list[int]] = {}
    for i, s in enumerate(sizes):
        groups.setdefault(s, []).append(i)
    got = "; ".join(f"{s} for {_indices(idx)}" for s, idx in groups.items())
    target = f" (H, W) = {expected} was asked for;" if expected is not None else ""
    if len({s[0] for s in sizes}) > 1:
        todo = ("convert every image to the same mode in the loader (e.g. img.convert('RGB')); "
                "fit='resize'/'center_crop' changes H and W, never C")
    else:
        todo = ("resize or crop in the per-sample transform (e.g. v2.Resize((H, W)) or "
                "v2.CenterCrop), or pass fit='resize' or fit='center_crop' (optionally with "
                "size=(H, W)) to ChannelsLastCollate / channels_last_loader")
    return MixedImageSizeError(
        f"images of one batch must share one (C, H, W);{target} got {got}. To fix: {todo}",
        groups,
    )


def _pinning_available() -> bool:
    acc = getattr(torch, "accelerator", None)  # torch >= 2.6
    if acc is not None:
        return bool(acc.is_available())
    return torch.cuda.is_available()


def empty_channels_last_batch(
    n: int, c: int, h: int, w: int, *, device: torch.device | str = "cpu", pin_memory: bool = False
) -> torch.Tensor:
    """Uninitialised uint8 ``(n, c, h, w)`` tensor with canonical channels-last strides.

    Inside a DataLoader worker (CPU) the storage is shared memory, as ``default_collate`` does,
    so sending the batch to the main process copies nothing.

    >>> empty_channels_last_batch(2, 1, 3, 4).stride()   # C == 1: still canonical
    (12, 1, 4, 1)
    """
    shape = (n, c, h, w)
    strides = strides_for(shape, Format.CHANNELS_LAST)
    device = torch.device(device)
    if device.type == "cpu" and get_worker_info() is not None:
        new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
        if new_shared is not None:
            storage = new_shared(n * c * h * w)
            return torch.empty(0, dtype=torch.uint8).set_(storage, 0, shape, strides)
        return torch.empty_strided(shape, strides, dtype=torch.uint8).share_memory_()
    return torch.empty_strided(shape, strides, dtype=torch.uint8, device=device,
                               pin_memory=pin_memory)


def collate_images(
    images: Sequence[Any],
    *,
    fit: Fit = "error",
    size: tuple[int, int] | None = None,
    pin_memory: bool = False,
) -> torch.Tensor:
    """Write ``images`` (see :func:`is_image`) into one ``(N, C, H, W)`` uint8 batch with
    canonical channels-last strides: one write per image, no per-image permute or contiguous copy.

    ``fit``: what to do when sizes differ (from each other, or from ``size`` = (H, W) when
    given): ``"error"`` raises :class:`MixedImageSizeError` naming the samples and sizes;
    ``"resize"`` / ``"center_crop"`` bring them to ``size`` (default: the first image's) with
    ``torchvision.transforms.v2.functional``.

    >>> gray = [np.zeros((2, 3, 1), np.uint8)] * 2
    >>> collate_images(gray).stride() == torch.empty(2, 1, 2, 3, memory_format=torch.channels_last).stride()
    True
    >>> collate_images([np.zeros((2, 3, 3), np.uint8), np.zeros((4, 3, 3), np.uint8)])
    Traceback (most recent call last):
    ...
    memlayout.errors.MixedImageSizeError: images of one batch must share one (C, H, W); got (3, 2, 3) for sample 0; (3, 4, 3) for sample 1. To fix: ...
    """
    if fit not in FITS:
        raise DataPipelineError(f"fit={fit!r} is not one of {FITS}")
    images = list(images)
    if not images:
        raise DataPipelineError("collate_images got no images; a batch needs at least one")
    for i, x in enumerate(images):
        if not is_image(x):
            raise DataPipelineError(
                f"sample {i} is a {type(x).__name__} where sample 0 is an image; every sample "
                "must hold an image at the same place (PIL image, uint8 HWC array, uint8 CHW tensor)"
            )
    sizes = [_chw_size(x) for x in images]
    c, h, w = sizes[0]
    target = tuple(size) if size is not None else (h, w)
    if any(s != (c, *target) for s in sizes):
        if fit == "error" or any(s[0] != c for s in sizes):
            raise _mixed_error(sizes, tuple(size) if size is not None else None)
        images = [x if s[1:] == target else _fit(x, target, fit) for x, s in zip(images, sizes, strict=True)]
        h, w = target
    devices = {x.device for x in images if isinstance(x, torch.Tensor)}
    if len(devices) > 1:
        raise DataPipelineError(f"image tensors of one batch are on several devices: {sorted(map(str, devices))}")
    device = devices.pop() if devices else torch.device("cpu")
    pin = pin_memory and device.type == "cpu" and get_worker_info() is None
    if pin and not _pinning_available():
        warnings.warn("pin_memory=True but no accelerator is available; the batch is not pinned",
                      stacklevel=2)
        pin = False
    out = empty_channels_last_batch(len(images), c, h, w, device=device, pin_memory=pin)
    for i, x in enumerate(images):
        _write(out[i], x)
    return out


class ChannelsLastCollate:
    """A ``collate_fn``: images (wherever they sit in the sample: alone, in a tuple, under a
    dict key) become one channels-last uint8 batch via :func:`collate_images`; every other field
    is collated as ``default_collate`` would.

    >>> collate = ChannelsLastCollate()
    >>> out = collate([{"image": np.zeros((2, 2, 3), np.uint8), "label": 1, "name": "a"}] * 2)
    >>> out["image"].stride(), out["label"], out["name"]
    ((12, 1, 6, 3), tensor([1, 1]), ['a', 'a'])
    """

    def __init__(self, *, fit: Fit = "error", size: tuple[int, int] | None = None,
                 pin_memory: bool = False) -> None:
        if fit not in FITS:
            raise DataPipelineError(f"fit={fit!r} is not one of {FITS}")
        if _collate is None:  # pragma: no cover
            raise DataPipelineError("this torch has no torch.utils.data._utils.collate.collate")
        self.fit, self.size, self.pin_memory = fit, size, pin_memory

    def __repr__(self) -> str:
        return f"ChannelsLastCollate(fit={self.fit!r}, size={self.size}, pin_memory={self.pin_memory})"

    def _images(self, batch: Sequence[Any], *, collate_fn_map: Any = None) -> torch.Tensor:
        return collate_images(batch, fit=self.fit, size=self.size, pin_memory=self.pin_memory)

    def _or_default(self, default: Callable[..., Any]) -> Callable[..., Any]:
        def collate_leaf(batch: Sequence[Any], *, collate_fn_map: Any = None) -> Any:
            if is_image(batch[0]):
                return self._images(batch)
            return default(batch, collate_fn_map=collate_fn_map)

        return collate_leaf

    def __call__(self, batch: Sequence[Any]) -> Any:
        fn_map = dict(_DEFAULT_MAP)
        fn_map[Image.Image] = self._images
        for kind in (torch.Tensor, np.ndarray):
            if kind in fn_map:
                fn_map[kind] = self._or_default(fn_map[kind])
        # PIL images first: the map is searched in order with isinstance.
        fn_map = {Image.Image: fn_map.pop(Image.Image), **fn_map}
        return _collate(batch, collate_fn_map=fn_map)


def collate_channels_last(batch: Sequence[Any]) -> Any:
    """``ChannelsLastCollate()`` with its defaults (mixed sizes raise; no pinning)."""
    return ChannelsLastCollate()(batch)


def channels_last_loader(
    dataset: Dataset,
    batch_size: int = 1,
    *,
    shuffle: bool = False,
    num_workers: int = 0,
    pin_memory: bool = False,
    fit: Fit = "error",
    size: tuple[int, int] | None = None,
    **loader_kwargs: Any,
) -> DataLoader:
    """A ``DataLoader`` whose batches hold channels-last uint8 images (see
    :class:`ChannelsLastCollate`); every other argument goes to ``DataLoader``.

    ``pin_memory``: with ``num_workers == 0`` the batch is allocated pinned (no extra copy);
    with workers it is built in shared memory and pinned by the DataLoader's pin thread
    (``Tensor.pin_memory`` keeps the strides).

    >>> ds = [(np.zeros((2, 2, 3), np.uint8), 0)] * 3
    >>> [tuple(x.shape) for x, _ in channels_last_loader(ds, batch_size=2)]
    [(2, 3, 2, 2), (1, 3, 2, 2)]
    """
    if "collate_fn" in loader_kwargs:
        raise DataPipelineError("channels_last_loader sets collate_fn itself; use DataLoader "
                                "with collate_fn=ChannelsLastCollate(...) to combine it with yours")
    pin_in_collate = pin_memory and num_workers == 0 and _pinning_available()
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=num_workers,
        pin_memory=pin_memory and not pin_in_collate,
        collate_fn=ChannelsLastCollate(fit=fit, size=size, pin_memory=pin_in_collate),
        **loader_kwargs,
    )
