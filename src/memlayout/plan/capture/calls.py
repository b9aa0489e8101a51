"""Every module call of one eager run (analysis): how often each module is called and, for its
first call, what went in and what came out: the shape, dtype and a digest of each tensor leaf.

A graph value is found among a module's arguments or results by its digest
(:func:`positions`): that is where a steered model converts it (``memlayout.plan.steer``), for
graphs from ``torch.fx`` and ``torch.export`` alike, since both record which module call each
node ran in (``nn_module_stack``) but not which argument a value was.

>>> from torch import nn
>>> net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU())
>>> run = record_calls(net, (torch.ones(1, 3, 2, 2),), dtype=None, device=torch.device("cpu"))
>>> run.calls["1"].count, run.calls["1"].inputs[0].shape, run.convolutions
(1, (1, 4, 2, 2), 1)
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from memlayout.dtypes import autocast
from memlayout.errors import CaptureError, first_line
from memlayout.plan.capture.reads import LayoutRead, LayoutReads
from memlayout.plan.capture.trace import ConvolutionCount
from memlayout.tensors import clone_inputs


@dataclass(frozen=True)
class Leaf:
    """One tensor leaf of a call's inputs or outputs: what identifies it across two runs."""

    shape: tuple[int, ...]
    dtype: str
    digest: tuple[float, float]  # sum and sum of magnitudes (accumulated as leaf_of says)

    def matches(self, other: Leaf) -> bool:
        """The same tensor value, up to the rounding of computing it by another kernel and
        summing it in another order: both sums agree within ``_MATCH`` of the sum of
        magnitudes (a sum that cancels to near zero is as exact as its terms, not more)."""
        if self.shape != other.shape or self.dtype != other.dtype:
            return False
        scale = max(1.0, self.digest[1], other.digest[1])
        return all(abs(a - b) <= _MATCH * scale
                   for a, b in zip(self.digest, other.digest, strict=True))


#: how far two leaves' sums may be apart, relative to their sum of magnitudes, and still hold
#: one value: float32 accumulation over millions of elements, plus a few ulps per element
#: between two kernels computing the same op
_MATCH = 1e-5


def leaf_of(value: Any) -> Leaf | None:
    """The :class:`Leaf` of a dense tensor; ``None`` for anything else (a number, a sparse or
    meta tensor)."""
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided or value.is_meta:
        return None
    t = value.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    # float32 accumulation for the float32 and narrower floats (a float64 sum costs several
    # times as much, on every module call's values), float64 for the rest
    acc = torch.float32 if t.is_floating_point() and t.element_size() <= 4 else torch.float64
    try:  # not a call of the model's: past any torch-function mode watching it
        with torch._C.DisableTorchFunction():
            digest = (float(t.sum(dtype=acc)), float(t.abs().sum(dtype=acc)))
    except RuntimeError:  # a dtype without a floating-point sum (quantized)
        return None
    return Leaf(tuple(t.shape), str(t.dtype).removeprefix("torch."), digest)


def leaves_of(value: Any) -> tuple[Leaf | None, ...]:
    """The leaves of ``value`` in ``torch.utils._pytree`` order (a steered module converts by
    this position)."""
    return tuple(leaf_of(x) for x in pytree.tree_leaves(value))


@dataclass(frozen=True)
class ModuleCall:
    """A module's calls in one forward: how many, the leaves of the first one's inputs
    (``(args, kwargs)`` flattened) and outputs, and the input leaves it changed in place
    (what a graph may not show: ``torch.fx`` traces ``x += 1`` out of place)."""

    count: int
    inputs: tuple[Leaf | None, ...]
    outputs: tuple[Leaf | None, ...]
    mutated: tuple[int, ...] = ()


@dataclass
class EagerRun:
    """One eager run of a model: its output, the convolution calls that ran, every module's
    calls (by path; the root is ``""``), when asked for, the arguments each submodule first
    received (copies: a later in-place op does not change them), and the model's own code's
    layout reads (:mod:`memlayout.plan.capture.reads`)."""

    output: Any
    convolutions: int
    calls: dict[str, ModuleCall]
    arguments: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=dict)
    reads: tuple[LayoutRead, ...] = ()


def record_calls(model: nn.Module, inputs: Sequence[Any], *, dtype: torch.dtype | None,
                 device: torch.device, keep_arguments: bool = False) -> EagerRun:
    """Run ``model`` once on copies of ``inputs`` (no grad, autocast for ``dtype``) and record
    every module call. Raises ``CaptureError`` when the forward fails on the example."""
    counts: dict[str, int] = {}
    first_in: dict[str, tuple[Leaf | None, ...]] = {}
    first_out: dict[str, tuple[Leaf | None, ...]] = {}
    versions: dict[str, tuple[Any, list[int | None]]] = {}
    mutated: dict[str, tuple[int, ...]] = {}
    arguments: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
    handles = []

    def keep(a: Any) -> Any:
        return a.clone() if isinstance(a, torch.Tensor) else copy.copy(a)

    def before(path: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        counts[path] = counts.get(path, 0) + 1
        if counts[path] == 1:
            first_in[path] = leaves_of((args, kwargs))
            leaves = pytree.tree_leaves((args, kwargs))
            versions[path] = (leaves, [_version(t) for t in leaves])
            if keep_arguments and path:
                arguments[path] = (tuple(keep(a) for a in args),
                                   {k: keep(v) for k, v in kwargs.items()})

    def after(path: str, output: Any) -> None:
        if path not in first_out:
            first_out[path] = leaves_of(output)
            leaves, before = versions.pop(path, ((), []))
            mutated[path] = tuple(i for i, (t, v) in enumerate(zip(leaves, before, strict=True))
                                  if v is not None and _version(t) != v)

    for path, sub in model.named_modules():
        handles.append(sub.register_forward_pre_hook(
            lambda _m, args, kwargs, path=path: before(path, args, kwargs), with_kwargs=True))
        handles.append(sub.register_forward_hook(
            lambda _m, _args, output, path=path: after(path, output)))
    try:
        with torch.no_grad(), autocast(device, dtype), ConvolutionCount() as count, \
                LayoutReads(model) as reads:
            output = model(*clone_inputs(inputs))
    except Exception as exc:
        raise CaptureError(
            f"running {type(model).__name__} on the example inputs failed: "
            f"{type(exc).__name__}: {first_line(exc)}; check the example input's shape and dtype"
        ) from exc
    finally:
        for h in handles:
            h.remove()
    calls = {path: ModuleCall(n, first_in.get(path, ()), first_out.get(path, ()),
                              mutated.get(path, ()))
             for path, n in counts.items()}
    return EagerRun(output, count.calls, calls, arguments, tuple(reads.found))


def first_inputs(model: nn.Module, inputs: Sequence[Any], modules: Mapping[str, nn.Module], *,
                 dtype: torch.dtype | None, device: torch.device) -> dict[str, torch.Tensor]:
    """Run ``model`` once on copies of ``inputs`` (no grad, autocast for ``dtype``); by key, a
    copy (same strides) of the first tensor each of ``modules`` receives as its first
    argument. A module not called so has no entry."""
    seen: dict[str, torch.Tensor] = {}

    def hook(key: str, _m: nn.Module, args: tuple[Any, ...]) -> None:
        if key not in seen and args and isinstance(args[0], torch.Tensor):
            seen[key] = args[0].detach().clone(memory_format=torch.preserve_format)

    run_hooked(model, inputs, [m.register_forward_pre_hook(partial(hook, key))
                               for key, m in modules.items()], dtype=dtype, device=device)
    return seen


def run_hooked(model: nn.Module, inputs: Sequence[Any], handles: Sequence[Any], *,
               dtype: torch.dtype | None, device: torch.device) -> None:
    """Run ``model`` once on copies of ``inputs`` (no grad, autocast for ``dtype``) for what
    its hooks (``handles``) see; the hooks are removed after, whatever happens."""
    try:
        with torch.no_grad(), autocast(device, dtype):
            model(*clone_inputs(inputs))
    finally:
        for h in handles:
            h.remove()


def _version(value: Any) -> int | None:
    if not isinstance(value, torch.Tensor) or value.is_inference():
        return None
    return value._version


def positions(leaves: Sequence[Leaf | None], value: Sequence[Leaf | None]) -> tuple[int, ...]:
    """Where the tensors of a graph value (``value``: its leaves) are among a call's
    ``leaves``: every position holding one of them (a tensor passed twice is at both).

    >>> a, b = leaf_of(torch.ones(2)), leaf_of(torch.zeros(2))
    >>> positions((b, None, a), (a,)), positions((b,), (a,))
    ((2,), ())
    """
    wanted = [v for v in value if v is not None]
    return tuple(i for i, leaf in enumerate(leaves)
                 if leaf is not None and any(leaf.matches(v) for v in wanted))


#: ``node.meta`` key of :class:`RunFacts`
RUN_KEY = "memlayout.run"


@dataclass(frozen=True)
class RunFacts:
    """What running one graph node showed besides its layout (``node.meta[RUN_KEY]``): the
    leaves of its value (to find it among a module call's), the inputs it changed in place,
    and the inputs its value shares memory with (a view, or an in-place op's result)."""

    leaves: tuple[Leaf | None, ...]
    mutates: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()


def run_facts(value: Any, inputs: dict[str, Any], versions: dict[str, tuple[int, ...]]) -> RunFacts:
    """The :class:`RunFacts` of a node whose value is ``value``, given its input nodes' values
    (by name) and their tensors' versions before it ran."""
    storages = {_storage(t) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)}
    storages.discard(None)
    mutates = tuple(name for name, v in inputs.items() if _versions(v) != versions[name])
    aliases = tuple(name for name, v in inputs.items()
                    if storages & {_storage(t) for t in pytree.tree_leaves(v)
                                   if isinstance(t, torch.Tensor)})
    return RunFacts(leaves_of(value), mutates, aliases)


def versions_of(value: Any) -> tuple[int, ...]:
    """The version counters of the tensors in ``value`` (an in-place op bumps them)."""
    return _versions(value)


def _versions(value: Any) -> tuple[int, ...]:
    return tuple(t._version for t in pytree.tree_leaves(value)
                 if isinstance(t, torch.Tensor) and not t.is_inference())


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):  # no storage (a sparse or functional tensor)
        return None
