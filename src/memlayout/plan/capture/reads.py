"""Python that reads a value's layout (L2 plan, capture): ``is_contiguous``, ``stride``,
``data_ptr``, ``storage`` / ``untyped_storage``, ``storage_offset``, ``as_strided``,
``.numpy()``. A forward that branches on such a call, or computes with its answer, may
compute other values when the plan lays the value out otherwise, with no bug in any kernel.
(A ``view`` that the plan's layout refuses changes no value: it raises, and the verification,
which runs the planned model, gives the plan up for a verified one.)

:class:`LayoutReads` is a ``TorchFunctionMode`` the capture's eager run goes through: it
records each such call that the model's own code (not torch's) makes on one of its
activations or inputs of a layout rank (parameters and buffers keep their formats' meaning),
with the module whose code made it and the line.

>>> from torch import nn
>>> class Peek(nn.Module):
...     def forward(self, x):
...         return x * 2 if x.is_contiguous() else x
>>> with LayoutReads(Peek()) as reads:
...     _ = reads.model(torch.ones(1, 2, 3, 3))
>>> [(r.module, r.call) for r in reads.found]
[('', 'is_contiguous')]
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from memlayout.errors import PlanError
from memlayout.plan.inputs import KeywordCall

#: the calls whose answer is the layout itself
READS = ("is_contiguous", "stride", "data_ptr", "storage", "untyped_storage", "as_strided",
         "numpy", "storage_offset")
_RANKS = (3, 4, 5)
_DISPATCH = (os.path.join("torch", "_tensor.py"), os.path.join("torch", "overrides.py"))
_LIBRARY = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules[__name__
                 .split(".")[0]]) if m.__file__)


@dataclass(frozen=True)
class LayoutRead:
    """One layout-reading call: the module whose code made it (``""``: the model's own
    forward), the call, and where (``file:line``)."""

    module: str
    call: str
    where: str

    def __str__(self) -> str:
        return f"{self.module or 'the model'}: .{self.call}() at {self.where}"


class LayoutReads(TorchFunctionMode):
    """Records the layout reads of ``model``'s code while active (``found``, first of each
    module, call and line)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.found: list[LayoutRead] = []
        # paths as the user names them: a keyword call's wrapper is not one of their modules
        wrapped = isinstance(model, KeywordCall)
        self._paths = {id(m): p.removeprefix("module").removeprefix(".") if wrapped else p
                       for p, m in model.named_modules()}
        self._kept = {id(t) for t in (*model.parameters(), *model.buffers())}

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS and args and self._watched(args[0]):
            self._record(name)
        return func(*args, **kwargs)

    def _watched(self, t: Any) -> bool:
        return (isinstance(t, torch.Tensor) and t.dim() in _RANKS and id(t) not in self._kept
                and t.layout is torch.strided)

    def _record(self, call: str) -> None:
        frame: FrameType | None = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.endswith(_DISPATCH):
            frame = frame.f_back  # a method torch writes in Python (``Tensor.storage``)
        if frame is None or frame.f_code.co_filename.startswith(_LIBRARY):
            return  # torch's own code (or memlayout's): it reads strides to pick a kernel
        where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        module = None
        while frame is not None and module is None:
            module = self._paths.get(id(frame.f_locals.get("self")))
            frame = frame.f_back
        read = LayoutRead(module or "", call, where)
        if read not in self.found:
            self.found.append(read)


def refuse_declared_input(reads: tuple[LayoutRead, ...], declared: bool) -> None:
    """Raise ``PlanError`` (one line, naming the reads) when inputs would be converted on
    entry (``declared``: an ``input_format``, or ``"auto"``) and the model's own code reads a
    layout: its result would then depend on a format the caller did not give it."""
    if reads and declared:
        raise PlanError(
            f"input_format converts inputs on entry, but the model's code reads layouts "
            f"({'; '.join(map(str, reads[:3]))}{' ...' if len(reads) > 3 else ''}): its "
            "results would depend on the format it converts to. Plan without input_format "
            "(inputs taken as they come)")


def reads_note(reads: tuple[LayoutRead, ...]) -> str:
    """What a plan says of the layout reads it found and planned around."""
    return (f"the model's code reads layouts ({'; '.join(map(str, reads))}): the values "
            "those reads see keep the formats the original gives them, and the parameters "
            "keep their own (a node that runs otherwise converts its weight per call), so "
            "plans for other shapes and modes see the original's layouts too")


def in_scope(module: str, path: str) -> bool:
    """Whether the code of ``path`` runs inside ``module``'s call (``""``: the model)."""
    return module == "" or path == module or path.startswith(module + ".")


__all__ = ["READS", "LayoutRead", "LayoutReads", "in_scope", "reads_note",
           "refuse_declared_input"]
