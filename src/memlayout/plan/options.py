"""The typed records the planner's steps hand each other (L2 plan).

``memlayout.optimize`` derives one :class:`PlanOptions` from its keywords and passes it down;
each step returns one frozen record: the costs of every captured region (:class:`Costs`), the
min-cut labels per region (:class:`RegionSolution`, gathered in :class:`Solution`), the
rewritten model (:class:`Build`), the guard's choice (:class:`GuardDecision`) and the memory
step's (:class:`MemoryDecision`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memlayout.plan.capture.regions import Region
from memlayout.plan.costs.measure import CostTable, Progress
from memlayout.plan.report.result import Conversion, GuardRecord, MemoryReport, NodeChoice
from memlayout.plan.solve.formulate import AUTO, Formulation, formulate
from memlayout.plan.solve.mincut import Problem, solve_min_cut


@dataclass(frozen=True)
class PlanOptions:
    """What every step of one planning run needs to know, derived once from ``optimize``'s
    keywords and the example: device, autocast dtype, train or inference, planned ranks."""

    name: str
    device: torch.device
    dtype: torch.dtype | None  # the autocast dtype; ``None``: run as is (fp32)
    train: bool
    ranks: tuple[int, ...]  # the layout ranks planned (3 only for a model with 1-d convolutions)
    input_label: int | None  # the format inputs arrive in; ``None``: as the example is
    auto_input: bool  # input_format="auto": the plan chooses the inputs' format
    output_label: int | str | None  # "keep", 0 / 1, or ``None`` (free)
    measure: bool = True
    rounds: int = 5
    cache: bool | str | Path = True
    refresh: bool = False
    guard: bool = True
    guard_rounds: int = 5
    guard_margin: float = 0.0
    keep_weight_formats: bool = False
    contiguous_weights: bool = False  # every parameter stays contiguous (FSDP's fully_shard)
    max_plans: int = 8
    memory: bool = True
    memory_budget: int | None = None
    padding: bool = True
    blocked: bool = False
    fallback: bool = True  # a plan that fails verification gives way to a verified eager one
    keywords: bool = False  # the model takes keyword inputs: the steps call its KeywordCall
    progress: Progress | None = field(default=None, compare=False, repr=False)

    @property
    def root_input_label(self) -> int | str | None:
        """What the top-level graph's inputs are formulated with: ``"auto"``, 0 / 1, or
        ``None`` (as captured)."""
        return AUTO if self.auto_input else self.input_label

    @property
    def signature_extra(self) -> list[Any]:
        """The options a cached whole-model measurement depends on."""
        return [self.root_input_label, self.output_label, *(["train"] if self.train else []),
                *([f"weights={self.weights}"] if self.contiguous_weights else [])]

    @property
    def weights(self) -> str:
        """How weights are stored: ``"converted"`` (once, to their node's format) or
        ``"contiguous"`` (``memlayout.plan.steer.weights``)."""
        return "contiguous" if self.contiguous_weights else "converted"


@dataclass(frozen=True)
class Costs:
    """The measured (or analytical) cost table of every captured region, in region order."""

    tables: tuple[CostTable, ...]
    measured: int
    cached: int


@dataclass(frozen=True)
class RegionSolution:
    """One region's solved problem: its costs, the formulation and the min-cut labels."""

    region: Region
    table: CostTable
    form: Formulation
    labels: Mapping[str, int]

    @property
    def input_variables(self) -> list[str]:
        """The top-level graph's inputs that are layout variables (``input_format="auto"``)."""
        if self.region.path != "":
            return []
        return [n.name for n in self.region.gm.graph.nodes
                if n.op == "placeholder" and n.name in self.form.seconds.unary]

    def pin_inputs(self, label: int) -> RegionSolution:
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

    @property
    def has_variables(self) -> bool:
        return any(len(s.labels) for s in self.regions)

    def chosen_input(self) -> int | None:
        """The label the solver gave the top-level graph's inputs (all tied to one), ``None``
        when none is a variable."""
        for s in self.regions:
            names = s.input_variables
            if names:
                return s.labels[names[0]]
        return None

    def pin_inputs(self, label: int) -> Solution:
        return dataclasses.replace(self, regions=tuple(s.pin_inputs(label) for s in self.regions))

    def graphs(self) -> list[tuple[str, Any, Mapping[str, int]]]:
        """``(region path, graph, labels)`` per region, as ``guard.signature`` hashes them."""
        return [(s.region.path, s.region.gm, s.labels) for s in self.regions]


def solve_labels(problem: Problem) -> dict[str, int]:
    """The min-cut labels of ``problem``; when its weight ties contradict its pins (a shared
    module pinned two ways: one call fails in a format), solved without the ties
    (verification still guards the result)."""
    try:
        return solve_min_cut(problem).labels
    except ValueError:
        return solve_min_cut(Problem(problem.unary, problem.tensors, problem.pins)).labels


@dataclass(frozen=True)
class RegionCheck:
    """A planned region and its rewritten graph module, verified against the region's
    captured graph."""

    region: Region
    planned: nn.Module


@dataclass(frozen=True)
class Build:
    """A rewritten model: the module, the regions to verify, each node's choice and the
    conversions inserted."""

    module: nn.Module
    checks: tuple[RegionCheck, ...]
    nodes: tuple[NodeChoice, ...]
    conversions: tuple[Conversion, ...]


@dataclass(frozen=True)
class GuardDecision:
    """The build the guard kept, its record (``Plan.guard``; ``None``: the guard did not run)
    and the format the inputs now arrive in."""

    build: Build
    record: GuardRecord | None
    input_label: int | None

    @property
    def kept(self) -> str:
        """``planned``, or the eager model that replaced the plan."""
        return self.record.kept if self.record is not None else "planned"


@dataclass(frozen=True)
class MemoryDecision:
    """The build the memory step kept and its record (``Plan.memory``; ``None``: not run)."""

    build: Build
    record: MemoryReport | None


def region_formulation(region: Region, table: CostTable, options: PlanOptions) -> Formulation:
    """One region's min-cut formulation: the top-level graph takes the run's input and output
    formats, a submodule's inputs are as captured and its outputs kept."""
    top = region.path == ""
    return formulate(region.gm, table, input_label=options.root_input_label if top else None,
                     output_label=options.output_label if top else "keep")
