"""The plan as plain data (L2 plan, report): every step's record gathered into one :class:`Plan`."""

from __future__ import annotations

from typing import Any

import torch

from memlayout.plan.capture.regions import Captured, model_signature
from memlayout.plan.check.guard import GuardDecision
from memlayout.plan.check.memory import MemoryDecision
from memlayout.plan.costs.table import measured_on
from memlayout.plan.graph import Label
from memlayout.plan.options import PlanOptions
from memlayout.plan.report.plan import Plan
from memlayout.plan.report.records import BlockedReport, PadChoice, Verification, conv1d_notes
from memlayout.plan.solve.regions import Solution
from memlayout.plan.steer.weights import storage_counts
from memlayout.tensors import iter_tensors


def make_plan(captured: Captured, solution: Solution, decision: GuardDecision,
              memory: MemoryDecision, inputs: tuple[Any, ...], options: PlanOptions, *,
              verification: Verification, padding: tuple[PadChoice, ...],
              blocked: BlockedReport | None, seconds: float, notes: list[str],
              training: bool, realized: list[str]) -> Plan:
    """The plan as plain data (``training``: the model's train/eval mode)."""
    entry = decision.input_label
    output = options.output_label
    built = memory.build
    nodes = list(built.nodes)
    notes = [*conv1d_notes(nodes), *notes]  # rank 3: planned, or why not
    if options.contiguous_weights and decision.kept != "planned":
        notes.append(f"weights='contiguous': every parameter contiguous; the guard kept "
                     f"{decision.kept}, whose nodes read their weights as they are")
    elif options.contiguous_weights:
        counts = {"as_is": 0, "per_call": 0}
        for s in solution.regions:
            storage = {n: c.weights for n, c in s.table.nodes.items()}
            for kind, k in storage_counts(s.labels, storage).items():
                counts[kind] += k
        notes.append(
            f"weights='contiguous': every parameter contiguous; {counts['as_is']} channels-last "
            f"nodes read their weights as they are, {counts['per_call']} convert them per call "
            "(whichever measured faster)")
    if options.auto_input:
        notes.append(
            f"input_format='auto': inputs should arrive {Label(entry).text} (converted "
            "on entry otherwise)" if entry is not None else
            "input_format='auto': no input in a definite format at the top level; inputs "
            "are taken as they come")
    return Plan(
        model=options.name, device=measured_on(options.device), torch_version=torch.__version__,
        dtype=None if options.dtype is None else str(options.dtype).removeprefix("torch."),
        input_format=None if entry is None else Label(entry).text,
        output_format=None if output is None else output.text,
        nodes=nodes, conversions=list(built.conversions),
        predicted=solution.predicted, regions=[r.path for r in captured.regions],
        uncaptured=[[p, r] for p, r in captured.uncaptured],
        measured=solution.measured, cached=solution.cached, measure=options.measure,
        planning_seconds=seconds, verification=verification, guard=decision.record,
        padding=padding, memory=memory.record, blocked=blocked, train=options.train,
        input_shapes=[list(t.shape) for t in iter_tensors(inputs)],
        weight_formats_kept=options.keep_weight_formats, coverage=captured.coverage,
        costs_timed=sum(s.table.timed_costs for s in solution.regions),
        costs_noisy=sum(s.table.noisy_costs for s in solution.regions),
        model_signature=model_signature(captured), notes=notes,
        weights=options.weights, mode="train" if training else "eval", realized=realized,
    )
