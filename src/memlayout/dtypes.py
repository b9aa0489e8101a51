"""One dtype parser, one autocast helper and one tolerance table for every verb (L1).

A model runs in fp32 as given, or under ``torch.autocast`` in bf16 / fp16. The autocast dtype
is ``None`` for fp32 (nothing to enter), a ``torch.dtype`` otherwise.

>>> parse_dtype("bf16"), parse_dtype("fp32"), parse_dtype(torch.float16)
(torch.bfloat16, None, torch.float16)
>>> dtype_name(parse_dtype("bfloat16")), dtype_name(None), torch_name(torch.bfloat16)
('bf16', 'fp32', 'bfloat16')
>>> parse_dtype("fp8")
Traceback (most recent call last):
...
memlayout.errors.DtypeError: dtype 'fp8' is not supported; use fp32, bf16 or fp16 (or torch.float32 / torch.bfloat16 / torch.float16)
"""

from __future__ import annotations

import contextlib
import enum
import functools
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
        text = torch_name(str(dtype).strip().lower())
        found = text in _NAMES
        parsed = _NAMES.get(text)
    if not found or _SHORT.get(parsed) not in allowed:
        torch_names = " / ".join(f"torch.{_long(n)}" for n in allowed)
        raise DtypeError(f"dtype {dtype!r} is not supported; use {_or(allowed)} "
                         f"(or {torch_names})")
    return parsed


def dtype_name(dtype: torch.dtype | None) -> str:
    """The short name of an autocast dtype (``bf16``): ``fp32`` for ``None``, torch's name for
    a dtype that has no short one."""
    return _SHORT.get(dtype) or torch_name(dtype)


@functools.cache
def torch_name(dtype: torch.dtype | str) -> str:
    """torch's name of a tensor dtype, without the module: ``float32``, ``bfloat16``,
    ``int64`` (a name, with or without ``torch.``, comes back as torch spells it).

    >>> torch_name(torch.float32), torch_name("torch.complex64")
    ('float32', 'complex64')
    """
    return str(dtype).removeprefix("torch.")


class Compared(enum.Enum):
    """What two results are: it decides how close they must be (:func:`tolerance`)."""

    #: one operator run in two layouts, element by element (``torch.isclose``)
    OP = "op"
    #: a whole model's outputs and gradients against the original's, relative to the
    #: reference's largest magnitude
    MODEL = "model"


#: (rtol, atol) per dtype. ``OP``: ``torch.testing.assert_close``'s defaults, what the coverage
#: matrix calls "values agree" (a channels-last kernel may sum in another order). ``MODEL``: what the planner's verification allows: kernels that
#: block and accumulate differently (channels-last convolutions) round differently, and the
#: differences grow through a network; bf16 keeps 8 mantissa bits.
TOLERANCES: dict[Compared, dict[torch.dtype, tuple[float, float]]] = {
    Compared.OP: {
        torch.float16: (1e-3, 1e-5),
        torch.bfloat16: (1.6e-2, 1e-5),
        torch.float32: (1.3e-6, 1e-5),
        torch.float64: (1e-7, 1e-7),
        torch.complex32: (1e-3, 1e-5),
        torch.complex64: (1.3e-6, 1e-5),
        torch.complex128: (1e-7, 1e-7),
    },
    Compared.MODEL: {
        torch.float64: (1e-7, 1e-9),
        torch.float32: (1e-3, 1e-5),
        torch.float16: (1e-2, 1e-3),
        torch.bfloat16: (5e-2, 1e-2),
    },
}


#: TF32 keeps fp16's 10 mantissa bits: fp32 results of convolutions and matmuls that round
#: their inputs to it (Ampere and later, ``memlayout.devices``' ``fp32_rounding``) are held to
#: fp16's model tolerance, as NCHW and NHWC kernels round them differently
TF32_AS = torch.float16


def tolerance(dtype: torch.dtype, compared: Compared) -> tuple[float, float]:
    """(rtol, atol) for results in ``dtype`` compared as ``compared`` says; a dtype the table
    does not list gets float32's.

    >>> tolerance(torch.bfloat16, Compared.MODEL), tolerance(torch.float32, Compared.OP)
    ((0.05, 0.01), (1.3e-06, 1e-05))
    """
    table = TOLERANCES[compared]
    return table.get(dtype, table[torch.float32])


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
