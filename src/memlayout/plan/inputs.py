"""A planning run's inputs (L2 plan): the example as ``forward's positional arguments, keyword
inputs as trailing ones (:class:`KeywordCall`), formats requested by name, and the checks that
refuse, before any work, what cannot be planned (the meta device)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memlayout.errors import LayoutError, PlanError
from memlayout.layout import Format
from memlayout.plan.convert import convert_value
from memlayout.plan.graph import Label
from memlayout.tensors import clone_inputs, iter_tensors, meta_weights


def check_materialized(model: nn.Module, inputs: tuple[Any, ...]) -> None:
    """``PlanError`` before any work for a model or input on the meta device: it has shapes
    but no values, so nothing can be measured or verified."""
    meta = meta_weights(model)
    if meta:
        raise PlanError(
            f"{type(model).__name__} has {meta}: they have shapes but no values, so nothing "
            "can be measured or verified. Materialize "
            "the weights first, e.g. model.to_empty(device='cpu') then initialize them "
            "(reset_parameters() per module, or load_state_dict from a checkpoint)")
    if any(t.is_meta for t in iter_tensors(inputs)):
        raise PlanError("example_inputs are on the meta device (shapes without values): pass "
                        "real tensors, e.g. torch.randn(shape), on the model's device")


def example_inputs_of(example_inputs: Any) -> tuple[Any, ...]:
    """``forward``'s positional arguments from an example (a tensor or a tuple), cloned."""
    if isinstance(example_inputs, torch.Tensor):
        return clone_inputs((example_inputs,))
    if isinstance(example_inputs, (tuple, list)) and example_inputs:
        return clone_inputs(example_inputs)
    raise PlanError(
        f"example_inputs must be a tensor or a non-empty tuple of forward's positional "
        f"arguments, got {type(example_inputs).__name__}"
    )


def format_label(fmt: str | Format | None, what: str) -> Label | None:
    """The label of a requested input or output format; ``PlanError`` for a format the
    planner does not take (channels_last_1d: 1-d models are planned from the costs only)."""
    if fmt is None:
        return None
    try:
        parsed = Format.parse(fmt)
    except LayoutError as exc:
        raise PlanError(f"{what} {fmt!r}: {exc}") from None
    if parsed is Format.CHANNELS_LAST_1D:
        raise PlanError(f"{what} {fmt!r}: the planner handles contiguous and channels_last(_3d)")
    return Label.parse(parsed)


class KeywordCall(nn.Module):
    """``module`` called with keyword inputs as trailing positional arguments, so that every
    step of the planner passes one tuple of inputs: ``KeywordCall(unet, ("encoder_hidden_states",),
    {"return_dict": False})(sample, t, e)`` is ``unet(sample, t, encoder_hidden_states=e,
    return_dict=False)``. ``state_dict`` keys and attributes are ``module``'s.

    >>> conv = nn.Conv2d(3, 4, 1)
    >>> call = KeywordCall(conv, ("input",), {})
    >>> call(torch.ones(1, 3, 2, 2)).shape, call.in_channels, list(call.state_dict())
    (torch.Size([1, 4, 2, 2]), 3, ['weight', 'bias'])
    """

    def __init__(self, module: nn.Module, keywords: tuple[str, ...],
                 constants: dict[str, Any], positional: int | None = None) -> None:
        super().__init__()
        self.module = module
        self.__dict__["keywords"] = tuple(keywords)
        self.__dict__["n_positional"] = positional  # forward's positional inputs, if known
        self.__dict__["constants"] = dict(constants)
        self._register_state_dict_hook(_strip_prefix)
        self._register_load_state_dict_pre_hook(_add_prefix)

    def forward(self, *args: Any) -> Any:
        n = len(args) - len(self.keywords)
        return self.module(*args[:n], **dict(zip(self.keywords, args[n:], strict=True)),
                           **self.constants)

    def positional(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """A call's ``args, kwargs`` as this module's positional inputs; a call already in
        them (every input positional, as the planner's own steps and timers call) as is."""
        if not kwargs and self.n_positional is not None and \
                len(args) == self.n_positional + len(self.keywords):
            return args
        given = {k: v for k, v in kwargs.items() if k not in self.constants}
        same = all(k in kwargs and _same(kwargs[k], v) for k, v in self.constants.items())
        if set(given) != set(self.keywords) or not same:
            raise PlanError(
                f"this model was planned for the keyword inputs {list(self.keywords)} "
                f"(and {self.constants or 'no other keywords'}); called with {sorted(kwargs)}. "
                "Plan again with the keyword arguments it is called with")
        return (*args, *(given[k] for k in self.keywords))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return a is b


def keyword_call(model: nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[nn.Module, tuple[Any, ...]]:
    """``model`` and its example as positional inputs: keyword values holding tensors
    become trailing inputs, the others constants of every call (``return_dict=False``)."""
    if not kwargs:
        return model, args
    keywords = tuple(k for k, v in kwargs.items() if next(iter_tensors(v), None) is not None)
    constants = {k: v for k, v in kwargs.items() if k not in keywords}
    return KeywordCall(model, keywords, constants, len(args)), \
        (*args, *(kwargs[k] for k in keywords))


def _strip_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                  local_metadata: Any) -> None:
    inner = prefix + "module."
    items = list(state_dict.items())
    state_dict.clear()
    for k, v in items:
        state_dict[prefix + k[len(inner):] if k.startswith(inner) else k] = v
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        for k in [k for k in meta if k.startswith(inner[:-1])]:
            meta[prefix + k[len(inner):] if k.startswith(inner) else prefix[:-1]] = meta.pop(k)


def _add_prefix(state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    inner = prefix + "module."
    for k in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + k[len(prefix):]] = state_dict.pop(k)


def inputs_in(inputs: tuple[Any, ...], label: Label, ranks: tuple[int, ...]) -> tuple[Any, ...]:
    """``inputs`` with every tensor of a layout rank in ``ranks`` in ``label``'s format; the
    same tensor when it already is."""
    return convert_value(tuple(inputs), label, ranks)
