"""Comparing two models' results (L2 plan, check): dtype-aware tolerances relative to the
scale of the reference (``|got - want| <= atol + rtol * max|want|``), NaNs where the reference has
them, and the float64 re-check that tells rounding from a real difference.

>>> worst_error(torch.ones(3), torch.ones(3) * 1.01, torch.float32)[1]
False
>>> worst_error(torch.ones(3), torch.ones(3) * 1.01, torch.bfloat16)[1]
True
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import fx, nn

from memlayout import dtypes
from memlayout.devices import seam
from memlayout.dtypes import TF32_AS, TOLERANCES, Compared
from memlayout.tensors import clone_inputs, iter_tensors, map_tensors

#: (rtol, atol) per dtype, relative to the reference's largest magnitude: ``memlayout.dtypes``'
#: model rows
TOLERANCE = TOLERANCES[Compared.MODEL]


def worst_error(want: torch.Tensor, got: torch.Tensor, dtype: torch.dtype | None) -> tuple[float, bool]:
    """(relative error, within tolerance) of one tensor pair; the tolerance follows the
    lower-precision of the run dtype (autocast) and the tensors' dtype, and fp32 is held to
    TF32's where the device rounds fp32 convolutions and matmuls to it."""
    if want.shape != got.shape:
        return float("inf"), False
    if not (want.is_floating_point() or want.is_complex()):
        bad = not torch.equal(want, got)
        return (1.0 if bad else 0.0), not bad
    run = [want.dtype, got.dtype, dtype or want.dtype]
    if torch.float32 in run and seam(want.device).fp32_rounding():
        run.append(TF32_AS)
    rtol, atol = max(TOLERANCE.get(d, TOLERANCE[torch.float32]) for d in run)
    a, b = want.detach().double(), got.detach().double()
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return float("inf"), False
    a, b = a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)
    scale = a.abs().max().item() if a.numel() else 0.0
    err = (a - b).abs().max().item() if a.numel() else 0.0
    rel = err / scale if scale > 0 else err
    return rel, err <= atol + rtol * scale


def compare(want: Any, got: Any, dtype: torch.dtype | None) -> tuple[bool, float, int]:
    """(all within tolerance, worst relative error, tensors compared) over nested outputs."""
    ws, gs = list(iter_tensors(want)), list(iter_tensors(got))
    if len(ws) != len(gs):
        return False, float("inf"), len(ws)
    ok, worst = True, 0.0
    for w, g in zip(ws, gs, strict=True):
        rel, fine = worst_error(w, g, dtype)
        ok &= fine
        worst = max(worst, rel)
    return ok, worst, len(ws)


def float64_agreement(reference: nn.Module, planned: nn.Module, inputs: tuple[Any, ...], *,
                      device: torch.device | None = None,
                      runs: tuple[Any, Any, torch.dtype | None] | None = None) -> float | None:
    """The worst relative error between float64 copies of both models (no autocast) on
    float64 inputs, when within float32's tolerance; ``None`` when they differ there too. A
    layout changes no value in exact arithmetic: a plan whose outputs differ only by the run
    dtype's rounding (a deep bf16 network, where NHWC and NCHW kernels round differently)
    agrees in float64, a wrong rewrite does not. ``None`` too where a model cannot run in
    float64 (its own code casts to float32; a traced graph's casts are widened, ``float64``).
    ``runs``: the original's and the planned model's outputs in the run dtype, which must
    then differ from the float64 result as rounding does (:func:`rounding_only`)."""
    xs = float64(inputs)
    try:
        with torch.no_grad(), float64_casts():
            want = float64(reference)(*clone_inputs(xs))
            got = float64(planned)(*clone_inputs(xs))
    except RuntimeError:  # a dtype the model fixes otherwise: no re-check, the mismatch stands
        return None
    ok, err, _ = compare(want, got, torch.float32)
    if ok and runs is not None:
        original, planned_run, dtype = runs
        ok = rounding_only(compare(want, original, dtype)[1], compare(want, planned_run, dtype)[1],
                           dtype)
    return err if ok else None


#: how many times farther from the float64 result a run beyond its dtype's tolerance may be
#: than the original's own run in that dtype, and be rounding (:func:`rounding_only`).
#: Kernels that accumulate in another order round differently: channels-last training steps
#: of deep BatchNorm networks land up to about 3.5x as far from float64 as contiguous ones.
ROUNDING_SLACK = 8.0


def rounding_only(original_off: float, got_off: float, dtype: torch.dtype | None) -> bool:
    """Whether a run whose worst relative error from the float64 result is ``got_off`` differs
    from it as the original's own run in ``dtype`` (``original_off``) does: within
    ``ROUNDING_SLACK`` times as far, or within the dtype's tolerance. Besides a rewrite that
    is exact in float64, this is what tells rounding from a kernel that computes something
    else in the run dtype (a wrong kernel is off by the size of the values).

    >>> rounding_only(0.05, 0.16, None), rounding_only(0.0, 5e-4, None)
    (True, True)
    >>> rounding_only(1e-5, 0.5, None), rounding_only(0.05, 0.5, None)
    (False, False)
    """
    return got_off <= max(ROUNDING_SLACK * original_off, tolerance(dtype)[0])


def float64(value: Any) -> Any:
    """A float64 copy of a module (strides kept: ``Tensor.double`` preserves the format) or
    of inputs (floating tensors converted, inside containers too: a detector takes a list of
    images; others as they are). In a module's traced graphs (``torch.fx``: Dynamo's, an
    export's) every cast to a lower float dtype casts to float64 (:func:`widen`); its eager
    code does so where it runs under :class:`float64_casts`.

    >>> float64(([torch.zeros(2)], torch.ones(1, dtype=torch.long)))[0][0].dtype
    torch.float64
    """
    if isinstance(value, nn.Module):
        wide = copy.deepcopy(value).double()
        for m in wide.modules():
            if isinstance(m, fx.GraphModule):
                widen(m)
        return wide
    return tuple(map_tensors(tuple(value), lambda x: x.double() if x.is_floating_point() else x))


#: what :func:`widen` casts to float64 instead, and the methods that cast to them
_NARROW = frozenset({torch.float32, torch.float16, torch.bfloat16})
_NARROW_METHODS = frozenset({"float", "half", "bfloat16"})


def widen(gm: fx.GraphModule) -> int:
    """Make ``gm`` (in place) cast to float64 wherever it casts to float32, float16 or
    bfloat16: a traced graph holds the dtype of a cast as traced (Dynamo writes
    ``q.float()`` and ``out.to(dtype)`` as ``float``, ``to(torch.float32)``), so its float64
    copy would meet a float32 tensor and a float64 weight in one op. Autocast regions keep
    their dtype (autocast takes no float64). Returns how many nodes changed.

    >>> class Upcast(torch.nn.Module):
    ...     def forward(self, x):
    ...         return (x.float() * 2).to(torch.float32)
    >>> gm = fx.symbolic_trace(Upcast())
    >>> widen(gm), gm(torch.ones(1, dtype=torch.float64)).dtype
    (2, torch.float64)
    """
    found: list[bool] = []

    def wide(a: Any) -> Any:
        if isinstance(a, torch.dtype) and a in _NARROW:
            found.append(True)
            return torch.float64
        return a

    changed = 0
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method") or "autocast" in str(n.target):
            continue
        found.clear()
        args, kwargs = fx.node.map_aggregate((n.args, n.kwargs), wide)
        if found:
            n.args, n.kwargs = args, kwargs
        if n.op == "call_method" and n.target in _NARROW_METHODS:
            n.target = "double"
            found.append(True)
        changed += bool(found)
    if changed:
        gm.recompile()
    return changed


class float64_casts(torch.overrides.TorchFunctionMode):  # noqa: N801 (used like a function)
    """While active, eager code casts to float64 wherever it casts to float32, float16 or
    bfloat16 (``.float()``, ``.half()``, ``.bfloat16()``, a ``dtype`` argument: ``.to``,
    ``.type``, a factory): what :func:`widen` does to a traced graph, for a model's own
    ``forward`` in the float64 re-check. Without it, ``y.float()`` after an autocast region
    (autocast takes no float64, so the region itself stays float64) meets a float64 weight
    with a float32 activation.

    >>> x = torch.ones(2, dtype=torch.float64)
    >>> with float64_casts():
    ...     x.float().dtype, x.to(torch.bfloat16).dtype, torch.zeros(1, dtype=torch.half).dtype
    (torch.float64, torch.float64, torch.float64)
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _NARROW_CASTS:
            return args[0].double(**kwargs)
        if "autocast" not in getattr(func, "__name__", ""):
            # a dtype is an argument of its own (``.to(dtype)``, ``dtype=``); arguments are
            # not searched inside: a deep copy hands over its memo, every object copied so far
            args = tuple(_wide(a) if isinstance(a, torch.dtype) else a for a in args)
            kwargs = {k: _wide(v) if isinstance(v, torch.dtype) else v
                      for k, v in kwargs.items()}
        return func(*args, **kwargs)


#: the methods that cast to a dtype :class:`float64_casts` widens
_NARROW_CASTS = frozenset({torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16})


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype in _NARROW else dtype


def detached(value: Any) -> Any:
    """``value`` with every tensor detached (containers rebuilt, namedtuples kept)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, dict):
        return {k: detached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(detached(v) for v in value)
    return value


def tolerance(dtype: torch.dtype | None) -> tuple[float, float]:
    """``(rtol, atol)`` of the run dtype (``None``: float32)."""
    return dtypes.tolerance(dtype or torch.float32, Compared.MODEL)
