"""Why a layout node drops channels-last: the aten ops that did it, told by the coverage matrix.

The cost step records what format each layout node really returns when fed channels-last
(GroupNorm, reflection padding, some views come back contiguous). This step says *why*: it
runs each such node once more, fed channels-last, under the audit's recorder
(:class:`memlayout.audit.AuditMode`), and explains every aten op that dropped the format from
the cached coverage matrix (``memlayout coverage``), as the audit does. Without a cached matrix
the note still names the op. The notes go into ``node.meta[DROPS_KEY]`` of the region's graph.

>>> import torch
>>> from torch import nn
>>> from memlayout.plan.capture.regions import capture
>>> from memlayout.plan.costs.measure import measure_costs
>>> class Net(nn.Module):  # cumsum over channels returns a contiguous tensor
...     def __init__(self):
...         super().__init__()
...         self.conv = nn.Conv2d(3, 8, 3)
...     def forward(self, x):
...         return torch.cumsum(self.conv(x), dim=1)
>>> region = capture(Net(), (torch.randn(1, 3, 12, 12),)).regions[0]
>>> table = measure_costs(region.gm, region.inputs, measure=False)
>>> notes = drop_notes(region.gm, region.inputs, table)
>>> sorted(notes), notes["cumsum"][0].startswith("aten.cumsum")
(['cumsum'], True)
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import fx

from memlayout.dtypes import autocast
from memlayout.layout import Format
from memlayout.plan.convert import convert_module_to, convert_value
from memlayout.plan.costs.table import CostTable
from memlayout.plan.graph import Label, graph_ranks
from memlayout.tensors import clone_inputs, device_of

#: ``node.meta`` key of a dropping node's notes (a list of sentences)
DROPS_KEY = "memlayout.drops"


def dropping_nodes(table: CostTable) -> list[str]:
    """Names of layout nodes that run when fed channels-last but return another format."""
    return [name for name, c in table.nodes.items()
            if c.seconds[1] is not None and c.out[1] not in (Label.CHANNELS_LAST, Label.EITHER, None)]


def drop_notes(gm: fx.GraphModule, inputs: tuple[Any, ...], table: CostTable, *,
               dtype: torch.dtype | None = None,
               device: torch.device | None = None) -> dict[str, list[str]]:
    """For each node of ``dropping_nodes(table)``, one sentence per aten op that dropped
    channels-last (from the coverage matrix when it is cached); also stored in
    ``node.meta[DROPS_KEY]``. Runs the region's graph once (no timing) when any node drops."""
    todo = set(dropping_nodes(table))
    if not todo:
        return {}
    device = device_of(inputs, gm) if device is None else device
    runner = _Explainer(gm, todo, dtype, device)
    with torch.no_grad(), autocast(device, dtype):
        runner.run(*clone_inputs(inputs))
    for n in gm.graph.nodes:
        if n.name in runner.notes:
            n.meta[DROPS_KEY] = runner.notes[n.name]
    return runner.notes


def notes_of(gm: fx.GraphModule) -> dict[str, list[str]]:
    """The notes ``drop_notes`` stored in ``gm``'s nodes, by node name."""
    return {n.name: list(n.meta[DROPS_KEY]) for n in gm.graph.nodes if DROPS_KEY in n.meta}


class _Explainer(fx.Interpreter):
    """Runs the graph as captured; a dropping node is run once more, fed channels-last (its
    weights too), under the audit recorder."""

    def __init__(self, gm: fx.GraphModule, todo: set[str], dtype: torch.dtype | None,
                 device: torch.device) -> None:
        super().__init__(gm)
        self.device = device
        self.ranks = graph_ranks(gm)
        self.todo = todo
        self.dtype = dtype
        self.notes: dict[str, list[str]] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.name in self.todo:
            self.notes[n.name] = self._explain(n, result)
        return result

    def _explain(self, n: fx.Node, result: Any) -> list[str]:
        # the audit recorder (a sibling L2 package, with rich renderers) loads only when a
        # node drops channels-last
        from memlayout.audit import AuditMode
        from memlayout.audit.recorder import coverage_notes

        args, kwargs = fx.node.map_arg((n.args, n.kwargs),
                                       lambda m: convert_value(self.env[m], 1, self.ranks))
        if n.op == "call_module":
            target = convert_module_to(copy.deepcopy(self.module.get_submodule(n.target)), 1,
                                       self.ranks)
            fn = lambda: target(*args, **kwargs)  # noqa: E731
        elif n.op == "call_function":
            fn = lambda: n.target(*args, **kwargs)  # noqa: E731
        else:
            self_arg, *rest = args
            fn = lambda: getattr(self_arg, n.target)(*rest, **kwargs)  # noqa: E731
        dtype = _first_float_dtype(result)
        meta = {"device": self.device.type, "dtype": str(dtype).removeprefix("torch.")}
        with AuditMode(fmt=Format.CHANNELS_LAST, meta=meta) as rec:
            fn()
        records = [r for r in rec.report.records if r.dropped]
        if not records:  # a rank-5 node drops channels_last_3d instead
            with AuditMode(fmt=Format.CHANNELS_LAST_3D, meta=meta) as rec:
                fn()
            records = [r for r in rec.report.records if r.dropped]
            fmt = Format.CHANNELS_LAST_3D
        else:
            fmt = Format.CHANNELS_LAST
        known = coverage_notes(records, fmt, meta)
        notes = []
        for op in dict.fromkeys(r.op for r in records):
            if op in known:
                notes.append(known[op])
            elif op.startswith("aten.convolution") and fmt is Format.CHANNELS_LAST_3D:
                notes.append(f"{op}: a 3-d convolution on {self.device.type} {meta['dtype']} "
                             "returns NCDHW even when fed NDHWC (no channels_last_3d kernel in "
                             f"torch {torch.__version__} here)")
            else:
                notes.append(f"{op} drops {fmt.value} here (no cached coverage matrix for "
                             f"{self.device.type} {meta['dtype']}: `memlayout coverage` "
                             "explains it)")
        return notes or ["returns another format when fed channels-last (no aten op flagged)"]


def _first_float_dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.Tensor):
        return value.dtype
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):
                return v.dtype
    return torch.float32
