"""PyTorch's OpInfo database, imported defensively, and the samples coverage runs.

``torch.testing._internal`` is torch's own test suite: not a public API, it moves between
releases and needs test-only packages (``expecttest``). Everything that touches it is here.
"""

from __future__ import annotations

import fnmatch
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.testing import make_tensor

from memlayout.dtypes import torch_name
from memlayout.errors import CoverageUnavailableError
from memlayout.layout import Format, formats_of, strides_for
from memlayout.tensors import iter_tensors


@functools.cache
def load_op_db() -> tuple[Any, ...]:
    """Every OpInfo of this torch build, in torch's order (the same order in every process).

    Raises ``CoverageUnavailableError`` when ``torch.testing._internal`` cannot be imported.
    """
    try:
        from torch.testing._internal.common_methods_invocations import op_db
    except Exception as exc:  # ImportError, or anything the test suite raises at import
        raise CoverageUnavailableError(
            f"PyTorch's operator database (torch.testing._internal.common_methods_invocations."
            f"op_db) cannot be imported on torch {torch.__version__}: "
            f"{type(exc).__name__}: {exc}. It is torch's internal test API; it needs the "
            f"'expecttest' package (pip install expecttest) and may move between torch "
            f"versions. The coverage matrix is unavailable on this build."
        ) from exc
    return tuple(op_db)


def op_name(op: Any) -> str:
    """OpInfo's name plus ``.variant`` (``nn.functional.pad.reflect``); unique in op_db."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def select_ops(ops: Sequence[Any], pattern: str | None) -> list[int]:
    """Indices of the ops matching ``pattern``: comma-separated globs matched against the full
    name (``nn.functional.pad.reflect``) and the plain name (``nn.functional.pad``).

    >>> class Op:
    ...     def __init__(self, name, variant=""): self.name, self.variant_test_name = name, variant
    >>> ops = [Op("relu"), Op("nn.functional.relu"), Op("nn.functional.pad", "reflect")]
    >>> select_ops(ops, "nn.functional.pad"), select_ops(ops, "*relu"), select_ops(ops, None)
    ([2], [0, 1], [0, 1, 2])
    """
    if not pattern:
        return list(range(len(ops)))
    globs = [p.strip() for p in pattern.split(",") if p.strip()]
    return [i for i, op in enumerate(ops)
            if any(fnmatch.fnmatchcase(n, g) for g in globs for n in (op_name(op), op.name))]


@dataclass
class Sample:
    """One call: ``op(input, *args, **kwargs)``; ``lifted`` when memlayout built it."""

    input: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output_process_fn_grad: Any
    lifted: bool = False


def map_tensors(obj: Any, fn: Any) -> Any:
    """``obj`` with every tensor inside (lists, tuples, dicts) replaced by ``fn(tensor)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(map_tensors(v, fn) for v in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def telling(sample: Any, fmt: Format) -> bool:
    """Whether ``sample`` can show if ``fmt`` survives: it has a tensor of ``fmt``'s rank that,
    converted to ``fmt``, is in ``fmt`` alone (not also contiguous: C == 1, H == W == 1 and
    empty tensors are both, and tell nothing).

    >>> telling(Sample(torch.zeros(2, 3, 4, 4), (), {}, None), Format.CHANNELS_LAST)
    True
    >>> telling(Sample(torch.zeros(6, 0, 0, 0), (), {}, None), Format.CHANNELS_LAST)
    False
    """
    parts = (sample.input, sample.args, sample.kwargs)
    return any(t.dim() == fmt.rank and t.layout == torch.strided
               and formats_of(t.shape, strides_for(t.shape, fmt)) == {fmt}
               for t in iter_tensors(parts))


def samples_for(op: Any, device: str, dtype: torch.dtype, fmt: Format, *, requires_grad: bool,
                max_samples: int) -> tuple[list[Sample], bool]:
    """Up to ``max_samples`` telling samples of ``op`` (see ``telling``), spread evenly over
    OpInfo's reference inputs (which include the sample inputs). When none tells, samples
    lifted to ``fmt``'s rank (see ``lift``), and ``True`` as the second value.
    """
    torch.manual_seed(0)  # OpInfo samples are random: the same set in every process and run
    try:
        found = [s for s in op.reference_inputs(device, dtype, requires_grad=requires_grad)
                 if telling(s, fmt)]
    except Exception:  # some reference_inputs_func break on some builds; samples still work
        torch.manual_seed(0)
        found = [s for s in op.sample_inputs(device, dtype, requires_grad=requires_grad)
                 if telling(s, fmt)]
    lifted = False
    if not found:
        torch.manual_seed(0)
        lifts = (lift(s, fmt.rank) for s in
                 op.sample_inputs(device, dtype, requires_grad=requires_grad))
        found = [x for x in lifts if x is not None and telling(x, fmt)]
        lifted = True
    picked = _spread(found, max_samples)
    return [Sample(s.input, tuple(s.args), dict(s.kwargs), s.output_process_fn_grad, lifted)
            for s in picked], lifted


def _spread(items: list[Any], k: int) -> list[Any]:
    """``k`` items spread evenly over ``items`` (all when there are no more than ``k``)."""
    if k <= 0 or len(items) <= k:
        return items
    step = len(items) / k
    return [items[math.floor(i * step)] for i in range(k)]


_LEAD_SIZES = (2, 3, 4, 3)
_DIM_KWARGS = frozenset({"dim", "dims", "axis", "start_dim", "end_dim"})


def _shift_dims(v: Any, shift: int) -> Any:
    """Non-negative dim indices moved past ``shift`` new leading dims (negative ones already
    count from the end).

    >>> _shift_dims(0, 2), _shift_dims(-1, 2), _shift_dims((0, -1), 2), _shift_dims(None, 2)
    (2, -1, (2, -1), None)
    """
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, int):
        return v + shift if v >= 0 else v
    if isinstance(v, (list, tuple)) and all(isinstance(d, int) for d in v):
        return type(v)(_shift_dims(d, shift) for d in v)
    return v


def lift(sample: Any, rank: int) -> Any | None:
    """``sample`` with its floating input (rank 1 to rank - 1) given leading dims up to
    ``rank``, fresh values in the input's range; other tensors of the input's shape get the
    same treatment, the rest stay (broadcasting aligns trailing dims, so it still applies);
    ``dim=``/``axis=`` keyword indices move with the old dims. ``None`` when the input is not such a tensor, or the call asks for an unchecked kernel
    (``unsafe=True``: a lifted call would corrupt memory, as ``_segment_reduce`` does).

    Only for ops whose OpInfo samples have no tensor of the format's rank (``add``, ``mul``,
    ``softmax``): the op decides whether it accepts the lifted call; when it rejects it in
    contiguous form too, that sample is dropped, not counted as an error.
    """
    x = sample.input
    if not isinstance(x, torch.Tensor) or x.layout != torch.strided:
        return None
    if sample.kwargs.get("unsafe"):  # unchecked kernels: a lifted call would read out of bounds
        return None
    if not (x.is_floating_point() or x.is_complex()) or not 1 <= x.dim() < rank:
        return None
    shape = tuple(x.shape)
    new_shape = _LEAD_SIZES[: rank - x.dim()] + shape

    def grow(t: torch.Tensor) -> torch.Tensor:
        if tuple(t.shape) != shape or not (t.is_floating_point() or t.is_complex()):
            return t
        return _fresh(t, new_shape)

    # torch's internal test API, like op_db: loaded only where OpInfo samples are in hand
    from torch.testing._internal.opinfo.core import SampleInput

    args = map_tensors(tuple(sample.args), grow)
    shift = rank - x.dim()
    kwargs = {k: _shift_dims(v, shift) if k in _DIM_KWARGS else v
              for k, v in map_tensors(dict(sample.kwargs), grow).items()}
    return SampleInput(grow(x), args=args, kwargs=kwargs,
                       output_process_fn_grad=sample.output_process_fn_grad)


def _fresh(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """New values of ``shape`` within ``t``'s range (so an op's domain is respected)."""
    src = t.detach()
    if src.numel() and not src.is_complex():
        finite = src[torch.isfinite(src)].float()
        lo, hi = (finite.min().item(), finite.max().item()) if finite.numel() else (-1.0, 1.0)
    else:
        lo, hi = -1.0, 1.0
    if hi <= lo:
        hi = lo + 1.0
    out = make_tensor(shape, dtype=t.dtype, device=t.device, low=lo, high=hi)
    return out.requires_grad_(t.requires_grad)


def describe(sample: Sample, limit: int = 160) -> str:
    """A short, readable description of a sample's call.

    >>> s = Sample(torch.zeros(2, 3, 4, 4), (1,), {"dim": -1}, None)
    >>> describe(s)
    'input[2,3,4,4] float32, 1, dim=-1'
    """

    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"[{','.join(map(str, v.shape))}] {torch_name(v.dtype)}"
        if isinstance(v, (list, tuple)):
            return "(" + ", ".join(one(x) for x in v) + ")"
        return repr(v)

    parts = ["input" + one(sample.input)]
    parts += [one(a) for a in sample.args]
    parts += [f"{k}={one(v)}" for k, v in sample.kwargs.items()]
    text = ", ".join(parts)
    return text if len(text) <= limit else text[: limit - 3] + "..."
