"""Count the bytes torch ops write, and which of those writes are copies or layout permutes.

A thin ``TorchDispatchMode`` sees every aten call made while it is active. From each op's
schema it takes what the op writes: every returned tensor that aliases no input (a fresh
result) and every argument the schema marks as written (``copy_``'s destination, ``out=``).
Allocations (``empty*``) and metadata changes (``set_``, ``resize_``) write no data.

- a *copy* is a write by a pure data-movement op (``copy_``, ``clone``, ``_to_copy``, ``stack``,
  ``cat``, ``_pin_memory``); the rest are *arithmetic* writes (``div``, ``sub_``, ``addcmul``).
- a *layout copy* is a copy whose destination orders the dimensions differently from its
  source (``dim_order`` over the dims of size > 1): the per-image HWC -> CHW permute, the
  batch's NCHW -> NHWC conversion.

Copies memlayout's own code makes outside torch (the collate writes CPU images with
``numpy.copyto``: one single-threaded memcpy-like pass, which stays fast when the cores are
oversubscribed, where 64 small multi-threaded ``copy_`` calls per batch do not) are reported to
the active counters with :func:`note_copy`, under the name ``"numpy.copyto"``. Not seen:
anything else outside torch (JPEG decoding, PIL's packing into an array, numpy copies inside
torchvision) and temporaries an aten kernel makes internally.

>>> x = torch.zeros(2, 3, 4, 5)
>>> with CopyCounter() as c:
...     _ = x.contiguous(memory_format=torch.channels_last)
...     _ = x.clone()
...     _ = x + 1
>>> c.layout_copy_bytes, c.copy_bytes, c.arithmetic_bytes
(480, 960, 480)
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from memlayout.dispatch import ObservingMode
from memlayout.layout import dim_order

COPY_OPS: frozenset[str] = frozenset({
    "copy_", "clone", "_to_copy", "stack", "cat", "_pin_memory", "_copy_from",
    "_copy_from_and_resize", "permute_copy", "as_strided_copy", "lift_fresh_copy",
})
NO_DATA_OPS: frozenset[str] = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "set_", "resize_",
    "resize_as_", "_local_scalar_dense", "lift_fresh", "detach", "alias",
})


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_ACTIVE = threading.local()  # the CopyCounters open in this thread


def order_of(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    """``dim_order`` over the dims of size > 1 (size-1 dims' strides carry no layout).

    >>> order_of((3, 1, 4), (1, 99, 3))
    (2, 0)
    """
    return tuple(d for d in dim_order(shape, strides) if shape[d] > 1)


def _order(t: torch.Tensor) -> tuple[int, ...]:
    return order_of(tuple(t.shape), tuple(t.stride()))


def note_copy(name: str, nbytes: int, *, layout: bool) -> None:
    """Record a copy made outside torch in every :class:`CopyCounter` open in this thread."""
    for counter in getattr(_ACTIVE, "counters", ()):
        counter.calls[name] += 1
        counter.copy_bytes += nbytes
        if layout:
            counter.layout_copy_bytes += nbytes
            counter.layout_copies += 1


def _sources(name: str, args: tuple[Any, ...], written: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a copy reads, as views shaped like (one slice of) ``written``."""
    if name == "copy_":
        src = args[1]
        return [src.expand(written.shape)] if isinstance(src, torch.Tensor) else []
    if name in ("stack", "cat"):
        tensors = [t for t in args[0] if isinstance(t, torch.Tensor)]
        if name == "stack" and tensors and written.dim() == tensors[0].dim() + 1:
            return [t.unsqueeze(0) for t in tensors]
        return tensors
    src = args[0] if args else None
    return [src] if isinstance(src, torch.Tensor) and src.shape == written.shape else []


def _is_layout_copy(name: str, args: tuple[Any, ...], written: torch.Tensor) -> bool:
    srcs = _sources(name, args, written)
    if name == "stack" and srcs:
        # compare each input with its slot of the output
        return any(_order(s[0]) != _order(written[i]) for i, s in enumerate(srcs))
    return any(s.dim() == written.dim() and _order(s) != _order(written) for s in srcs)


@dataclass
class CopyCounter:
    """Context manager: bytes written by torch ops while active, split as the module doc says.

    ``calls`` counts the aten ops that wrote data, by name (``"copy_"``, ``"addcmul"``, ...).
    """

    copy_bytes: int = 0
    layout_copy_bytes: int = 0
    arithmetic_bytes: int = 0
    calls: Counter[str] = field(default_factory=Counter)
    layout_copies: int = 0
    _mode: Any = field(default=None, repr=False)

    def record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        name = func.overloadpacket.__name__
        if name in NO_DATA_OPS:
            return
        schema = func._schema
        written: list[torch.Tensor] = []
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
                written += [t for t in (v if isinstance(v, (list, tuple)) else [v])
                            if isinstance(t, torch.Tensor)]
        outs = out if isinstance(out, (list, tuple)) else (out,)
        for r, o in zip(schema.returns, outs, strict=False):
            if r.alias_info is None and isinstance(o, torch.Tensor):
                written.append(o)
        if not written:
            return
        self.calls[name] += 1
        nbytes = sum(_nbytes(t) for t in written)
        if name not in COPY_OPS:
            self.arithmetic_bytes += nbytes
            return
        self.copy_bytes += nbytes
        if _is_layout_copy(name, args, written[0]):
            self.layout_copy_bytes += nbytes
            self.layout_copies += 1

    def __enter__(self) -> CopyCounter:
        self._mode = _Mode(self)
        self._mode.__enter__()
        _ACTIVE.counters = (*getattr(_ACTIVE, "counters", ()), self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.counters = tuple(c for c in _ACTIVE.counters if c is not self)
        self._mode.__exit__(*exc)
        self._mode = None


class _Mode(ObservingMode):
    def __init__(self, counter: CopyCounter) -> None:
        super().__init__()
        self.counter = counter

    def observe(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        self.counter.record(func, args, kwargs, out)
