"""The min-cut labels of every captured region (analysis): each region's boundary problem (the
top-level graph with the run's input and output formats, a submodule's as captured), solved, with
the predicted seconds of the plan, of the model run in one format and of a plan free to convert
anywhere."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from memlayout.plan.capture.regions import Captured, Region
from memlayout.plan.costs.regions import Costs
from memlayout.plan.costs.table import CostTable
from memlayout.plan.graph import LABELS, Label, Request
from memlayout.plan.options import RunOptions
from memlayout.plan.report.records import CostPrediction
from memlayout.plan.solve.boundaries import formulate_boundaries
from memlayout.plan.solve.formulate import Formulation, formulate
from memlayout.plan.solve.mincut import Problem, objective, solve_min_cut


@dataclass(frozen=True)
class RegionSolution:
    """One region's solved problem: its costs, the formulation and the min-cut labels."""

    region: Region
    table: CostTable
    form: Formulation
    labels: Mapping[str, Label]

    @property
    def input_variables(self) -> list[str]:
        """The top-level graph's inputs that are layout variables (``input_format="auto"``)."""
        if self.region.path != "":
            return []
        return [n.name for n in self.region.gm.graph.nodes
                if n.op == "placeholder" and n.name in self.form.seconds.unary]

    def pin_inputs(self, label: Label) -> RegionSolution:
        """This solution with its input variables pinned to ``label``, solved again if its
        labels had them otherwise (the guard kept an eager model whose format is not the one
        the min cut chose)."""
        names = self.input_variables
        if not names:
            return self
        pins = dict.fromkeys(names, label)
        form = dataclasses.replace(
            self.form,
            integer=dataclasses.replace(self.form.integer, pins={**self.form.integer.pins, **pins}),
            seconds=dataclasses.replace(self.form.seconds, pins={**self.form.seconds.pins, **pins}))
        labels = self.labels
        if any(labels[n] != label for n in names):
            labels = solve_labels(form.integer)
        return RegionSolution(self.region, self.table, form, labels)


@dataclass(frozen=True)
class Solution:
    """Every region's solution and the predicted seconds of the plan and of each uniform
    labelling (``planned``, ``all_contiguous``, ``all_channels_last``)."""

    regions: tuple[RegionSolution, ...]
    predicted: dict[str, float]
    measured: int
    cached: int
    #: where node costs came from when only what could change the cut was measured
    #: (``memlayout.plan.solve.refine``); ``None``: every node measured
    prediction: CostPrediction | None = None

    @property
    def has_variables(self) -> bool:
        return any(len(s.labels) for s in self.regions)

    def chosen_input(self) -> Label | None:
        """The label the solver gave the top-level graph's inputs (all tied to one), ``None``
        when none is a variable."""
        for s in self.regions:
            names = s.input_variables
            if names:
                return s.labels[names[0]]
        return None

    def pin_inputs(self, label: Label) -> Solution:
        return dataclasses.replace(self, regions=tuple(s.pin_inputs(label) for s in self.regions))

    def graphs(self) -> list[tuple[str, Any, Mapping[str, Label]]]:
        """``(region path, graph, labels)`` per region, as ``guard.signature`` hashes them."""
        return [(s.region.path, s.region.gm, s.labels) for s in self.regions]


def solve_labels(problem: Problem) -> dict[str, Label]:
    """The min-cut labels of ``problem`` (the solver's 0 / 1 as :class:`Label`); when its
    weight ties contradict its pins (a shared module pinned two ways: one call fails in a
    format), solved without the ties (verification still guards the result)."""
    try:
        labels = solve_min_cut(problem).labels
    except ValueError:
        labels = solve_min_cut(Problem(problem.unary, problem.tensors, problem.pins)).labels
    return {name: Label(label) for name, label in labels.items()}


def region_formulation(captured: Captured, region: Any, table: Any,
                       options: RunOptions) -> Formulation:
    """One region's boundary problem: the top-level graph takes the run's input and output
    formats, a submodule's inputs are as captured and its outputs kept."""
    top = region.path == ""
    return formulate_boundaries(
        region.gm, table, input_label=options.root_input_label if top else None,
        output_label=options.output_label if top else Request.KEEP, calls=captured.calls,
        root=region.path, fixed=frozenset({""}) if options.keywords else frozenset())


def region_problem(captured: Captured, region: Region, table: CostTable,
                   options: RunOptions) -> Formulation:
    """The problem the min cut solves for one region: its boundary problem, with the nodes
    owning weights pinned to their formats where the run keeps them."""
    form = region_formulation(captured, region, table, options)
    if options.keep_weight_formats and not options.contiguous_weights:
        # (contiguous weights say nothing of the format their node runs in)
        form = pin_weight_formats(region.gm, form, table, options.ranks)
    return form


def solve_regions(captured: Captured, costs: Costs, options: RunOptions) -> Solution:
    """The min-cut labels of every region, and the predicted seconds of the plan, of the model
    run entirely in one format, and of the best plan were conversions possible anywhere
    (``anywhere``: what steering at module boundaries gives up, by the cost table)."""
    predicted = {"planned": 0.0, "all_contiguous": 0.0, "all_channels_last": 0.0,
                 "anywhere": 0.0}
    solved = []
    for region, table in zip(captured.regions, costs.tables, strict=True):
        form = region_problem(captured, region, table, options)
        labels = solve_labels(form.integer)
        relaxed = Problem(form.seconds.unary, form.seconds.tensors)
        predicted["planned"] += objective(relaxed, labels) or 0.0
        for label, key in ((Label.CONTIGUOUS, "all_contiguous"),
                           (Label.CHANNELS_LAST, "all_channels_last")):
            predicted[key] += uniform_seconds(form, table, label)
        free = formulate(region.gm, table, input_label=options.root_input_label
                         if region.path == "" else None,
                         output_label=options.output_label if region.path == "" else Request.KEEP)
        predicted["anywhere"] += objective(Problem(free.seconds.unary, free.seconds.tensors),
                                           solve_labels(free.integer)) or 0.0
        solved.append(RegionSolution(region, table, form, labels))
    return Solution(tuple(solved), predicted, costs.measured, costs.cached)


def uniform_seconds(form: Formulation, table: Any, label: Label) -> float:
    """The predicted seconds of every layout node in ``label`` (a node whose other label
    fails stays pinned), with the fewest conversions the boundaries then need."""
    pins = {**{n: label for n in table.nodes}, **form.integer.pins}
    try:
        labels = solve_labels(Problem(form.integer.unary, form.integer.tensors, pins,
                                      form.integer.ties))
    except ValueError:  # a pinned node tied to one in the other label: nothing realizable
        labels = {n: pins.get(n, label) for n in form.seconds.unary}
    return objective(Problem(form.seconds.unary, form.seconds.tensors), labels) or 0.0


def pin_weight_formats(gm: Any, form: Formulation, table: Any,
                       ranks: tuple[int, ...]) -> Formulation:
    """``form`` with every node that owns (or reads) layout-rank parameters pinned to the
    format those parameters have (canonical strides), where exactly one format fits: a plan
    for another shape keeps the weights as they are."""
    from memlayout.layout import strides_for
    from memlayout.plan.costs.table import module_has_layout_params
    from memlayout.plan.graph import attribute

    pins: dict[str, Label] = {}
    for n in gm.graph.nodes:
        if n.name not in table.nodes or n.name in form.integer.pins:
            continue
        tensors: list[torch.Tensor] = []
        if n.op == "call_module" and module_has_layout_params(gm, n):
            sub = gm.get_submodule(n.target)
            tensors += [t for t in [*sub.parameters(), *sub.buffers()] if t.dim() in ranks]
        for m in n.all_input_nodes:
            value = attribute(gm, str(m.target)) if m.op == "get_attr" else None
            if isinstance(value, torch.Tensor) and value.dim() in ranks:
                tensors.append(value)
        fits = [label for label in LABELS if tensors and all(
            tuple(t.stride()) == strides_for(tuple(t.shape), Label(label).format(t.dim()))
            for t in tensors)]
        if len(fits) == 1:
            pins[n.name] = fits[0]
    if not pins:
        return form
    return dataclasses.replace(
        form, integer=dataclasses.replace(form.integer, pins={**form.integer.pins, **pins}),
        seconds=dataclasses.replace(form.seconds, pins={**form.seconds.pins, **pins}))
