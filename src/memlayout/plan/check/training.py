"""One verified training step (L2 plan, check): both models from one state and seed, a loss that
gives every output element its own gradient, dropout masks drawn in logical order; outputs,
gradients and buffers compared, with the float64 re-check."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from memlayout.devices import seam
from memlayout.dtypes import autocast
from memlayout.errors import LayoutVerificationError, first_line
from memlayout.layout import dim_order, strides_agree
from memlayout.plan.compare import (
    TOLERANCE,
    compare,
    detached,
    float64,
    float64_casts,
    rounding_only,
    tolerance,
)
from memlayout.plan.report.records import DTYPE_TOLERANCE, FLOAT64_RECHECK, Verification
from memlayout.plan.steer.draws import drawing
from memlayout.plan.steer.state import propagated_format
from memlayout.tensors import clone_inputs, device_of, iter_tensors

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
                  names: list[str] | None = None,
                  device: torch.device | None = None) -> Step:
    """Forward (under autocast for ``dtype``) from the RNG state ``SEED``, ``training_loss``
    and backward, leaving the module's state as it was (buffers restored, ``.grad`` as
    before, the caller's RNG untouched). Gradients go through ``.backward()`` into ``.grad``,
    as an optimizer and DDP see them (their strides too; reentrant activation checkpointing
    takes no other way). Dropout draws its masks in logical order, whatever the activation's
    layout (``_LayoutFreeDropout``)."""
    device = device_of(inputs, module) if device is None else device
    params = dict(module.named_parameters())
    names = [k for k, p in params.items() if p.requires_grad] if names is None else names
    wrt = [params[k] for k in names if k in params]
    xs = tuple(x.detach().clone().requires_grad_(x.is_floating_point())
               if isinstance(x, torch.Tensor) else x for x in inputs)
    leaves = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
    with kept_state(module, list(params.values())), _LayoutFreeDropout():
        with seam(device).fork_rng():
            torch.manual_seed(SEED)
            with torch.enable_grad(), autocast(device, dtype):
                # non-leaf copies (same strides): a forward that works on its input in place
                # must not fail on a leaf that needs a gradient
                args = clone_inputs(xs, requires_grad_only=True)
                out = module(*args)
        with torch.enable_grad():  # the caller may be under no_grad (a replan in eval code)
            loss = training_loss(out)
            for p in params.values():
                p.grad = None
            loss.backward()
            got: list[torch.Tensor | None] = [p.grad for p in wrt] + [x.grad for x in leaves]
        grads = dict(zip([k for k in names if k in params], got[:len(wrt)], strict=True))
        strides = {k: (tuple(p.stride()), tuple(g.stride()))
                   for k, p, g in zip(grads, wrt, got, strict=False) if g is not None}
        buffers = {k: b.detach().clone() for k, b in module.named_buffers()}
    return Step(detached(out), grads, got[len(wrt):], buffers, strides)


#: ``alpha_dropout``'s SELU constant (ATen's Dropout.cpp)
_SELU_ALPHA = 1.7580993408473766


@dataclass(frozen=True)
class Draw:
    """One element-wise random mask drawn (a dropout's): the module that drew it, as
    ``"path (Class)"``, and the shape and strides of the activation it is laid out like."""

    module: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def order(self) -> tuple[int, ...]:
        """The order PyTorch's kernels draw the mask in: the activation's memory order (its
        dims of size > 1, outermost first).

        >>> Draw("drop (Dropout)", (2, 8, 4, 4), (128, 1, 32, 8)).order
        (0, 2, 3, 1)
        """
        return tuple(d for d in dim_order(self.shape, self.strides) if self.shape[d] > 1)

    @property
    def format(self) -> str:
        """The memory format torch reads from the activation's strides (its mask's order).

        >>> Draw("drop (Dropout)", (2, 8, 4, 4), (128, 1, 32, 8)).format
        'channels_last'
        """
        return propagated_format(torch.empty_strided(self.shape, self.strides, device="meta"))


def redrawn(want: tuple[Draw, ...], got: tuple[Draw, ...]) -> tuple[str, ...]:
    """The modules (each once, in call order) whose masks ``got`` (the planned model's
    draws) draws in another memory order than ``want`` (the original's, on the same input):
    with the same seed, PyTorch's kernels drop other (equally random) elements there.

    >>> nchw = Draw("drop (Dropout)", (2, 8, 4, 4), (128, 16, 4, 1))
    >>> nhwc = Draw("drop (Dropout)", (2, 8, 4, 4), (128, 1, 32, 8))
    >>> redrawn((nchw, nchw), (nhwc, nchw)), redrawn((nchw,), (nchw,))
    (('drop (Dropout)',), ())
    """
    found: list[str] = []
    for w, g in zip(want, got, strict=False):
        if w.shape == g.shape and w.order != g.order and g.module not in found:
            found.append(g.module)
    return tuple(found)


class _LayoutFreeDropout(torch.overrides.TorchFunctionMode):
    """Element-wise dropout (``F.dropout``, ``nn.Dropout``, ``torch.dropout``, alpha dropout;
    functional or module) with its mask drawn in logical (NCHW) order, laid out like the
    activation: the same seed drops the same elements in every layout. PyTorch's own kernels
    draw in memory order, so on a channels-last activation the same seed drops other
    (equally random) elements than on the NCHW original (squeezenet1_0's classifier: relative
    error 0.8). The channel-wise kinds (``dropout2d``, feature alpha dropout) draw an
    (N, C, 1, ...) mask, the same in every layout: they run as they are.

    With ``model``, each mask drawn while active is recorded in ``draws`` (a :class:`Draw`,
    named by the innermost module of ``model`` running): where a planned model's masks at
    run time differ from the original's (:func:`redrawn`)."""

    def __init__(self, model: nn.Module | None = None) -> None:
        super().__init__()
        self.model = model
        self.draws: list[Draw] = []
        self._running: list[str] = []  # the module calls in progress, innermost last
        self._hooks: list[Any] = []

    def __enter__(self) -> _LayoutFreeDropout:
        for path, m in self.model.named_modules() if self.model is not None else ():
            name = f"{path or 'the model'} ({type(m).__name__})"
            self._hooks += [m.register_forward_pre_hook(partial(self._enter_module, name)),
                            m.register_forward_hook(self._exit_module, always_call=True)]
        return super().__enter__()

    def _enter_module(self, name: str, *_: Any) -> None:
        self._running.append(name)

    def _exit_module(self, *_: Any) -> None:  # returns None: the output stays the module's
        self._running.pop()

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        drawn = drawing(func, args, dict(kwargs or {}))
        if drawn is None:  # no dropout, nothing drawn, or everything dropped
            return func(*args, **(kwargs or {}))
        x, p, alpha, inplace = drawn
        if self.model is not None:
            where = self._running[-1] if self._running else "the model"
            self.draws.append(Draw(where, tuple(x.shape), tuple(x.stride())))
        keep = torch.empty_like(x, dtype=torch.bool).copy_(
            torch.rand(x.shape, device=x.device) >= p)
        if alpha:
            a = 1.0 / ((_SELU_ALPHA ** 2 * p + 1) * (1 - p)) ** 0.5
            scale = keep.to(x.dtype) * a
            shift = (keep.to(x.dtype) - 1) * (_SELU_ALPHA * a) + _SELU_ALPHA * a * p
            return x.mul_(scale).add_(shift) if inplace else x * scale + shift
        scale = keep.to(x.dtype) / (1 - p)
        return x.mul_(scale) if inplace else x * scale


def verify_training(reference: nn.Module, planned: nn.Module, inputs: tuple[Any, ...], *,
                    dtype: torch.dtype | None = None,
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
    tolerance, while a wrong plan differs in float64 by the size of the values; and the
    planned step is no farther from the float64 one than rounding takes the original's
    (``compare.rounding_only``: a kernel wrong in the run dtype alone). On a mismatch
    raises ``LayoutVerificationError`` naming the first tensor that differs."""
    device = device_of(inputs, reference) if device is None else device
    try:
        want = training_step(reference, inputs, dtype=dtype, device=device)
    except RuntimeError as exc:  # autograd refuses the original's own step: nothing to compare
        raise LayoutVerificationError(
            f"a training step of the original model itself fails (RuntimeError: "
            f"{first_line(exc)}), "
            "so there is no step to verify a plan against; the original's backward fails the "
            "same way: fix the forward (an in-place change of a tensor autograd saved, say), "
            "or plan inference with train=False",
            cause="the original's own training step fails", fallback=False) from exc
    got = training_step(planned, inputs, dtype=dtype, names=list(want.grads), device=device)
    ok, worst, what, count = agree(want, got, dtype)
    bad_strides = [k for k, (ps, gs) in got.grad_strides.items()
                   if not strides_agree(tuple(got.grads[k].shape), ps, gs)]
    rtol = tolerance(dtype)[0]
    exact: float | None = None
    unchecked = ""  # why the float64 re-check could not run
    farther = False  # equal in float64, yet farther from it than the original's own rounding
    if not ok:
        ref64, planned64, inputs64 = float64(reference), float64(planned), float64(inputs)
        try:
            with float64_casts():
                want64 = training_step(ref64, inputs64, dtype=None, device=device)
                got64 = training_step(planned64, inputs64, dtype=None,
                                      names=list(want64.grads), device=device)
        except RuntimeError as exc:  # a dtype the model fixes otherwise: the mismatch stands
            unchecked = first_line(exc)
        else:
            ok, exact, what64, _ = agree(want64, got64, torch.float32)
            what = what if ok else what64
            if ok and not rounding_only(agree(want64, want, dtype)[1],
                                        agree(want64, got, dtype)[1], dtype):
                ok, farther = False, True
    if ok and not bad_strides:
        return Verification(True, DTYPE_TOLERANCE if exact is None else FLOAT64_RECHECK, worst,
                            rtol, count, train=True, float64_error=exact)
    if ok:
        raise LayoutVerificationError(
            f"the planned model's gradients of {', '.join(bad_strides[:3])} come back in other "
            "strides than their parameters (an optimizer or DDP's gradient buckets would see "
            "them); the plan was not applied; please report this with the model",
            cause="gradients in other strides than their parameters")
    in_float64 = ("though equal in float64: farther from it than rounding takes the "
                  "original's own step (a kernel wrong in this dtype)" if farther
                  else f"and in float64 (relative error {exact:.3g}, first in the {what})"
                  if exact is not None else
                  f"first in the {what}; the float64 re-check could not run the models "
                  f"(RuntimeError: {unchecked})")
    raise LayoutVerificationError(
        f"a training step of the planned model differs from the original's, in "
        f"{dtype or 'float32'} (relative error {worst:.3g}, tolerance {rtol:g}) {in_float64}. "
        "The plan was not applied; please report this with the model, or plan with "
        "measure=False to try another plan",
        cause=f"a training step differs, first in the {what}"
              + ("" if exact is not None else " (no float64 re-check)"))


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


_MISSING: Any = object()


def _pairs(want: Step, got: Step) -> list[tuple[str, Any, Any]]:
    ws, gs = list(iter_tensors(want.output)), list(iter_tensors(got.output))
    out: list[tuple[str, Any, Any]] = [
        (f"output {i}", w, gs[i] if i < len(gs) else _MISSING) for i, w in enumerate(ws)]
    out += [("gradient of " + k, w, got.grads.get(k, _MISSING)) for k, w in want.grads.items()]
    out += [(f"gradient of input {i}", w, got.input_grads[i] if i < len(got.input_grads)
             else _MISSING) for i, w in enumerate(want.input_grads)]
    out += [("buffer " + k, w, got.buffers.get(k, _MISSING)) for k, w in want.buffers.items()]
    return out


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

