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

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memlayout.errors import ScriptError
from memlayout.plan.steer.boundary import (
    Boundary,
    padded_convolution,
    padded_weights,
    to_label,
)

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
    def __globals__(self) -> dict[str, Any]:
        # what torch.jit.script reads first of a forward it compiles from source
        name = type(self.module).__name__
        raise ScriptError(
            f"torch.jit.script cannot compile a planned {name}: its layouts are steered by "
            "memlayout's Python forward, which TorchScript cannot read. Use "
            "torch.jit.trace(planned, example) or torch.export.export(planned, (example,)) "
            "(both record the planned layouts), or script the original model")

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
            with state.autocast(args, kwargs), state.draws(key):
                output = super().__call__(*args, **kwargs)
            return state.restride(output, key, (args, kwargs), self.module)
        finally:
            state.activate(previous)


def steered(module: nn.Module) -> SteeredForward | None:
    """The :class:`SteeredForward` of ``module``, ``None`` when it is not steered."""
    forward = module.__dict__.get("forward")
    return forward if isinstance(forward, SteeredForward) else None










