"""One dtype parser and one autocast helper for every verb (L1).

A model runs in fp32 as given, or under ``torch.autocast`` in bf16 / fp16. The autocast dtype
is ``None`` for fp32 (nothing to enter), a ``torch.dtype`` otherwise.

>>> parse_dtype("bf16"), parse_dtype("fp32"), parse_dtype(torch.float16)
(torch.bfloat16, None, torch.float16)
>>> dtype_name(parse_dtype("bfloat16")), dtype_name(None)
('bf16', 'fp32')
>>> parse_dtype("fp8")
Traceback (most recent call last):
...
memlayout.errors.DtypeError: dtype 'fp8' is not supported; use fp32, bf16 or fp16 (or torch.float32 / torch.bfloat16 / torch.float16)
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from memlayout.errors import DtypeError

#: accepted spellings -> the autocast dtype (``None``: fp32, no autocast)
_NAMES: dict[str, torch.dtype | None] = {
    "fp32": None, "float32": None, "float": None,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}
#: the short name each autocast dtype is shown and stored under
_SHORT = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def parse_dtype(dtype: str | torch.dtype | None, *,
                allowed: tuple[str, ...] = ("fp32", "bf16", "fp16")) -> torch.dtype | None:
    """The autocast dtype for a name (``fp32``/``float32``, ``bf16``/``bfloat16``,
    ``fp16``/``float16``/``half``, case-insensitive, ``torch.`` prefix allowed) or a
    ``torch.dtype``; ``None`` for fp32. ``allowed``: the short names this caller runs (a verb
    without fp16 kernels passes ``("fp32", "bf16")``); anything else raises ``DtypeError``."""
    if dtype is None or isinstance(dtype, torch.dtype):
        found = dtype in _SHORT or dtype is torch.float32
        parsed = None if dtype is torch.float32 else dtype
    else:
        text = str(dtype).strip().lower().removeprefix("torch.")
        found = text in _NAMES
        parsed = _NAMES.get(text)
    if not found or _SHORT.get(parsed) not in allowed:
        torch_names = " / ".join(f"torch.{_long(n)}" for n in allowed)
        raise DtypeError(f"dtype {dtype!r} is not supported; use {_or(allowed)} "
                         f"(or {torch_names})")
    return parsed


def dtype_name(dtype: torch.dtype | None) -> str:
    """The short name of an autocast dtype: ``fp32`` for ``None``."""
    return _SHORT.get(dtype, str(dtype).removeprefix("torch."))


def autocast(device: torch.device | str, dtype: torch.dtype | None
             ) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` for ``dtype`` on ``device``'s type, or a no-op context for ``None``.

    >>> with autocast("cpu", torch.bfloat16):
    ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    torch.bfloat16
    """
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def _long(short: str) -> str:
    return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[short]


def _or(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
