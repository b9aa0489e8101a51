"""The planned model (L2 plan): :class:`OptimizedModule`, the input shape signature a plan is
made for, and the state-dict hooks that keep the original model's keys.

>>> shape_signature((torch.zeros(2, 3, 8, 8),))
(((2, 3, 8, 8), 'float32', 'cpu'),)
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memlayout.dtypes import autocast
from memlayout.errors import MemlayoutError, PlanError
from memlayout.plan.convert import convert_value
from memlayout.plan.graph import Label
from memlayout.tensors import device_of, iter_tensors, torch_memory_format

if TYPE_CHECKING:
    from memlayout.plan.report.result import Plan

#: plans a new input shape on the optimized module's live weights: ``(optimized, args) ->
#: (module, plan)``; ``.base`` runs the original model's computation on the same weights
Replanner = Callable[["OptimizedModule", tuple[Any, ...]], tuple[nn.Module, "Plan"]]


Signature = tuple[tuple[tuple[int, ...], str, str], ...]


def shape_signature(args: Any) -> Signature:
    """What a plan is made for: shape, dtype and device of every tensor argument.

    >>> shape_signature((torch.zeros(2, 3, 8, 8),))
    (((2, 3, 8, 8), 'float32', 'cpu'),)
    """
    return tuple((tuple(t.shape), str(t.dtype).removeprefix("torch."), str(t.device))
                 for t in iter_tensors(args))


def _call_signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Signature:
    """``shape_signature((args, kwargs))``, without walking the structure in the common call
    of plain tensor arguments (this runs on every forward)."""
    if not kwargs and all(type(a) is torch.Tensor for a in args):
        return shape_signature(args)
    return shape_signature((args, kwargs))


def _arrive(args: tuple[Any, ...], label: int, ranks: tuple[int, ...]) -> tuple[Any, ...]:
    """``args`` with their layout-rank tensors in ``label``'s format, as a plan's inputs
    arrive; ``args`` themselves when every one already is dense in it (the usual call: one
    stride check per tensor, no walk through ``to_format``)."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() in ranks:
            # torch's memory format, where ``Tensor.is_contiguous`` can check it (not rank 3)
            fmt = torch_memory_format(Label(label).format(a.dim()))
            if fmt is None or not a.is_contiguous(memory_format=fmt):
                return inputs_in(args, label, ranks)
        elif not isinstance(a, torch.Tensor) and isinstance(a, (tuple, list)):
            return inputs_in(args, label, ranks)
    return args


class OptimizedModule(nn.Module):
    """The planned model: runs eagerly with the planned layouts (under autocast when planned
    with a dtype); ``state_dict`` keys are the original model's, so state dicts load both
    ways. ``.plan`` is the :class:`Plan` of the example's shape.

    A call whose input shape signature (:func:`shape_signature`) differs from the example's
    is planned on first sight (see ``optimize``'s ``max_plans``): ``.plans`` maps each
    signature held to its plan, ``.replans`` counts the plans made after the example's. A
    shape whose plan fails (capture or verification) runs the original model's computation
    on the same weights, with a warning, and is not planned again.

    >>> from memlayout.plan.pipeline import optimize
    >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    >>> opt = optimize(net, torch.randn(2, 3, 8, 8), train=True, measure=False, cache=False)
    >>> opt(torch.randn(3, 3, 8, 8)).sum().backward()  # batch 3: planned now, once
    >>> opt.replans, [p.input_shapes for p in opt.plans.values()]
    (1, [[[2, 3, 8, 8]], [[3, 3, 8, 8]]])
    """

    def __init__(self, module: nn.Module, plan: Plan, dtype: torch.dtype | None, *,
                 replan: Replanner | None = None, max_plans: int = 8,
                 signature: Signature | None = None,
                 ranks: tuple[int, ...] = (4, 5)) -> None:
        super().__init__()
        self.module = module
        self.plan = plan
        self.autocast_dtype = dtype
        self.max_plans = max_plans
        self.replans = 0
        self.__dict__["_replan"] = replan  # plain attributes, not children: one set of weights
        self.__dict__["_signature"] = signature
        self.__dict__["_shapes"] = OrderedDict()  # signature -> (module, plan), LRU order
        self.__dict__["_ranks"] = tuple(ranks)  # the layout ranks planned (inputs converted)
        self._register_state_dict_hook(_strip_prefix)
        self._register_load_state_dict_pre_hook(_add_prefix)

    @property
    def plans(self) -> dict[Signature, Plan]:
        """The plans held, by input shape signature: the example's first."""
        held: dict[Signature, Plan] = {}
        if self._signature is not None:
            held[self._signature] = self.plan
        # a plan for the other mode is held under its shapes too (its ``plan.train`` says which)
        held.update((tuple(e for e in sig if e[2] != "mode"), plan)
                    for sig, (_, plan) in self._shapes.items() if plan is not None)
        return held

    def prepare_inputs(self, *args: Any) -> tuple[Any, ...]:
        """``args`` as the plan's inputs arrive: every rank-4/5 tensor (rank 3 too in a 1-d
        model) in ``plan.input_format``, converted once here, so the calls that follow convert
        nothing; ``args`` unchanged when the plan has no input format. What a data pipeline
        (or a benchmark) does before its loop."""
        if self.plan.input_format is None:
            return args
        return _arrive(args, Label.parse(self.plan.input_format), self._ranks)

    def __getattr__(self, name: str) -> Any:
        # a drop-in: what the original model exposes (``config``, ``dtype``, a submodule's
        # attribute) reads through to the planned module, which is the original's class
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self.module, KeywordCall):
            args, kwargs = self.module.positional(args, kwargs), {}
        module, plan = self._module_for(args, kwargs)
        if plan is not None and plan.input_format is not None:
            # the format the plan's inputs arrive in: a no-op for inputs already in it
            args = _arrive(args, Label.parse(plan.input_format), self._ranks)
        # the device of this call's tensors: the module may have moved since it was planned
        with autocast(device_of(args, self.module), self.autocast_dtype):
            return module(*args, **kwargs)

    def _module_for(self, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> tuple[nn.Module, Plan | None]:
        if self._replan is None or self._signature is None or _compiling():
            # under torch.compile the example's plan serves every shape (its conversions do
            # not depend on the shape; dynamo recompiles per shape): no planning traced
            return self.module, self.plan
        sig = _call_signature(args, kwargs)
        if self.training != self.plan.train:
            # a plan is made and verified for one mode (an inference plan's padded weights do
            # not train; a trace can hold ``self.training`` as a constant): the other mode is
            # planned on first sight like another shape
            sig = (*sig, ((), "train" if self.training else "eval", "mode"))
        if sig == self._signature:
            return self.module, self.plan
        entry = self._shapes.get(sig)
        if entry is not None:
            self._shapes.move_to_end(sig)
            return entry
        try:
            module, plan = self._replan(self, args)
        except MemlayoutError as exc:
            warnings.warn(f"memlayout: planning input shapes {[s for s, _, _ in sig]} failed "
                          f"({exc}); running the original model's computation (same weights) "
                          "for them", stacklevel=3)
            module, plan = self._replan.base, None  # type: ignore[attr-defined]
        self.replans += 1
        self._shapes[sig] = (module, plan)
        while self._shapes and len(self._shapes) > max(0, self.max_plans - 1):
            self._shapes.popitem(last=False)
        return module, plan

    def train(self, mode: bool = True) -> OptimizedModule:
        super().train(mode)
        for module, _ in self._shapes.values():
            module.train(mode)
        return self

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> OptimizedModule:
        # ``.to()``, ``.cuda()``, ``.double()``: buffers become new tensors, which the plans of
        # other shapes (not children) would not see; they are planned again when next seen.
        super()._apply(fn, *args, **kwargs)
        self._shapes.clear()
        return self


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


def _compiling() -> bool:
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


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


def inputs_in(inputs: tuple[Any, ...], label: int, ranks: tuple[int, ...]) -> tuple[Any, ...]:
    """``inputs`` with every tensor of a layout rank in ``ranks`` in ``label``'s format; the
    same tensor when it already is."""
    return convert_value(tuple(inputs), label, ranks)
