"""A value's conversion costs: those the cost cache holds (or the analytical model gives,
with nothing measured), looked up before a cost pass measures the rest (``measure.py``)."""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import fx

from memlayout.plan.costs.analytical import analytical_conversion
from memlayout.plan.costs.cache import CostCache
from memlayout.plan.costs.table import (
    ConversionCost,
    CostTable,
    is_layout_node,
    measured_on,
    valid_conversion_record,
)
from memlayout.plan.graph import LABELS, META_KEY, ValueMeta


def look_up_conversions(gm: fx.GraphModule, table: CostTable, cache: CostCache | None, *,
                         device: torch.device, dtype: torch.dtype | None,
                         measure: bool, known: frozenset[str] = frozenset()
                         ) -> dict[str, list[str]]:
    """Fill ``table.conversions`` with each consumed definite-format value's conversion the
    cache holds (analytical ones when not ``measure``), ``known`` ones left out; returns the
    cache keys (to 1, to 0) of those still to be measured, by value name."""
    context = [measured_on(device), torch.__version__, str(dtype)]
    values = [n for n in gm.graph.nodes if n.op != "get_attr"
              and n.meta.get(META_KEY) is not None and n.meta[META_KEY].label in LABELS]
    todo: dict[str, list[str]] = {}
    for v in values:
        meta: ValueMeta = v.meta[META_KEY]
        if v.name in known or not consumed(gm, v):
            continue
        if not measure:
            table.conversions[v.name] = analytical_conversion(v.name, meta)
            continue
        shapes = [[list(t.shape), t.dtype] for t in meta.layout_tensors]
        keys = [json.dumps(["convert", *context, shapes, to]) for to in (1, 0)]
        entries = ([cache.entry(k, valid_conversion_record) for k in keys]
                   if cache is not None else [None, None])
        if all(e is not None for e in entries):
            table.cached += 1
            table.conversions[v.name] = conversion_cost(v.name, meta, [e.value for e in entries],
                                                         noisy=any(e.noisy for e in entries))
        else:
            todo[v.name] = keys
    return todo


def consumed(gm: fx.GraphModule, v: fx.Node) -> bool:
    """``v`` is read by a node whose layout matters, or is an output: its format can need a
    conversion."""
    return any(u.op == "output" or is_layout_node(gm, u) for u in v.users)


def conversion_cost(name: str, meta: ValueMeta, records: list[Any], *,
                     noisy: bool = False) -> ConversionCost:
    """A value's conversion cost from its two stored records (to channels-last, to
    contiguous)."""
    return ConversionCost(name, records[0]["s"], records[1]["s"], meta.nbytes,
                          tuple(t.shape for t in meta.layout_tensors), True, noisy)


__all__ = ["consumed", "conversion_cost", "look_up_conversions"]
