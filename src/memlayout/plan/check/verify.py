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

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.nn import functional as F

from memlayout.dtypes import autocast
from memlayout.errors import LayoutVerificationError
from memlayout.layout import strides_agree
from memlayout.plan.graph import node_target_name
from memlayout.tensors import device_of, iter_tensors

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
    float64_error: float | None = None  # the same models compared in float64, when it ran


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
           where: str = "", expected: Any = None,
           device: torch.device | None = None) -> Verification:
    """Compare ``planned`` against ``reference`` on ``inputs``; raise
    ``LayoutVerificationError`` naming the first divergent node when they differ.

    ``planned_graph``: the graph ``planned`` runs (with the reference's node names), used to
    bisect; without it the error names no node. ``expected``: the reference's output when
    already computed (the capture run), else the reference runs here. ``device``: where it
    runs (default: the inputs').
    """
    device = device_of(inputs, reference) if device is None else device
    with torch.no_grad(), autocast(device, dtype):
        want = reference(*_clone(inputs)) if expected is None else expected
        got = planned(*_clone(inputs))
    ok, worst, count = compare(want, got, dtype)
    rtol = TOLERANCE.get(dtype or torch.float32, TOLERANCE[torch.float32])[0]
    if ok:
        return Verification(True, worst, rtol, count)
    exact = float64_agreement(reference, planned, inputs, device=device)
    if exact is not None:  # rounding, not a wrong rewrite: equal where rounding is gone
        return Verification(True, worst, rtol, count, float64_error=exact)
    node = None
    if planned_graph is not None:
        node = first_divergent(reference, planned, planned_graph, inputs, dtype=dtype,
                               device=device)
    where_text = f" in {where}" if where else ""
    named = (f"; first divergent node{where_text}: {node}" if node
             else "; the divergence could not be narrowed to one node")
    raise LayoutVerificationError(
        f"the planned model differs from the original by {worst:.3g} (relative; tolerance "
        f"{rtol:g} for {dtype or 'float32'}){named}. The plan was not applied; please report "
        "this with the model, or plan with measure=False to try another plan",
        cause="outputs differ", node=node)


# ---------------------------------------------------------------- training


SEED = 0  # the RNG state both models start a verified step from (masks: _LayoutFreeDropout)


def training_loss(out: Any) -> torch.Tensor:
    """A loss that gives every output element its own gradient: the sum over the floating
    tensors of ``out`` of ``<t, w>`` for a fixed random ``w`` per shape (seeded, so both
    models get the same), in float32 outside autocast."""
    gen = torch.Generator().manual_seed(SEED)
    terms = []
    for t in iter_tensors(out):
        if t.is_floating_point() and t.requires_grad:
            w = torch.randn(tuple(t.shape), generator=gen).to(t.device)
            terms.append((t.float() * w).sum() / max(1, t.numel()) ** 0.5)
    if not terms:
        raise LayoutVerificationError(
            f"the model's output ({type(out).__name__}) holds no floating tensor that needs a "
            "gradient: nothing to verify a training step on; plan with train=False",
            cause="no output needs a gradient", fallback=False)
    return torch.stack(terms).sum()


@dataclass
class Step:
    """One verified training step's results: outputs, gradients (by parameter name, and per
    input), buffers after the step, and each parameter's gradient strides."""

    output: Any
    grads: dict[str, torch.Tensor | None]
    input_grads: list[torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    grad_strides: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # name -> (param, grad)


def training_step(module: nn.Module, inputs: tuple[Any, ...], *, dtype: torch.dtype | None,
                  names: list[str] | None = None, graph: fx.Graph | None = None,
                  upto: str | None = None, accumulate: bool = False,
                  device: torch.device | None = None) -> Step:
    """Forward (under autocast for ``dtype``) from the RNG state ``SEED``, ``training_loss``
    and backward, leaving the module's state as it was (buffers restored, ``.grad`` as
    before, the caller's RNG untouched). ``graph``/``upto``: run ``graph`` over ``module``
    only up to node ``upto`` and differentiate its value. ``accumulate``: gradients through
    ``.backward()`` into ``.grad`` (so their strides are what an optimizer and DDP see),
    else ``torch.autograd.grad``. Dropout draws its masks in logical order, whatever the
    activation's layout (``_LayoutFreeDropout``)."""
    device = device_of(inputs, module) if device is None else device
    params = dict(module.named_parameters())
    names = [k for k, p in params.items() if p.requires_grad] if names is None else names
    wrt = [params[k] for k in names if k in params]
    xs = tuple(x.detach().clone().requires_grad_(x.is_floating_point())
               if isinstance(x, torch.Tensor) else x for x in inputs)
    leaves = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
    with kept_state(module, list(params.values())), _LayoutFreeDropout():
        with torch.random.fork_rng(devices=_cuda_devices(device)):
            torch.manual_seed(SEED)
            with torch.enable_grad(), autocast(device, dtype):
                # non-leaf copies (same strides): a forward that works on its input in place
                # must not fail on a leaf that needs a gradient
                args = tuple(x.clone() if isinstance(x, torch.Tensor) and x.requires_grad
                             else x for x in xs)
                if graph is None:
                    out = module(*args)
                else:
                    try:
                        _UpTo(module, graph, upto or "").run(*args)
                        raise KeyError(upto)
                    except _Stop as stop:
                        out = stop.value
        with torch.enable_grad():  # the caller may be under no_grad (a replan in eval code)
            loss = training_loss(out)
            if accumulate:
                for p in wrt:
                    p.grad = None
                loss.backward()
                got: list[torch.Tensor | None] = [p.grad for p in wrt] + [x.grad for x in leaves]
            else:
                got = list(torch.autograd.grad(loss, [*wrt, *leaves], allow_unused=True))
        grads = dict(zip([k for k in names if k in params], got[:len(wrt)], strict=True))
        strides = {k: (tuple(p.stride()), tuple(g.stride()))
                   for k, p, g in zip(grads, wrt, got, strict=False) if g is not None}
        buffers = {k: b.detach().clone() for k, b in module.named_buffers()}
    return Step(detached(out), grads, got[len(wrt):], buffers, strides)


#: ``alpha_dropout``'s SELU constant (ATen's Dropout.cpp)
_SELU_ALPHA = 1.7580993408473766


class _LayoutFreeDropout(torch.overrides.TorchFunctionMode):
    """Element-wise dropout (``F.dropout``, ``nn.Dropout``, ``torch.dropout``, alpha dropout;
    functional or module) with its mask drawn in logical (NCHW) order, laid out like the
    activation: the same seed drops the same elements in every layout. PyTorch's own kernels
    draw in memory order, so on a channels-last activation the same seed drops other
    (equally random) elements than on the NCHW original (squeezenet1_0's classifier: relative
    error 0.8). The channel-wise kinds (``dropout2d``, feature alpha dropout) draw an
    (N, C, 1, ...) mask, the same in every layout: they run as they are."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        spec = _DROPOUTS.get(func)
        if spec is None:
            return func(*args, **(kwargs or {}))
        names, alpha, inplace, training = spec
        bound = dict(zip(names, args, strict=False)) | dict(kwargs or {})
        x, p = bound["input"], float(bound.get("p", 0.5))
        training = bound.get("training", bound.get("train", training))
        inplace = bool(bound.get("inplace", inplace))
        if not training or not 0 < p < 1:  # nothing drawn, or everything dropped
            return func(*args, **(kwargs or {}))
        keep = torch.empty_like(x, dtype=torch.bool).copy_(
            torch.rand(x.shape, device=x.device) >= p)
        if alpha:
            a = 1.0 / ((_SELU_ALPHA ** 2 * p + 1) * (1 - p)) ** 0.5
            scale = keep.to(x.dtype) * a
            shift = (keep.to(x.dtype) - 1) * (_SELU_ALPHA * a) + _SELU_ALPHA * a * p
            return x.mul_(scale).add_(shift) if inplace else x * scale + shift
        scale = keep.to(x.dtype) / (1 - p)
        return x.mul_(scale) if inplace else x * scale


#: element-wise dropouts: (argument names, alpha dropout, in place, training by default)
_DROPOUTS: dict[Any, tuple[tuple[str, ...], bool, bool, bool]] = {
    F.dropout: (("input", "p", "training", "inplace"), False, False, True),
    F.alpha_dropout: (("input", "p", "training", "inplace"), True, False, False),
    torch.dropout: (("input", "p", "train"), False, False, True),
    torch.dropout_: (("input", "p", "train"), False, True, True),
    torch.alpha_dropout: (("input", "p", "train"), True, False, True),
    torch.alpha_dropout_: (("input", "p", "train"), True, True, True),
}


def verify_training(reference: nn.Module, planned: nn.Module, inputs: tuple[Any, ...], *,
                    dtype: torch.dtype | None = None, reference_graph: fx.GraphModule | None = None,
                    planned_graph: fx.Graph | None = None, where: str = "",
                    device: torch.device | None = None) -> Verification:
    """One training step of each model from the same state and RNG state: outputs, every
    parameter's gradient (by name), every input's gradient and the buffers after the step
    (BatchNorm's running statistics) compared, and each planned parameter's gradient in its
    parameter's strides. Neither model's state changes.

    Every tensor agrees within the dtype's tolerance (``TOLERANCE``); or, failing that, the
    same two models run in float64 (copies, no autocast) agree within float32's. A layout
    changes no value in exact arithmetic, so the planned model in float64 equals the original
    to ~1e-13 and the low-precision difference is rounding: channels-last kernels accumulate
    in another order, and a training step through BatchNorm can amplify that past any fixed
    tolerance (shufflenet_v2 at 224, fp32: 0.1 on one gradient, eager NHWC alike), while a
    wrong rewrite differs in float64 by the size of the values.

    On a mismatch raises ``LayoutVerificationError`` naming the first node whose value or
    gradients differ (bisected in float64 over ``reference_graph``'s nodes, run as
    ``planned_graph``) when the graphs are given."""
    device = device_of(inputs, reference) if device is None else device
    want = training_step(reference, inputs, dtype=dtype, device=device)
    got = training_step(planned, inputs, dtype=dtype, names=list(want.grads), accumulate=True,
                        device=device)
    ok, worst, what, count = agree(want, got, dtype)
    bad_strides = [k for k, (ps, gs) in got.grad_strides.items()
                   if not strides_agree(tuple(got.grads[k].shape), ps, gs)]
    rtol = TOLERANCE.get(dtype or torch.float32, TOLERANCE[torch.float32])[0]
    exact: float | None = None
    if not ok:
        ref64, planned64, inputs64 = _float64(reference), _float64(planned), _float64(inputs)
        want64 = training_step(ref64, inputs64, dtype=None, device=device)
        got64 = training_step(planned64, inputs64, dtype=None, names=list(want64.grads),
                              device=device)
        ok, exact, what64, _ = agree(want64, got64, torch.float32)
        what = what if ok else what64
    if ok and not bad_strides:
        return Verification(True, worst, rtol, count, float64_error=exact)
    if ok:
        raise LayoutVerificationError(
            f"the planned model's gradients of {', '.join(bad_strides[:3])} come back in other "
            "strides than their parameters (an optimizer or DDP's gradient buckets would see "
            "them); the plan was not applied; please report this with the model",
            cause="gradients in other strides than their parameters")
    node = None
    if reference_graph is not None and planned_graph is not None:
        node = first_divergent_training(_float64(reference_graph), planned64,
                                        getattr(planned64, "graph", planned_graph), inputs64,
                                        device=device)
    where_text = f" in {where}" if where else ""
    named = (f"; first node whose value or gradients differ{where_text}: {node}" if node
             else "; the divergence could not be narrowed to one node")
    raise LayoutVerificationError(
        f"a training step of the planned model differs from the original's, in "
        f"{dtype or 'float32'} (relative error {worst:.3g}, tolerance {rtol:g}) and in float64 "
        f"(relative error {exact:.3g}, first in the {what}){named}. The plan was not applied; "
        "please report this with the model, or plan with measure=False to try another plan",
        cause=f"a training step differs, first in the {what}", node=node)


def agree(want: Step, got: Step, dtype: torch.dtype | None) -> tuple[bool, float, str, int]:
    """Compare two training steps tensor by tensor: ``(all agree, worst relative error,
    the first that does not, tensors compared)``."""
    pairs = _pairs(want, got)
    ok, worst, what = True, 0.0, ""
    for name, w, g in pairs:
        if g is _MISSING:
            fine, rel = False, float("inf")
        elif w is None or g is None:
            # which parameters get a gradient is part of the result (an optimizer steps those,
            # weight decay included); an input's absent gradient is a zero one
            fine = (w is None) == (g is None) or (
                name.startswith("gradient of input") and _is_zero(w if g is None else g))
            rel = 0.0 if fine else float("inf")
        else:
            fine = compare(w, g, dtype)[0]
            rel = _error_above_floor(w, g, dtype)
        if not fine and ok:
            what = name
        ok &= fine
        worst = max(worst, rel)
    return ok, worst, what, len(pairs)


def _pairs(want: Step, got: Step) -> list[tuple[str, Any, Any]]:
    ws, gs = list(iter_tensors(want.output)), list(iter_tensors(got.output))
    out: list[tuple[str, Any, Any]] = [
        (f"output {i}", w, gs[i] if i < len(gs) else _MISSING) for i, w in enumerate(ws)]
    out += [("gradient of " + k, w, got.grads.get(k, _MISSING)) for k, w in want.grads.items()]
    out += [(f"gradient of input {i}", w, got.input_grads[i] if i < len(got.input_grads)
             else _MISSING) for i, w in enumerate(want.input_grads)]
    out += [("buffer " + k, w, got.buffers.get(k, _MISSING)) for k, w in want.buffers.items()]
    return out


def float64_agreement(reference: nn.Module, planned: nn.Module, inputs: tuple[Any, ...], *,
                      device: torch.device | None = None) -> float | None:
    """The worst relative error between float64 copies of both models (no autocast) on
    float64 inputs, when within float32's tolerance; ``None`` when they differ there too. A
    layout changes no value in exact arithmetic: a plan whose outputs differ only by the run
    dtype's rounding (a deep bf16 network, where NHWC and NCHW kernels round differently)
    agrees in float64, a wrong rewrite does not. ``None`` too where a model cannot run in
    float64 (an exported graph holds the dtype of a cast as traced, ``x.to(torch.float32)``)."""
    xs = _float64(inputs)
    try:
        with torch.no_grad():
            want = _float64(reference)(*_clone(xs))
            got = _float64(planned)(*_clone(xs))
    except RuntimeError:  # a dtype fixed in the graph: no re-check, the mismatch stands
        return None
    ok, err, _ = compare(want, got, torch.float32)
    return err if ok else None


def _float64(value: Any) -> Any:
    """A float64 copy of a module (strides kept: ``Tensor.double`` preserves the format) or
    of inputs (floating tensors converted, others as they are)."""
    if isinstance(value, nn.Module):
        return copy.deepcopy(value).double()
    return tuple(x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                 for x in value)


def first_divergent_training(reference: fx.GraphModule, planned: nn.Module,
                             planned_graph: fx.Graph, inputs: tuple[Any, ...], *,
                             dtype: torch.dtype | None = None,
                             device: torch.device | None = None) -> str | None:
    """Bisect the reference's computing nodes for the first whose value, or the gradients
    it sends to the parameters and inputs before it, the planned graph computes
    differently; ``"name (op)"`` or ``None``. Run it on float64 copies (``dtype=None``):
    rounding then cannot pass for a divergence (compared with float32's tolerance)."""
    planned_names = {n.name for n in planned_graph.nodes}
    names = [n.name for n in reference.graph.nodes
             if n.op.startswith("call_") and n.name in planned_names]
    if not names:
        return None
    tolerance_of = dtype or torch.float32
    device = device_of(inputs, reference) if device is None else device

    def diverged(i: int) -> bool:
        try:
            want = training_step(reference, inputs, dtype=dtype, graph=reference.graph,
                                 upto=names[i], device=device)
        except LayoutVerificationError:  # no gradient flows out of this node: values only
            return _value_diverged(reference, planned, planned_graph, inputs, names[i], dtype,
                                   device)
        got = training_step(planned, inputs, dtype=dtype, graph=planned_graph, upto=names[i],
                            names=list(want.grads), device=device)
        return not agree(want, got, tolerance_of)[0]

    return _describe(reference, names[_bisect(len(names), diverged)])


def _value_diverged(reference: fx.GraphModule, planned: nn.Module, planned_graph: fx.Graph,
                    inputs: tuple[Any, ...], name: str, dtype: torch.dtype | None,
                    device: torch.device) -> bool:
    with kept_state(reference, []), kept_state(planned, []), torch.no_grad(), \
            autocast(device, dtype):
        with torch.random.fork_rng(devices=_cuda_devices(device)):
            torch.manual_seed(SEED)
            want = value_at(reference, reference.graph, name, inputs)
        with torch.random.fork_rng(devices=_cuda_devices(device)):
            torch.manual_seed(SEED)
            got = value_at(planned, planned_graph, name, inputs)
    return not compare(want, got, dtype)[0]


_MISSING: Any = object()


def _error_above_floor(want: torch.Tensor, got: torch.Tensor, dtype: torch.dtype | None) -> float:
    """The relative error, with the scale floored at ``atol / rtol``: a gradient that is
    zero up to rounding (a bias before BatchNorm) is not reported as a huge relative error."""
    if want.shape != got.shape:
        return float("inf")
    if not want.is_floating_point():
        return 0.0 if torch.equal(want, got) else 1.0
    rtol, atol = max(TOLERANCE.get(d, TOLERANCE[torch.float32])
                     for d in (want.dtype, got.dtype, dtype or want.dtype))
    a, b = want.detach().double().nan_to_num(), got.detach().double().nan_to_num()
    if not a.numel():
        return 0.0
    return (a - b).abs().max().item() / max(a.abs().max().item(), atol / rtol)


def _is_zero(t: torch.Tensor | None) -> bool:
    return t is None or t.numel() == 0 or not bool(t.detach().abs().max() > 0)


class kept_state:  # noqa: N801 (a context manager, used like a function)
    """Buffers restored on exit (a training-mode BatchNorm updates its running statistics),
    and ``.grad`` of ``params`` put back as it was."""

    def __init__(self, module: nn.Module, params: list[torch.Tensor]) -> None:
        self.buffers = [(b, b.detach().clone()) for b in module.buffers()]
        self.grads = [(p, p.grad) for p in params]

    def __enter__(self) -> kept_state:
        return self

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        for p, g in self.grads:
            p.grad = g


def _cuda_devices(device: torch.device) -> list[int]:
    return [device.index or 0] if device.type == "cuda" else []


def detached(value: Any) -> Any:
    """``value`` with every tensor detached (containers rebuilt, namedtuples kept)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, dict):
        return {k: detached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(detached(v) for v in value)
    return value


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
                    inputs: tuple[Any, ...], *, dtype: torch.dtype | None = None,
                    device: torch.device | None = None) -> str | None:
    """Bisect the reference's computing nodes for the first whose value the planned graph
    computes differently; ``"name (op)"`` or ``None``."""
    planned_names = {n.name for n in planned_graph.nodes}
    names = [n.name for n in reference.graph.nodes
             if n.op.startswith("call_") and n.name in planned_names]
    if not names:
        return None
    device = device_of(inputs, reference) if device is None else device

    def diverged(i: int) -> bool:
        with torch.no_grad(), autocast(device, dtype):
            want = value_at(reference, reference.graph, names[i], inputs)
            got = value_at(planned, planned_graph, names[i], inputs)
        return not compare(want, got, dtype)[0]

    return _describe(reference, names[_bisect(len(names), diverged)])


def _bisect(count: int, diverged: Callable[[int], bool]) -> int:
    """The first index in ``range(count)`` where ``diverged`` holds, assuming that once a node
    diverges every later one does; the last index when none does (the output differs only
    after the last node: blame the last).

    >>> _bisect(8, lambda i: i >= 5), _bisect(8, lambda i: False)
    (5, 7)
    """
    lo, hi = 0, count - 1
    if not diverged(hi):
        return hi
    while lo < hi:
        mid = (lo + hi) // 2
        if diverged(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _describe(gm: fx.GraphModule, name: str) -> str:
    node = next(n for n in gm.graph.nodes if n.name == name)
    return f"{name} ({node_target_name(gm, node)})"


def _clone(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)


# ---------------------------------------------------------------- semantics


@dataclass(frozen=True)
class ModuleState:
    """What a forward may change besides its output: every buffer's value (by name) and the
    plain attributes (numbers, strings, lists, dicts) of every submodule (by path)."""

    buffers: dict[str, torch.Tensor]
    attributes: dict[str, dict[str, Any]]


def _is_plain(value: Any, depth: int = 3) -> bool:
    """A number, string or ``None``, or a list / tuple / dict of them: state a forward may
    update that copying cannot detach from anything (a list of submodules is not plain)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if depth == 0 or not isinstance(value, (list, tuple, dict)):
        return False
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
    return all(_is_plain(v, depth - 1) for v in items)


def module_state(module: nn.Module) -> ModuleState:
    """A copy of ``module``'s state (see :class:`ModuleState`)."""
    buffers = {k: b.detach().clone() for k, b in module.named_buffers(remove_duplicate=False)}
    attributes = {path: {k: copy.deepcopy(v) for k, v in vars(m).items()
                         if not k.startswith("_") and k != "training" and _is_plain(v)}
                  for path, m in module.named_modules(remove_duplicate=False)}
    return ModuleState(buffers, attributes)


def restore_state(module: nn.Module, state: ModuleState) -> None:
    """Put ``state`` (taken from this module, or from the model it was planned from: same
    names) back into ``module``: buffer values copied in (in the buffer's own strides),
    attributes of the same name reset. Names ``module`` lacks are skipped."""
    with torch.no_grad():
        for name, b in module.named_buffers(remove_duplicate=False):
            saved = state.buffers.get(name)
            if saved is not None and saved.shape == b.shape and saved is not b:
                b.copy_(saved)
    for path, m in module.named_modules(remove_duplicate=False):
        for k, v in state.attributes.get(path, {}).items():
            if k in vars(m) and _is_plain(vars(m)[k]) and vars(m)[k] != v:
                m.__dict__[k] = copy.deepcopy(v)


@dataclass(frozen=True)
class Calls:
    """Two calls of a model from one state: each call's output, each call's inputs after it
    (a forward may change them in place), and the buffers after both."""

    outputs: tuple[Any, Any]
    inputs_after: tuple[tuple[Any, ...], tuple[Any, ...]]
    buffers: dict[str, torch.Tensor]


def call_twice(module: nn.Module, inputs: tuple[Any, ...], *, dtype: torch.dtype | None,
               device: torch.device, calls: int = 2) -> Calls:
    """``module`` called twice (``calls``: once; no grad, autocast for ``dtype``), each call
    on fresh copies of ``inputs`` from a fixed RNG state, element-wise dropout drawn in
    logical order, so two models in different layouts draw the same masks. The caller's RNG
    is left alone."""
    outputs, after = [], []
    for i in range(calls):
        xs = _clone(inputs)
        with torch.random.fork_rng(devices=_cuda_devices(device)), _LayoutFreeDropout():
            torch.manual_seed(SEED + i)
            with torch.no_grad(), autocast(device, dtype):
                outputs.append(detached(module(*xs)))
        after.append(xs)
    buffers = {k: b.detach().clone() for k, b in module.named_buffers(remove_duplicate=False)}
    return Calls((outputs[0], outputs[-1]), (after[0], after[-1]), buffers)


def check_semantics(want: Calls, got: Calls, dtype: torch.dtype | None, *,
                    inplace: tuple[str, ...] = ()) -> int:
    """Compare two calls of the planned model (``got``) with the original's (``want``),
    each from the caller's state: the second call's output (a forward that updates its own
    state), the inputs after each call (a forward that changes its input in place) and the
    buffers after both. Raises ``LayoutVerificationError`` saying which differs and why;
    returns the number of tensors compared. ``inplace``: the in-place ops on inputs the
    captured graph has (named when the inputs differ)."""
    rtol = TOLERANCE.get(dtype or torch.float32, TOLERANCE[torch.float32])[0]
    count = 0
    for i in range(2):
        ok, err, n = compare(want.inputs_after[i], got.inputs_after[i], dtype)
        count += n
        if not ok:
            why = (f"it changes its input in place ({', '.join(inplace)})" if inplace else
                   "it changes its input in place")
            exc = LayoutVerificationError(
                f"after a call, the caller's input tensors differ between the planned model and "
                f"the original by {err:.3g} (relative): {why}, and the planned model converts "
                "that input to another format first, so the change lands on a copy. Make the "
                "op out of place in forward (x = x * 2 instead of x.mul_(2)), or pass inputs "
                "already in the format the plan gives them; the plan was not applied",
                cause=f"the caller's inputs differ after a call: {why}", inputs_changed=True)
            raise exc
    ok, err, n = compare(want.outputs[1], got.outputs[1], dtype)
    count += n
    if not ok:
        raise LayoutVerificationError(
            f"the planned model's second call differs from the original's second call by "
            f"{err:.3g} (relative; tolerance {rtol:g}), its first call matched: the forward "
            "depends on state it changes per call (a counter, a cache) that the captured graph "
            "holds as a constant. Keep such state in a registered buffer updated with tensor "
            "ops, or plan the stateless part of the model; the plan was not applied",
            cause="the second call differs")
    for name, w in want.buffers.items():
        g = got.buffers.get(name)
        if g is None:
            continue  # a buffer the plan does not hold (the original's is unchanged state)
        ok, err, _ = compare(w, g, dtype)
        count += 1
        if not ok:
            raise LayoutVerificationError(
                f"buffer {name!r} after two calls differs between the planned model and the "
                f"original by {err:.3g} (relative): the planned model updates the model's state "
                "differently; the plan was not applied; please report this with the model",
                cause=f"buffer {name} differs after two calls")
    return count


def verify_semantics(original: nn.Module, planned: nn.Module, inputs: tuple[Any, ...],
                     state: ModuleState, want: Calls, *, dtype: torch.dtype | None,
                     device: torch.device, inplace: tuple[str, ...] = ()) -> int:
    """``check_semantics`` of two calls of ``planned`` from ``state`` against ``want`` (the
    original's two calls from it), then ``check_parameters``. As for a training step, values
    beyond the dtype's tolerance pass only if float64 copies of both models, from the same
    state, agree within float32's: rounding (a train-mode BatchNorm amplifies it) is not a
    difference, a wrong state update is. Returns the tensors and parameters checked."""
    restore_state(planned, state)
    got = call_twice(planned, inputs, dtype=dtype, device=device)
    try:
        count = check_semantics(want, got, dtype, inplace=inplace)
    except LayoutVerificationError:
        restore_state(original, state)
        restore_state(planned, state)
        xs = _float64(inputs)
        want64 = call_twice(_float64(original), xs, dtype=None, device=device)
        got64 = call_twice(_float64(planned), xs, dtype=None, device=device)
        count = check_semantics(want64, got64, torch.float32, inplace=inplace)
    return count + check_parameters(original, planned)


def state_changes(state: ModuleState, module: nn.Module) -> list[str]:
    """The buffers and attributes of ``module`` that differ from ``state`` (taken from it
    before it ran): what its forward changes per call."""
    changed = [k for k, b in module.named_buffers(remove_duplicate=False)
               if k in state.buffers and not torch.equal(state.buffers[k], b.detach())]
    for path, m in module.named_modules(remove_duplicate=False):
        saved = state.attributes.get(path, {})
        changed += [f"{path}.{k}" if path else k for k, v in saved.items()
                    if k in vars(m) and vars(m)[k] != v]
    return changed


def check_parameters(original: nn.Module, planned: nn.Module) -> int:
    """The planned model holds the original's parameters as the original does: every name,
    one tensor for names that share one (tied weights stay tied), the same
    ``requires_grad``. Raises ``LayoutVerificationError``; returns the parameters checked."""
    want = dict(original.named_parameters(remove_duplicate=False))
    got = dict(planned.named_parameters(remove_duplicate=False))
    missing = [k for k in want if k not in got]
    if missing:
        raise LayoutVerificationError(
            f"the planned model lacks the original's parameters {missing[:3]}: its state_dict "
            "would not load; the plan was not applied; please report this with the model",
            cause="parameters missing")
    groups: dict[int, list[str]] = {}
    for k, p in want.items():
        groups.setdefault(id(p), []).append(k)
    for names in groups.values():
        if len({id(got[k]) for k in names}) > 1:
            raise LayoutVerificationError(
                f"the original shares one parameter between {', '.join(names)} (tied weights); "
                "the planned model holds separate tensors for them, which a training step "
                "would update apart; the plan was not applied; please report this with the model",
                cause="tied weights untied")
    tied = {id(got[k]) for k in want}
    if len(tied) != len(groups):
        raise LayoutVerificationError(
            f"the planned model ties parameters the original keeps apart ({len(groups)} "
            f"parameters in the original, {len(tied)} planned); the plan was not applied",
            cause="parameters tied that were not")
    flipped = [k for k, p in want.items() if p.requires_grad != got[k].requires_grad]
    if flipped:
        raise LayoutVerificationError(
            f"the planned model's parameters {flipped[:3]} differ in requires_grad from the "
            "original's; the plan was not applied; please report this with the model",
            cause="requires_grad differs")
    return len(groups)


#: in-place operators of Python (``x += y`` traces to ``operator.iadd``)
_INPLACE_OPERATORS = {"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow",
                      "iand", "ior", "ixor", "ilshift", "irshift", "imatmul"}


def mutates_in_place(gm: fx.GraphModule, n: fx.Node) -> bool:
    """``n`` writes into its first argument: a trailing-underscore method or function
    (``x.mul_``, ``torch.relu_``), ``inplace=True``, an in-place operator (``x += 1``), or a
    module configured in place (``nn.ReLU(inplace=True)``)."""
    if n.op == "call_module":
        return bool(getattr(gm.get_submodule(str(n.target)), "inplace", False))
    if n.op not in ("call_method", "call_function"):
        return False
    if n.kwargs.get("inplace") is True:
        return True
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    return name in _INPLACE_OPERATORS or (name.endswith("_") and not name.endswith("__"))


def inplace_on_inputs(gm: fx.GraphModule) -> list[str]:
    """The nodes of ``gm`` that change one of its inputs in place: ``"mul_ (.mul_) on x"``."""
    found = []
    for n in gm.graph.nodes:
        first = n.args[0] if n.args else None
        if isinstance(first, fx.Node) and first.op == "placeholder" and mutates_in_place(gm, n):
            found.append(f"{n.name} ({node_target_name(gm, n)}) on input {first.name}")
    return found
