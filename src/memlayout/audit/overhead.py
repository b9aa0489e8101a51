"""What auditing costs: an audited run against a plain run, interleaved (L2).

Both sides run the same model in the same format: ``plain`` is a forward (forward + backward
with ``train``) of a converted copy; ``audited`` is the whole ``audit(...)`` call, model copy
and conversion included. Timed with ``memlayout.timing.interleaved``; the ratio to quote is the
median of the per-round ratios audited / plain.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from memlayout.audit.recorder import audit, inputs_format, prepare, run_once
from memlayout.devices import seam
from memlayout.dtypes import parse_dtype
from memlayout.layout import Format
from memlayout.timing import Comparison, interleaved


def overhead(model: nn.Module, inputs: Any, *, train: bool = False,
             fmt: Format | str | None = None, dtype: Any = None,
             rounds: int = 5, warmup: int = 1, device: str = "cpu",
             kwargs: dict[str, Any] | None = None) -> Comparison:
    """Interleaved timings of ``audited`` and ``plain``; ``c.speedup("plain")`` is the median
    per-round ratio audited time / plain time (the audit's overhead factor)."""
    fmt = inputs_format(inputs, kwargs) if fmt is None else Format.parse(fmt)
    autocast_dtype = parse_dtype(dtype)
    plain_model, plain_inputs, plain_kwargs = prepare(model, inputs, fmt, kwargs)

    def plain() -> None:
        run_once(plain_model, plain_inputs, train=train, dtype=autocast_dtype, kwargs=plain_kwargs)
        if train:
            plain_model.zero_grad(set_to_none=True)

    def audited() -> None:
        audit(model, inputs, train=train, fmt=fmt, dtype=dtype, kwargs=kwargs)

    return interleaved({"audited": audited, "plain": plain}, rounds=rounds, warmup=warmup,
                       baseline="audited", sync=seam(device).synchronize)
