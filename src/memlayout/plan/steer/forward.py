"""The forward of a steered module (application): the module's own ``forward``, with the plan's
conversions at its boundary.

A steered module gets an instance attribute ``forward``, a :class:`SteeredForward` that
converts what its plan says on the way in and out and otherwise calls the class's ``forward``
(or the instance ``forward`` the module already had: an accelerate hook, say). It is not one of
the module's hooks (``_forward_hooks`` and ``_forward_pre_hooks`` stay the user's: pre-hooks
see the arguments as the caller passed them, hooks see the results the steered module
returns), it is copied by ``copy.deepcopy`` and pickled with the module (``torch.save``), and
``inspect.signature(module.forward)`` is the original's. Which plan's conversions apply is the
one the root's call chose (:class:`~memlayout.plan.steer.state.PlannedState`).

The root of a planned model gets a :class:`RootForward`: it chooses the plan for the call's
input shapes (planning a new shape on first sight), converts inputs to the plan's input
format, runs under the plan's autocast dtype, and hands results back in the strides the
original model returns them in.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from memlayout.plan.steer.boundary import Boundary, convert_leaf, to_label
from memlayout.tensors import iter_tensors, map_tensors

if TYPE_CHECKING:
    from memlayout.plan.steer.state import PlannedState


class SteeredForward:
    """``module``'s forward with the conversions of its :class:`Boundary` for each plan (by
    the plan's key)."""

    def __init__(self, module: nn.Module, state: PlannedState, inner: Any = None) -> None:
        self.module = module
        self.state = state
        self.inner = inner  # an instance forward the module had before it was steered
        self.boundaries: dict[Any, Boundary] = {}
        self._padded: tuple[Any, torch.Tensor, torch.Tensor | None] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        boundary = self.boundaries.get(self.state.active) if self.state.enabled else None
        if boundary is None:
            return self.call(args, kwargs)
        args, kwargs = boundary.enter(args, kwargs)
        if boundary.weight_label is not None or boundary.padding is not None:
            return boundary.exit(self._compute(boundary, args, kwargs))
        return boundary.exit(self.call(args, kwargs))

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The module's own forward."""
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.inner if self.inner is not None
                                 else type(self.module).forward.__get__(self.module))

    @property
    def __doc__(self) -> str | None:  # type: ignore[override]
        return type(self.module).forward.__doc__

    @property
    def __code__(self) -> Any:
        # what runs is the original's code: tracers that name it (torch.export) see it
        inner = self.inner if self.inner is not None else type(self.module).forward
        return getattr(getattr(inner, "func", inner), "__code__", None)

    def _compute(self, boundary: Boundary, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A convolution whose weight is converted per call (``weights="contiguous"``: the
        stored weight stays contiguous), or that runs with padded channels."""
        conv = self.module
        (x,) = args
        if boundary.padding is None:
            return conv._conv_forward(x, to_label(conv.weight, boundary.weight_label),  # type: ignore[operator]
                                      conv.bias)
        pad_in, pad_out = boundary.padding
        w, b = conv.weight, conv.bias
        stamp = (w.data_ptr(), w._version, None if b is None else (b.data_ptr(), b._version),
                 pad_in, pad_out)
        if self._padded is None or self._padded[0] != stamp:  # the weights changed: again
            self._padded = (stamp, *padded_weights(conv, pad_in, pad_out))  # type: ignore[arg-type]
        return padded_convolution(conv, x, self._padded[1], self._padded[2], pad_in, pad_out)  # type: ignore[arg-type]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_padded"] = None  # made again on first use
        return state


class RootForward(SteeredForward):
    """The root's forward: the plan chosen for the call, inputs in the plan's input format,
    the plan's autocast, and results in the strides the original returns."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = self.state
        if not state.enabled:
            return self.call(args, kwargs)
        key = state.key_for(self.module, args, kwargs)
        previous = state.activate(key)
        try:
            args, kwargs = state.arrive(args, kwargs)
            with state.autocast(args, kwargs):
                output = super().__call__(*args, **kwargs)
            return state.restride(output, key, (args, kwargs))
        finally:
            state.activate(previous)


def steered(module: nn.Module) -> SteeredForward | None:
    """The :class:`SteeredForward` of ``module``, ``None`` when it is not steered."""
    forward = module.__dict__.get("forward")
    return forward if isinstance(forward, SteeredForward) else None


def restride(output: Any, formats: tuple[tuple[int, int, int], ...],
             fallback: int | None = None, keep: set[int] | None = None,
             ranks: tuple[int, ...] = (4, 5)) -> Any:
    """``output`` with its tensors in the formats the original hands them back in.

    ``formats``: ``(index, label, rank)`` of every tensor of the original's output on the
    plan's example, in ``memlayout.tensors.iter_tensors`` order (label ``-1``: as it comes).
    Where this output's tensors are not those (another structure: a flag read in forward
    returns features instead of logits), every tensor of a layout rank goes to ``fallback``
    (the format the call's input came in: what the original, fed it, returns), except those
    whose memory is in ``keep`` (the inputs' storage: a view of an input stays one);
    ``ranks``: the layout ranks planned."""
    if not formats:
        return output
    tensors = list(iter_tensors(output))
    if [r for _, _, r in formats] == [t.dim() for t in tensors]:
        wanted = {i: label for i, label, _ in formats if label >= 0}
    elif fallback is not None and keep is not None:
        wanted = {i: fallback for i, t in enumerate(tensors)
                  if t.dim() in ranks and not storage_addresses(t) & keep}
    else:
        return output
    if all(i not in wanted or convert_leaf(t, wanted[i], t.dim()) is t
           for i, t in enumerate(tensors)):
        return output
    count = iter(range(len(tensors)))

    def fix(t: torch.Tensor) -> torch.Tensor:
        i = next(count)
        return convert_leaf(t, wanted[i], t.dim()) if i in wanted else t

    return map_tensors(output, fix)


def storage_addresses(value: Any) -> set[int]:
    """The storage addresses of the tensors in ``value`` (eager only: a tracer cannot read them)."""
    found = set()
    for t in pytree.tree_leaves(value):
        if isinstance(t, torch.Tensor):
            with contextlib.suppress(RuntimeError, NotImplementedError):  # no storage: sparse
                found.add(t.untyped_storage().data_ptr())
    return found


def padded_weights(conv: nn.Conv2d, pad_in: int, pad_out: int
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``conv``'s weight (in its format) and bias with zero channels added up to ``pad_in``
    inputs and ``pad_out`` outputs."""
    with torch.no_grad():
        w = conv.weight.detach()
        fmt = _memory_format(w)
        padded = w.new_zeros((max(pad_out, conv.out_channels), max(pad_in, conv.in_channels),
                              *w.shape[2:]))
        padded[: w.shape[0], : w.shape[1]] = w
        bias = None
        if conv.bias is not None:
            bias = conv.bias.detach().new_zeros(padded.shape[0])
            bias[: conv.out_channels] = conv.bias.detach()
    return padded.contiguous(memory_format=fmt), bias


def padded_convolution(conv: nn.Conv2d, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None, pad_in: int, pad_out: int) -> torch.Tensor:
    """``conv(x)`` computed with padded channels: ``x`` widened with zero channels to
    ``pad_in``, the padded ``weight`` and ``bias`` (:func:`padded_weights`), the output cropped
    back to ``conv.out_channels``, in ``x``'s format. Zeros add nothing: the values are
    ``conv(x)``'s, up to summation order."""
    fmt = _memory_format(x)
    if pad_in > conv.in_channels:
        n, c, h, w = x.shape
        wide = x.new_zeros((n, pad_in, h, w)).contiguous(memory_format=fmt)
        wide[:, :c] = x
        x = wide
    if weight.dtype != x.dtype and not torch.is_autocast_enabled():
        weight = weight.to(x.dtype)
    y = torch.nn.functional.conv2d(x, weight, bias, conv.stride, conv.padding, conv.dilation,
                                   conv.groups)
    if pad_out > conv.out_channels:
        y = y[:, : conv.out_channels].contiguous(memory_format=_memory_format(y))
    return y


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format
