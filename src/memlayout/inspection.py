"""What layout a model's parameters and module outputs are in after a channels-last run (L2).

``inspect_model`` converts copies of the model and input to ``fmt``, runs one forward under
``no_grad`` with forward hooks on every module, and returns plain data; ``render_terminal``
only reads it.
(The audit goes further: every aten op, backward included, with conversion costs.)
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from memlayout.layout import Format
from memlayout.tensors import convert_batch, convert_module, format_name, format_of, iter_tensors


@dataclass(frozen=True)
class ParamGroup:
    """Parameters and buffers of one rank: how many tensors and elements, by format name."""

    rank: int
    tensors: int
    elements: int
    formats: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class ModuleOutput:
    """One module call's output tensors (execution order)."""

    path: str
    type: str
    shapes: tuple[tuple[int, ...], ...]
    formats: tuple[str, ...]


@dataclass(frozen=True)
class InspectReport:
    fmt: Format
    params: tuple[ParamGroup, ...]
    outputs: tuple[ModuleOutput, ...]


def inspect_model(model: nn.Module, inputs: Any, fmt: Format = Format.CHANNELS_LAST, *,
                  kwargs: dict[str, Any] | None = None) -> InspectReport:
    """Run ``model`` once in ``fmt`` (on copies; the caller's objects are untouched) and report
    the format of every parameter group and module output. ``inputs``: one tensor or a tuple
    of ``forward``'s positional inputs; ``kwargs``: its keyword inputs.

    >>> from torch import nn
    >>> r = inspect_model(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten()), torch.randn(2, 3, 8, 8))
    >>> [(o.path, o.formats) for o in r.outputs]
    [('0', ('channels_last',)), ('1', ('contiguous',)), ('', ('contiguous',))]
    """
    model = convert_module(copy.deepcopy(model), fmt)
    inputs = convert_batch(inputs, fmt)
    kwargs = convert_batch(dict(kwargs or {}), fmt)
    groups: dict[int, list[torch.Tensor]] = {}
    for t in [*model.parameters(), *model.buffers()]:
        groups.setdefault(t.dim(), []).append(t)
    params = tuple(
        ParamGroup(rank, len(ts), sum(t.numel() for t in ts),
                   tuple(sorted(Counter(format_name(format_of(t)) for t in ts).items())))
        for rank, ts in sorted(groups.items())
    )
    outputs: list[ModuleOutput] = []
    names = {m: n for n, m in model.named_modules()}

    def hook(module: nn.Module, _args: Any, out: Any) -> None:
        ts = [t for t in iter_tensors(out) if t.dim() > 0]
        outputs.append(ModuleOutput(
            names.get(module, "?"), type(module).__name__,
            tuple(tuple(t.shape) for t in ts), tuple(format_name(format_of(t)) for t in ts)))

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with torch.no_grad():
            if isinstance(inputs, (list, tuple)):
                model(*inputs, **kwargs)
            else:
                model(inputs, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return InspectReport(fmt, params, tuple(outputs))


_STYLE = {"channels_last": "green", "channels_last_3d": "green", "contiguous": "yellow",
          "none": "red"}


def styled(name: str) -> str:
    """A format name in rich markup: green in a channels-last format, yellow contiguous,
    cyan ambiguous, red none."""
    style = "cyan" if name.startswith("ambiguous") else _STYLE.get(name, "white")
    return f"[{style}]{name}[/{style}]"


def render_terminal(report: InspectReport, console: Console, *, model: str,
                    input_shape: tuple[int, ...]) -> None:
    """Parameters and buffers by rank and format, every module's outputs in execution order,
    and the outputs counted by format."""
    params = Table(title=f"{model}: parameters and buffers after convert_module(..., {report.fmt.name})")
    for col in ("rank", "tensors", "elements", "formats"):
        params.add_column(col, justify="right" if col != "formats" else "left")
    for g in report.params:
        fmts = ", ".join(f"{styled(n)} x{c}" for n, c in g.formats)
        params.add_row(str(g.rank), str(g.tensors), f"{g.elements:,}", fmts)
    console.print(params)
    outs = Table(title=f"{model}: module outputs, input {input_shape} in {report.fmt.name}")
    for col in ("#", "module", "type", "output shape", "format"):
        outs.add_column(col)
    for i, o in enumerate(report.outputs):
        outs.add_row(str(i), o.path or "(model)", o.type,
                     " ".join(str(s) for s in o.shapes), " ".join(styled(f) for f in o.formats))
    console.print(outs)
    counts = Counter(f for o in report.outputs for f in o.formats)
    console.print("module outputs by format: "
                  + ", ".join(f"{styled(k)} {v}" for k, v in sorted(counts.items())))
