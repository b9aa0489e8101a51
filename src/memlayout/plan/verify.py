"""Verify (L2 plan, step 5): the planned model computes what the original computes.

Outputs are compared tensor by tensor with dtype-aware tolerances, relative to the scale of the
reference (``|got - want| <= atol + rtol * max|want|``); NaNs must sit where the reference has
them. On a mismatch the first divergent node is found by bisection over the original graph's
node order (one partial run of each model per probe) and named in a
``LayoutVerificationError``.

>>> worst_error(torch.ones(3), torch.ones(3) * 1.01, torch.float32)[1]
False
>>> worst_error(torch.ones(3), torch.ones(3) * 1.01, torch.bfloat16)[1]
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from memlayout.errors import LayoutVerificationError
from memlayout.plan.capture import autocast_context, device_of, node_target_name
from memlayout.tensors import iter_tensors

# (rtol, atol) relative to the reference's largest magnitude. Different kernels (channels-last
# convolutions block and accumulate differently) round differently; bf16 keeps 8 mantissa bits.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-3, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (5e-2, 1e-2),
}


@dataclass(frozen=True)
class Verification:
    ok: bool
    max_error: float  # worst error relative to the reference's scale
    tolerance: float  # the rtol applied
    tensors: int
    first_divergent: str | None = None


def worst_error(want: torch.Tensor, got: torch.Tensor, dtype: torch.dtype | None) -> tuple[float, bool]:
    """(relative error, within tolerance) of one tensor pair; the tolerance follows the
    lower-precision of the run dtype (autocast) and the tensors' dtype."""
    if want.shape != got.shape:
        return float("inf"), False
    if not (want.is_floating_point() or want.is_complex()):
        bad = not torch.equal(want, got)
        return (1.0 if bad else 0.0), not bad
    rtol, atol = max(TOLERANCE.get(d, TOLERANCE[torch.float32])
                     for d in (want.dtype, got.dtype, dtype or want.dtype))
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


def verify(reference: fx.GraphModule, planned: nn.Module, inputs: tuple[Any, ...], *,
           dtype: torch.dtype | None = None, planned_graph: fx.Graph | None = None,
           where: str = "", expected: Any = None) -> Verification:
    """Compare ``planned`` against ``reference`` on ``inputs``; raise
    ``LayoutVerificationError`` naming the first divergent node when they differ.

    ``planned_graph``: the graph ``planned`` runs (with the reference's node names), used to
    bisect; without it the error names no node. ``expected``: the reference's output when
    already computed (the capture run), else the reference runs here.
    """
    device = device_of(inputs, reference)
    with torch.no_grad(), autocast_context(device, dtype):
        want = reference(*_clone(inputs)) if expected is None else expected
        got = planned(*_clone(inputs))
    ok, worst, count = compare(want, got, dtype)
    rtol = TOLERANCE.get(dtype or torch.float32, TOLERANCE[torch.float32])[0]
    if ok:
        return Verification(True, worst, rtol, count)
    node = None
    if planned_graph is not None:
        node = first_divergent(reference, planned, planned_graph, inputs, dtype=dtype)
    where_text = f" in {where}" if where else ""
    named = (f"; first divergent node{where_text}: {node}" if node
             else "; the divergence could not be narrowed to one node")
    raise LayoutVerificationError(
        f"the planned model differs from the original by {worst:.3g} (relative; tolerance "
        f"{rtol:g} for {dtype or 'float32'}){named}. The plan was not applied; please report "
        "this with the model, or plan with measure=False to try another plan"
    )


class _Stop(Exception):
    def __init__(self, value: Any) -> None:
        self.value = value


class _UpTo(fx.Interpreter):
    def __init__(self, module: nn.Module, graph: fx.Graph, stop: str) -> None:
        super().__init__(module, graph=graph, garbage_collect_values=True)
        self.stop = stop

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.name == self.stop:
            raise _Stop(result)
        return result


def value_at(module: nn.Module, graph: fx.Graph, name: str, inputs: tuple[Any, ...]) -> Any:
    """The value node ``name`` of ``graph`` computes when ``module`` runs it on ``inputs``."""
    try:
        _UpTo(module, graph, name).run(*_clone(inputs))
    except _Stop as stop:
        return stop.value
    raise KeyError(name)


def first_divergent(reference: fx.GraphModule, planned: nn.Module, planned_graph: fx.Graph,
                    inputs: tuple[Any, ...], *, dtype: torch.dtype | None = None) -> str | None:
    """Bisect the reference's computing nodes for the first whose value the planned graph
    computes differently; ``"name (op)"`` or ``None``."""
    planned_names = {n.name for n in planned_graph.nodes}
    names = [n.name for n in reference.graph.nodes
             if n.op.startswith("call_") and n.name in planned_names]
    if not names:
        return None
    device = device_of(inputs, reference)

    def diverged(i: int) -> bool:
        with torch.no_grad(), autocast_context(device, dtype):
            want = value_at(reference, reference.graph, names[i], inputs)
            got = value_at(planned, planned_graph, names[i], inputs)
        return not compare(want, got, dtype)[0]

    lo, hi = 0, len(names) - 1
    if not diverged(hi):
        hi = len(names) - 1  # the output differs only after the last node: blame the last
        return _describe(reference, names[hi])
    while lo < hi:
        mid = (lo + hi) // 2
        if diverged(mid):
            hi = mid
        else:
            lo = mid + 1
    return _describe(reference, names[lo])


def _describe(gm: fx.GraphModule, name: str) -> str:
    node = next(n for n in gm.graph.nodes if n.name == name)
    return f"{name} ({node_target_name(gm, node)})"


def _clone(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)
