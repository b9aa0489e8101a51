"""What the planner knows of a graph (L2 plan): labels, the layout facts of every value in
``node.meta["memlayout"]``, the ranks planned, and readable names of nodes.

A label is the two-format state of a value. ``CONTIGUOUS`` and ``CHANNELS_LAST`` are the two
choices (``LABELS``); which ``Format`` channels-last is depends on the tensor's rank
(``channels_last_1d`` / ``channels_last`` / ``channels_last_3d``). As an ``IntEnum`` they are
also the 0 / 1 the min-cut solver (``memlayout.plan.solve.mincut``) works with. A value can also
be in ``EITHER`` (every tensor in both: C == 1, H == W == 1; no copy is ever needed) or
``NEITHER`` (some tensor in no format: a permute, a slice); a value with no tensor of a layout
rank has no label (``None``). A :class:`Request` is what a plan is asked to do at its
boundary: keep the outputs' formats, or choose the inputs'.

>>> Label.CHANNELS_LAST.format(5), Label(0).format(4)
(<Format.CHANNELS_LAST_3D: 'channels_last_3d'>, <Format.CONTIGUOUS: 'contiguous'>)
>>> Label.parse("channels_last_3d"), Label.CHANNELS_LAST.text, Label.EITHER in LABELS
(<Label.CHANNELS_LAST: 1>, 'channels_last', False)
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from memlayout.layout import Format, channels_last_for_rank, formats_of
from memlayout.tensors import iter_tensors


class Label(enum.IntEnum):
    CONTIGUOUS = 0
    CHANNELS_LAST = 1
    EITHER = 2  # every layout tensor is in both formats (C == 1, H == W == 1): no copy needed
    NEITHER = 3  # some layout tensor is in neither format (a permute, a slice)

    @property
    def text(self) -> str:
        """The name a plan shows and stores: ``contiguous``, ``channels_last``, ``either`` or
        ``neither``."""
        return self.name.lower()

    def format(self, rank: int) -> Format:
        """The ``Format`` this label means for a tensor of ``rank`` dims (contiguous for a
        rank without a channels-last format, and for ``EITHER``: it is in both); ``ValueError``
        for ``NEITHER``, which is in no format."""
        if self is Label.NEITHER:
            raise ValueError("a value labelled neither is in no format")
        if self is Label.CHANNELS_LAST:
            fmt = channels_last_for_rank(rank)
            if fmt is not None:
                return fmt
        return Format.CONTIGUOUS

    @classmethod
    def parse(cls, fmt: str | Format | Label) -> Label:
        """The label of a format (any channels-last rank is ``CHANNELS_LAST``) or of its name;
        ``LayoutError`` (from ``Format.parse``) for a name that is no format."""
        if isinstance(fmt, Label):
            return fmt
        return cls.CONTIGUOUS if Format.parse(fmt) is Format.CONTIGUOUS else cls.CHANNELS_LAST


LABELS = (Label.CONTIGUOUS, Label.CHANNELS_LAST)  # the two choices a plan makes


class Request(str, enum.Enum):
    """What a plan is asked to do at its boundary, where it is not given a format: ``KEEP``
    the outputs in the formats the original returns them in (``output_format="keep"``),
    choose the inputs' format (``input_format="auto"``: ``AUTO``). Equal to its text.

    >>> Request("keep") is Request.KEEP, Request.AUTO == "auto"
    (True, True)
    """

    KEEP = "keep"
    AUTO = "auto"

    @property
    def text(self) -> str:
        """The name a plan shows and stores, as for a :class:`Label`."""
        return self.value


# The ranks planned (a value's format is a choice): 4 and 5 always (channels_last(_3d)); 3
# (N L C in memory, channels_last_1d) only for a model with 1-d convolutions, whose NLC input
# makes torch's Conv1d run an NLC kernel (rank-3 values elsewhere, such as a transformer's
# tokens, are not convolution layouts). ``capture`` records them in every node's meta
# (``ValueMeta.ranks``, read back by ``graph_ranks``); every step takes them from there.
BASE_RANKS = (4, 5)
CONV1D_RANKS = (3, 4, 5)
CONV1D_MODULES: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.ConvTranspose1d)
META_KEY = "memlayout"
# node.meta key: a value layout-reading code sees (capture.reads): the plan keeps its format
KEEP_KEY = "memlayout.keep"


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    formats: tuple[str, ...]  # sorted format values; several when ambiguous, none for a slice

    @property
    def nbytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * _itemsize(self.dtype)


@dataclass(frozen=True)
class ValueMeta:
    """One node's output: every tensor inside it and the label of the whole value (``None``:
    no tensor of a layout rank); ``ranks``: the layout ranks of the model it was captured
    in."""

    tensors: tuple[TensorMeta, ...]
    label: Label | None
    ranks: tuple[int, ...] = BASE_RANKS

    @property
    def layout_tensors(self) -> tuple[TensorMeta, ...]:
        return tuple(t for t in self.tensors if len(t.shape) in self.ranks)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.layout_tensors)


def planned_ranks(model: nn.Module) -> tuple[int, ...]:
    """The layout ranks to plan for ``model``: 3, 4 and 5 when it has a 1-d convolution,
    else 4 and 5.

    >>> planned_ranks(nn.Sequential(nn.Conv1d(2, 4, 3))), planned_ranks(nn.Linear(2, 2))
    ((3, 4, 5), (4, 5))
    """
    has_1d = any(isinstance(m, CONV1D_MODULES) for m in model.modules())
    return CONV1D_RANKS if has_1d else BASE_RANKS


def graph_ranks(gm: fx.GraphModule) -> tuple[int, ...]:
    """The layout ranks ``gm`` was captured with (from its nodes' meta).

    >>> from memlayout.plan.capture.regions import capture
    >>> cap = capture(nn.Sequential(nn.Conv1d(2, 4, 3)), (torch.randn(1, 2, 8),))
    >>> graph_ranks(cap.regions[0].gm)
    (3, 4, 5)
    """
    for n in gm.graph.nodes:
        meta = n.meta.get(META_KEY)
        if meta is not None:
            return meta.ranks
    return BASE_RANKS


def label_of(tensors: tuple[TensorMeta, ...], ranks: tuple[int, ...]) -> Label | None:
    """The label of a value made of ``tensors`` (see :class:`ValueMeta`)."""
    layout = [t for t in tensors if len(t.shape) in ranks]
    if not layout:
        return None
    in0 = all(Format.CONTIGUOUS.value in t.formats for t in layout)
    in1 = all(Label.CHANNELS_LAST.format(len(t.shape)).value in t.formats for t in layout)
    if in0 and in1:
        return Label.EITHER
    if in0:
        return Label.CONTIGUOUS
    if in1:
        return Label.CHANNELS_LAST
    return Label.NEITHER


def value_meta(value: Any, ranks: tuple[int, ...]) -> ValueMeta:
    """The layout facts of ``value`` (every tensor in it) for a model planned in ``ranks``."""
    tensors = tuple(
        TensorMeta(tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch."),
                   tuple(sorted(f.value for f in formats_of(tuple(t.shape), tuple(t.stride())))))
        for t in iter_tensors(value)
    )
    return ValueMeta(tensors, label_of(tensors, ranks), ranks)


def node_target_name(root: nn.Module, n: fx.Node) -> str:
    """A short readable name of what ``n`` runs: ``Conv2d``, ``torch.flatten``, ``.view``,
    ``aten.conv2d.default``."""
    if n.op == "call_module":
        return type(root.get_submodule(n.target)).__name__
    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
        return str(n.target)  # an exported graph's aten op: aten.permute.default
    if n.op == "call_function":
        mod = getattr(n.target, "__module__", None) or ""
        name = getattr(n.target, "__name__", repr(n.target))
        return f"{mod.replace('_operator', 'operator')}.{name}" if mod else name
    if n.op == "call_method":
        return f".{n.target}"
    return n.op


def iter_nodes(gm: fx.GraphModule, op: str) -> Iterator[fx.Node]:
    return (n for n in gm.graph.nodes if n.op == op)


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize if hasattr(torch, dtype) else 4


def attribute(root: Any, target: str) -> Any:
    """The object ``root`` holds at the dotted ``target`` (``None`` when a part is missing):
    a ``get_attr`` node's value, a parameter by its name.

    >>> attribute(nn.Sequential(nn.Conv2d(1, 2, 3)), "0.weight").shape
    torch.Size([2, 1, 3, 3])
    """
    value = root
    for part in target.split("."):
        value = getattr(value, part, None)
    return value
