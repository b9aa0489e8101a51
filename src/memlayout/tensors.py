"""The torch bridge (L1): formats of real tensors, canonical conversion, modules and batches.

Every stride rule comes from :mod:`memlayout.layout`; this module only reads ``.shape`` and
``.stride()`` and moves data.

>>> import torch
>>> x = torch.empty(10, 3, 32, 32)
>>> y = to_format(x, Format.CHANNELS_LAST)
>>> y.stride(), format_of(y)
((3072, 1, 96, 3), <Format.CHANNELS_LAST: 'channels_last'>)
>>> sorted(f.name for f in format_of(torch.empty(4, 1, 4, 4)))
['CHANNELS_LAST', 'CONTIGUOUS']
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from memlayout.layout import (
    Format,
    channels_last_for_rank,
    check_rank,
    formats_of,
    is_format,
    strides_for,
)

FormatAnswer = Format | frozenset[Format] | None
M = TypeVar("M", bound=nn.Module)

_TORCH_FORMATS: dict[Format, torch.memory_format] = {
    Format.CONTIGUOUS: torch.contiguous_format,
    Format.CHANNELS_LAST: torch.channels_last,
    Format.CHANNELS_LAST_3D: torch.channels_last_3d,
}

# Conv1d-like modules: the only modules whose rank-3 weights are (out, in, length) kernels.
_CONV1D_TYPES: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.ConvTranspose1d)


def torch_memory_format(fmt: Format) -> torch.memory_format | None:
    """The ``torch.memory_format`` for ``fmt``; ``None`` for CHANNELS_LAST_1D (torch has none)."""
    return _TORCH_FORMATS.get(fmt)


def format_of(t: torch.Tensor) -> FormatAnswer:
    """The format ``t`` is in: one ``Format``, the ``frozenset`` when several fit (C == 1,
    H == W == 1, size-0 dims), or ``None`` when none fits (a slice, a transpose).

    >>> format_of(torch.empty(2, 3, 4, 5).transpose(2, 3)) is None
    True
    """
    return format_answer(formats_of(tuple(t.shape), tuple(t.stride())))


def format_answer(found: frozenset[Format]) -> FormatAnswer:
    """A ``formats_of`` set as ``format_of`` answers: ``None``, the one format, or the set."""
    if not found:
        return None
    if len(found) == 1:
        return next(iter(found))
    return found


def format_name(answer: FormatAnswer) -> str:
    """Short human name of a ``format_of`` answer: ``channels_last``,
    ``ambiguous(channels_last|contiguous)``, ``none``.

    >>> format_name(format_of(torch.empty(4, 1, 4, 4)))
    'ambiguous(channels_last|contiguous)'
    """
    if answer is None:
        return "none"
    if isinstance(answer, Format):
        return answer.value
    return "ambiguous(" + "|".join(sorted(f.value for f in answer)) + ")"


def in_format(answer: FormatAnswer, fmt: Format) -> bool:
    """Whether a ``format_of`` answer includes ``fmt`` (ambiguous answers included)."""
    if answer is None:
        return False
    if isinstance(answer, Format):
        return answer is fmt
    return fmt in answer


def to_format(t: torch.Tensor, fmt: Format) -> torch.Tensor:
    """``t`` with values unchanged and strides exactly ``strides_for(t.shape, fmt)``.

    Returns ``t`` itself when the strides already match. When ``t`` is already dense in ``fmt``
    but carries non-canonical strides on size-1 dims (where ``t.contiguous(memory_format=...)``
    is a no-op), returns a restrided view: no data moves. Otherwise copies once. Autograd flows
    through all three; through the copy, the gradient comes back in ``t``'s own format (a
    copy back, :class:`_ConvertBack`), so the op that made ``t`` runs its backward with its
    tensors in one format, as in a model never converted.

    >>> to_format(torch.empty(4, 1, 4, 4), Format.CHANNELS_LAST).stride()
    (16, 1, 4, 1)
    >>> to_format(torch.empty(2, 3), Format.CHANNELS_LAST)
    Traceback (most recent call last):
    ...
    memlayout.errors.LayoutError: CHANNELS_LAST needs a rank-4 tensor, got rank 2; a rank-2 tensor can be: CONTIGUOUS
    """
    shape = tuple(t.shape)
    check_rank(len(shape), fmt)
    target = strides_for(shape, fmt)
    current = tuple(t.stride())
    if current == target:
        return t
    if is_format(shape, current, fmt):
        return t.as_strided(shape, target, t.storage_offset())
    if t.requires_grad and torch.is_grad_enabled() and not torch.jit.is_tracing():
        return _ConvertBack.apply(t, fmt, False)  # a jit trace keeps torch's own ops
    out = torch.empty_strided(shape, target, dtype=t.dtype, device=t.device)
    return out.copy_(t)


def to_dense(t: torch.Tensor, fmt: Format) -> torch.Tensor:
    """``t`` dense in ``fmt`` by torch's own ops (``contiguous(memory_format=...)``; for
    CHANNELS_LAST_1D, N L C in memory, a ``contiguous`` between two transposes), ``t`` itself
    when it already is: sizes may be symbolic (a Dynamo graph's), strides on size-1 dims are
    left as torch leaves them. Its gradient comes back in ``t``'s own format, as
    :func:`to_format`'s does.

    >>> to_dense(torch.empty(2, 3, 4, 4), Format.CHANNELS_LAST).stride()
    (48, 1, 12, 3)
    >>> to_dense(torch.empty(2, 3, 4), Format.CHANNELS_LAST_1D).stride()
    (12, 1, 3)
    """
    check_rank(t.dim(), fmt)
    if _dense_in(t, fmt):
        return t
    if t.requires_grad and torch.is_grad_enabled() and not torch.jit.is_tracing():
        return _ConvertBack.apply(t, fmt, True)  # a jit trace keeps torch's own ops
    return _make_dense(t, fmt)


def _dense_in(t: torch.Tensor, fmt: Format) -> bool:
    # torch's own check, not ``format_of``: the sizes may be symbolic
    if fmt is Format.CHANNELS_LAST_1D:
        return t.transpose(1, 2).is_contiguous()
    return t.is_contiguous(memory_format=_TORCH_FORMATS[fmt])


def _make_dense(t: torch.Tensor, fmt: Format) -> torch.Tensor:
    if fmt is Format.CHANNELS_LAST_1D:
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.contiguous(memory_format=_TORCH_FORMATS[fmt])


def _source_format(t: torch.Tensor) -> Format:
    """The format ``t`` is dense in, for its gradient to come back in: its rank's channels-last
    where it is dense in that and not contiguous, else contiguous (a tensor dense in none
    included). torch's own checks, not ``format_of``: the sizes may be symbolic."""
    last = channels_last_for_rank(t.dim())
    if last is not None and not t.is_contiguous() and _dense_in(t, last):
        return last
    return Format.CONTIGUOUS


class _ConvertBack(torch.autograd.Function):
    """:func:`to_format` (``dense`` false) or :func:`to_dense` (true) of ``t``, whose backward
    converts the gradient back into the source's format by the same function.

    Autograd's own copy hands the gradient back in the copy's strides, so the op that made
    the source would run its backward on a gradient in another format than its saved
    tensors: a mix no plan measured, which can be slower, and which some kernels get wrong
    (torch's CPU ``instance_norm`` backward at batch size 1, for one, given a channels-last
    gradient for a contiguous input). A plan counts a conversion's copy both ways, and this
    is that copy."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, fmt: Format, dense: bool) -> torch.Tensor:
        ctx.source, ctx.dense = _source_format(t), dense
        return (to_dense if dense else to_format)(t, fmt)  # grad mode is off here: a plain copy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (to_dense if ctx.dense else to_format)(grad, ctx.source), None, None


def _applies(t: torch.Tensor, fmt: Format) -> bool:
    return fmt.rank is None or t.dim() == fmt.rank


def convert_module(module: M, fmt: Format) -> M:
    """Convert ``module``'s parameters and buffers whose rank fits ``fmt``, in place like
    ``Module.to``: parameter identity, ``requires_grad`` and ``.grad`` (converted too) are kept,
    so optimizers built before the call keep working. Returns ``module``.

    CHANNELS_LAST and CHANNELS_LAST_3D convert every rank-4 / rank-5 tensor (as
    ``Module.to(memory_format=...)`` does); CHANNELS_LAST_1D only the weights of Conv1d and
    ConvTranspose1d modules, since other rank-3 parameters (embeddings, tokens) are not
    (out, in, length) kernels. CONTIGUOUS converts everything back.

    >>> conv = nn.Conv2d(3, 8, 3)
    >>> convert_module(conv, Format.CHANNELS_LAST).weight.stride()
    (27, 1, 9, 3)
    """
    if fmt is Format.CHANNELS_LAST_1D:
        for sub in module.modules():
            if isinstance(sub, _CONV1D_TYPES):
                sub._apply(lambda t: to_format(t, fmt) if t.dim() == 3 else t, recurse=False)
        return module
    module._apply(lambda t: to_format(t, fmt) if _applies(t, fmt) else t)
    return module


def convert_batch(obj: Any, fmt: Format) -> Any:
    """Convert every tensor of the rank ``fmt`` applies to inside ``obj`` (dicts, lists,
    tuples, namedtuples, dataclasses, nested); everything else comes back untouched.

    >>> out = convert_batch({"x": torch.zeros(2, 3, 4, 4), "y": [torch.zeros(2), "a"]},
    ...                     Format.CHANNELS_LAST)
    >>> out["x"].stride(), out["y"][1]
    ((48, 1, 12, 3), 'a')
    """
    return map_tensors(obj, lambda t: to_format(t, fmt) if _applies(t, fmt) else t)


def map_tensors(obj: Any, fn: Any) -> Any:
    """``obj`` with every tensor inside it (dicts, lists, tuples, namedtuples, dataclasses,
    nested) replaced by ``fn(tensor)``, in :func:`iter_tensors`'s order; the containers
    remade as their own types; ``obj`` itself when ``fn`` changes nothing.

    >>> map_tensors((torch.zeros(2), 3), lambda t: t + 1)[0]
    tensor([1., 1.])
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # before Mapping: a diffusers output is a dataclass *and* an OrderedDict that
        # refuses ``update``; made anew through its constructor, its dict follows its fields
        return _map_dataclass(obj, fn)
    if isinstance(obj, Mapping):
        items = {k: map_tensors(v, fn) for k, v in obj.items()}
        if all(items[k] is v for k, v in obj.items()):
            return obj
        try:
            out = copy.copy(obj)
            out.update(items)  # type: ignore[attr-defined]  # keeps the mapping's type (OrderedDict, defaultdict, ...)
            return out
        except (AttributeError, TypeError):
            return items
    if isinstance(obj, (list, tuple)):
        items = [map_tensors(v, fn) for v in obj]
        if all(a is b for a, b in zip(items, obj, strict=True)):
            return obj
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        return type(obj)(items)
    return obj


def _map_dataclass(obj: Any, fn: Any) -> Any:
    fields = dataclasses.fields(obj)
    values = {f.name: map_tensors(getattr(obj, f.name), fn) for f in fields}
    if all(values[f.name] is getattr(obj, f.name) for f in fields):
        return obj
    if all(f.init for f in fields):
        try:
            return dataclasses.replace(obj, **values)
        except Exception:  # a constructor that checks more than its fields: set them instead
            pass
    out = copy.copy(obj)
    for name, value in values.items():
        object.__setattr__(out, name, value)
    return out


def iter_tensors(obj: Any):
    """Every tensor inside a nested structure, in a deterministic order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, field.name))


def clone_inputs(inputs: Sequence[Any], *, requires_grad_only: bool = False,
                 detach: bool = False, nested: bool = False) -> tuple[Any, ...]:
    """``inputs`` with every tensor among them cloned (a dense one keeps its strides; autograd
    flows through) and the rest as given, so that a call changing an input in place leaves the
    caller's unchanged. ``requires_grad_only``: clone only the tensors that require grad (a
    fresh graph per call; the others are shared). ``detach``: the clones are cut from
    autograd. ``nested``: the tensors inside containers too, walked as :func:`map_tensors`
    does (the containers made anew); otherwise only the tensors among ``inputs`` themselves.

    >>> x = torch.zeros(2, 3, 4, 4).to(memory_format=torch.channels_last)
    >>> y, n = clone_inputs((x, 3))
    >>> y is x, y.stride() == x.stride(), n
    (False, True, 3)
    >>> clone_inputs(([x],))[0][0] is x, clone_inputs(([x],), nested=True)[0][0] is x
    (True, False)
    """
    def clone(t: torch.Tensor) -> torch.Tensor:
        if requires_grad_only and not t.requires_grad:
            return t
        return (t.detach() if detach else t).clone()

    if nested:
        return tuple(map_tensors(x, clone) for x in inputs)
    return tuple(clone(x) if isinstance(x, torch.Tensor) else x for x in inputs)


def mean_square_loss(out: Any) -> torch.Tensor | None:
    """The loss a timed training step backpropagates: ``sum(0.5 * mean(y ** 2))`` over every
    floating tensor of ``out`` that requires grad (tensor, dict, namedtuple of aux logits...),
    in float32; ``None`` when there is none (a model with every parameter frozen).

    >>> w = torch.ones(2, requires_grad=True)
    >>> mean_square_loss({"a": w * 2, "b": 3})
    tensor(2., grad_fn=<SumBackward0>)
    """
    terms = [0.5 * t.float().square().mean() for t in iter_tensors(out)
             if t.is_floating_point() and t.requires_grad]
    return torch.stack(terms).sum() if terms else None


def device_of(inputs: Any, module: nn.Module | None = None) -> torch.device:
    """Where a call runs: the device of the first tensor in ``inputs``, else of ``module``'s
    first parameter, else the CPU.

    >>> device_of((3, torch.zeros(1)))
    device(type='cpu')
    """
    for t in iter_tensors(inputs):
        return t.device
    for p in module.parameters() if module is not None else ():
        return p.device
    return torch.device("cpu")


def meta_weights(module: nn.Module) -> str | None:
    """How many of ``module``'s parameters and buffers are on the meta device (shapes without
    values), and the first names, as a phrase; ``None`` when none is.

    >>> with torch.device("meta"):
    ...     conv = nn.Conv2d(3, 4, 1)
    >>> meta_weights(conv), meta_weights(nn.Conv2d(3, 4, 1))
    ('2 of 2 parameters and buffers on the meta device (weight, bias)', None)
    """
    tensors = [*module.named_parameters(), *module.named_buffers()]
    meta = [name for name, t in tensors if t.is_meta]
    if not meta:
        return None
    names = ", ".join(meta[:3]) + (", ..." if len(meta) > 3 else "")
    return f"{len(meta)} of {len(tensors)} parameters and buffers on the meta device ({names})"
