"""What a steered module does at its boundary (application): convert chosen tensor leaves of
its arguments on the way in, and of its results on the way out.

A leaf is named by its position among ``torch.utils._pytree``'s leaves of ``(args, kwargs)``
(or of the output), as the analysis found it (``memlayout.plan.capture.calls``). A leaf is
converted only when it is a tensor of the rank it had when planned; a call whose arguments
are shaped otherwise (other keyword arguments, say) is left as it comes. A conversion is
``Tensor.contiguous(memory_format=...)`` (``memlayout.tensors.to_dense``: in training its
gradient comes back in the source's format): a no-op for a tensor already in the format,
and an op every tracer records with its real strides (``torch.jit.trace``, ``torch.export``,
``torch.compile``; under ``torch.fx.symbolic_trace`` it is one ``call_function`` node).

>>> b = Boundary(inputs=(Leaf(position=0, label=Label.CHANNELS_LAST, rank=4),))
>>> (x,), _ = b.enter((torch.zeros(2, 3, 4, 4),), {})
>>> x.stride()
(48, 1, 12, 3)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from memlayout.plan.graph import Label
from memlayout.tensors import iter_tensors, map_tensors, to_dense


class Leaf(NamedTuple):
    """A tensor leaf a boundary converts: the leaf at ``position`` among the flattened leaves,
    when it has ``rank`` dims, into ``label``'s format. A tuple (it is pickled with the
    planned model, sorted and compared as one).

    >>> Leaf(0, Label.CHANNELS_LAST, 4) == (0, 1, 4)
    True
    """

    position: int
    label: Label
    rank: int


class Returned(NamedTuple):
    """A tensor of a module's result as the original hands it back: its index in
    ``memlayout.tensors.iter_tensors`` order, its ``rank``, and the ``label`` of its format
    (``None``: in no one definite format, or a view of an input: handed back as it comes)."""

    index: int
    label: Label | None
    rank: int


@dataclass(frozen=True)
class Boundary:
    """What one module call does besides its own forward: convert ``inputs`` (leaves of the
    flattened ``(args, kwargs)``) and ``outputs`` (leaves of the flattened result); for a
    convolution, convert its stored weight to ``weight_label`` per call (the stored weight
    stays contiguous: ``weights="contiguous"``), or run it with its channels ``padding``
    (``(in, out)``, rounded up to the vector width; inference)."""

    inputs: tuple[Leaf, ...] = ()
    outputs: tuple[Leaf, ...] = ()
    weight_label: Label | None = None
    padding: tuple[int, int] | None = None

    def enter(self, args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not self.inputs:
            return args, kwargs
        if not kwargs and all(_plain(a) for a in args):
            # the usual call: tensors given positionally, one leaf each
            items = list(args)
            for p, label, rank in self.inputs:
                if p < len(items):
                    items[p] = convert_leaf(items[p], label, rank)
            return tuple(items), kwargs
        return pytree.tree_unflatten(
            _convert(pytree.tree_leaves((args, kwargs)), self.inputs),
            pytree.tree_structure((args, kwargs)))

    def exit(self, output: Any) -> Any:
        """``output`` with the planned leaves converted; a parameter the module returns
        comes back as itself (the caller may update it, or keep it)."""
        if not self.outputs:
            return output
        if _plain(output) and len(self.outputs) == 1 and self.outputs[0][0] == 0:
            _, label, rank = self.outputs[0]
            return output if _owned(output) else convert_leaf(output, label, rank)
        leaves, spec = pytree.tree_flatten(output)
        return pytree.tree_unflatten(_convert(leaves, self.outputs, keep_own=True), spec)


def _plain(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, fx.Proxy))


def _convert(leaves: list[Any], plan: tuple[Leaf, ...], *, keep_own: bool = False) -> list[Any]:
    out = list(leaves)
    for p, label, rank in plan:
        if p < len(out) and not (keep_own and _owned(out[p])):
            out[p] = convert_leaf(out[p], label, rank)
    return out


def _owned(value: Any, model: nn.Module | None = None) -> bool:
    """``value`` is a parameter (never an op's result) or one of ``model``'s buffers: a
    result handed back as that object, not as a converted copy. A buffer is looked for only
    among leaves no op made (autograd's ``grad_fn`` is unset) that would be converted."""
    if isinstance(value, nn.Parameter):
        return True
    if model is None or not isinstance(value, torch.Tensor) or value.grad_fn is not None:
        return False
    return any(value is b for m in model.modules() for b in m._buffers.values())


def convert_leaf(value: Any, label: Label, rank: int) -> Any:
    """``value`` in ``label``'s format when it is a tensor (or a traced one) of ``rank`` dims;
    anything else as it is."""
    if isinstance(value, fx.Proxy):
        return to_label(value, label)  # one node of the traced graph (torch.fx.wrap)
    if not isinstance(value, torch.Tensor) or value.dim() != rank:
        return value
    return to_label(value, label)


def to_label(t: torch.Tensor, label: Label) -> torch.Tensor:
    """``t`` in ``label``'s format for its rank; ``t`` itself when it already is (an
    ambiguous tensor, C == 1 or H == W == 1, is in both).

    >>> to_label(torch.zeros(2, 4, 8), Label.CHANNELS_LAST).stride()
    (32, 1, 4)
    """
    if t.dim() not in (3, 4, 5):
        return t
    return to_dense(t, Label(label).format(t.dim()))  # its gradient comes back in t's format


# Under torch.fx.symbolic_trace a steered module's conversion is one node, not a trace of its
# stride checks (which a Proxy cannot answer).
fx.wrap("to_label")


def restride(output: Any, formats: tuple[Returned, ...],
             fallback: Label | None = None, keep: set[int] | None = None,
             ranks: tuple[int, ...] = (4, 5), own: nn.Module | None = None) -> Any:
    """``output`` with its tensors in the formats the original hands them back in; a
    parameter, or one of ``own``'s buffers, as that object (in its planned strides: the
    original hands back the object too).

    ``formats``: every tensor of the original's output on the plan's example, in
    ``memlayout.tensors.iter_tensors`` order (:class:`Returned`; label ``None``: as it comes).
    Where this output's tensors are not those (another structure: a flag read in forward
    returns features instead of logits), every tensor of a layout rank goes to ``fallback``
    (the format the call's input came in: what the original, fed it, returns), except those
    whose memory is in ``keep`` (the inputs' storage: a view of an input stays one);
    ``ranks``: the layout ranks planned."""
    if not formats:
        return output
    tensors = list(iter_tensors(output))
    if [r for _, _, r in formats] == [t.dim() for t in tensors]:
        # (-1: "as it comes" in a model pickled when labels were plain ints)
        wanted = {i: label for i, label, _ in formats if label is not None and label >= 0}
    elif fallback is not None and keep is not None:
        wanted = {i: fallback for i, t in enumerate(tensors)
                  if t.dim() in ranks and not storage_addresses(t) & keep}
    else:
        return output
    changed: dict[int, torch.Tensor] = {}
    for i, t in enumerate(tensors):
        if i in wanted:
            converted = convert_leaf(t, wanted[i], t.dim())
            if converted is not t and not _owned(t, own):
                changed[i] = converted
    if not changed:
        return output
    count = iter(range(len(tensors)))

    def fix(t: torch.Tensor) -> torch.Tensor:
        return changed.get(next(count), t)

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
