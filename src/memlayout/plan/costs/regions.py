"""The cost table of every captured region (analysis): measured, cached or analytical, with each
node's reason for dropping channels-last noted in its meta."""

from __future__ import annotations

from dataclasses import dataclass

from memlayout.plan.capture.regions import Captured
from memlayout.plan.costs.cache import CostCache
from memlayout.plan.costs.drops import drop_notes
from memlayout.plan.costs.measure import measure_costs
from memlayout.plan.costs.table import CostTable
from memlayout.plan.options import RunOptions


def measure_regions(captured: Captured, options: RunOptions,
                    store: CostCache | None) -> Costs:
    """The cost table of every captured region (measured, cached, or analytical), with each
    node's reason for dropping channels-last noted in its meta."""
    tables = []
    for region in captured.regions:
        table = measure_costs(region.gm, region.inputs, dtype=options.dtype,
                              measure=options.measure, cache=store, rounds=options.rounds,
                              progress=options.progress, train=options.train,
                              device=options.device, weights=options.weights)
        drop_notes(region.gm, region.inputs, table, dtype=options.dtype,  # into node.meta
                   device=options.device)
        tables.append(table)
    return Costs(tuple(tables), sum(t.measured for t in tables), sum(t.cached for t in tables))


@dataclass(frozen=True)
class Costs:
    """The measured (or analytical) cost table of every captured region, in region order."""

    tables: tuple[CostTable, ...]
    measured: int
    cached: int
