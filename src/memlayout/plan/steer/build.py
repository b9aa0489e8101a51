"""From a solved plan to a steered model (application).

:func:`steering_of` turns every region's min-cut labels into a :class:`Steering`: a layout
node's label is the format of the parameters it owns (converted once), and every boundary
crossing whose two sides got different labels converts there. :func:`build` applies it to a
copy of the model; :func:`build_uniform` builds the model run entirely in one format (eager
NCHW or NHWC: every layout parameter in it, the model's inputs converted on entry), what the
guard times the plan against and what a plan that fails verification gives way to.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memlayout.plan.capture.calls import RUN_KEY, ModuleCall, positions
from memlayout.plan.capture.regions import Captured
from memlayout.plan.costs.drops import notes_of
from memlayout.plan.costs.table import input_kind, module_has_layout_params
from memlayout.plan.graph import LABELS, META_KEY, Label, Request
from memlayout.plan.inputs import KeywordCall
from memlayout.plan.options import RunOptions
from memlayout.plan.report.records import Conversion, NodeChoice
from memlayout.plan.solve.boundaries import IN, unsafe_values
from memlayout.plan.solve.regions import Solution
from memlayout.plan.steer.boundary import Boundary, Leaf, Returned
from memlayout.plan.steer.state import Formats, output_formats
from memlayout.plan.steer.steering import Steering, steer
from memlayout.plan.weights import PER_CALL, can_convert_per_call


@dataclass(frozen=True)
class Build:
    """A steered copy of the model: ``module`` (what the planner's steps call: the model, or
    its keyword-call wrapper), the :class:`Steering` applied, each layout node's choice and
    the conversions the steered model makes. ``label``: the one format of a model run
    entirely in it (eager NCHW / NHWC), ``None`` for the plan."""

    module: nn.Module
    steering: Steering
    nodes: tuple[NodeChoice, ...]
    conversions: tuple[Conversion, ...]
    label: Label | None = None

    @property
    def model(self) -> nn.Module:
        """The user's model inside ``module`` (its own class and tree, steered)."""
        return self.module.module if isinstance(self.module, KeywordCall) else self.module


def user_path(path: str, options: RunOptions) -> str:
    """A module path of the planned (maybe keyword-wrapped) model as the user's model names it."""
    if not options.keywords:
        return path
    if path == "module":
        return ""
    return path.removeprefix("module.")


def steering_of(solution: Solution, options: RunOptions,
                storage: Mapping[tuple[str, str], str | None] | None = None) -> Steering:
    """The parameters' formats and the boundaries' conversions of a solved plan. ``storage``:
    how each node (``(region, name)``) reads contiguous weights, where it is not its cost
    table's (a saved plan's)."""
    parameters: dict[str, Label] = {}
    inputs: dict[str, list[Leaf]] = {}
    outputs: dict[str, list[Leaf]] = {}
    weights: dict[str, Label] = {}
    for s in solution.regions:
        gm, labels = s.region.gm, s.labels
        prefix = f"{s.region.path}." if s.region.path else ""
        for n in gm.graph.nodes:
            cost = s.table.nodes.get(n.name)
            if cost is None:
                continue
            label = labels[n.name]
            if options.contiguous_weights:
                owner = _weight_owner(gm, n)
                how = cost.weights if storage is None else storage.get((s.region.path, n.name))
                if label == Label.CHANNELS_LAST and how == PER_CALL and owner is not None:
                    weights[user_path(prefix + owner, options)] = Label.CHANNELS_LAST
                continue
            if n.op == "call_module" and module_has_layout_params(gm, n):
                sub = gm.get_submodule(str(n.target))
                for name, t in [*sub.named_parameters(recurse=False),
                                *sub.named_buffers(recurse=False)]:
                    if t.dim() in options.ranks:
                        parameters.setdefault(user_path(f"{prefix}{n.target}.{name}", options),
                                              label)
            for m in n.all_input_nodes:
                if input_kind(gm, m) == "param":
                    parameters.setdefault(user_path(prefix + str(m.target), options), label)
        for c in s.form.crossings:
            outer, inner = labels[c.outer], labels[c.inner]
            if not c.convertible or outer == inner:
                continue
            to = inner if c.side == IN else outer
            side = inputs if c.side == IN else outputs
            side.setdefault(user_path(c.module, options), []).extend(
                Leaf(p, to, rank) for p, rank in c.leaves)
    paths = sorted({*inputs, *outputs, *weights})
    return Steering(tuple(parameters.items()), tuple(
        (path, Boundary(tuple(sorted(set(inputs.get(path, ())))),
                        tuple(sorted(set(outputs.get(path, ())))), weights.get(path)))
        for path in paths))


def _weight_owner(gm: Any, n: Any) -> str | None:
    """The module that owns the convolution weight node ``n`` reads (``weights="contiguous"``
    converts it per call there), ``None`` when it is no plain convolution."""
    if n.op == "call_module":
        sub = gm.get_submodule(str(n.target))
        return str(n.target) if can_convert_per_call(sub) else None
    for m in n.all_input_nodes:
        if input_kind(gm, m) == "param":
            owner, _, name = str(m.target).rpartition(".")
            sub = gm.get_submodule(owner) if owner else gm
            if name == "weight" and can_convert_per_call(sub):
                return owner
    return None


def uniform_steering(label: Label, options: RunOptions, model: nn.Module,
                     conversions: tuple[Conversion, ...]) -> Steering:
    """The model run entirely in ``label``: every layout-rank parameter and buffer in it
    (none with contiguous weights: they stay as they are), and the model's inputs converted
    on entry exactly where ``conversions`` (:func:`uniform_conversions`) lists them."""
    parameters: tuple[tuple[str, Label], ...] = ()
    if not options.contiguous_weights:
        parameters = tuple((name, label) for name, t in _tensors(model)
                           if t.dim() in options.ranks)
    leaves = tuple(sorted({Leaf(p, label, rank) for c in conversions for p, rank in c.leaves}))
    return Steering(parameters, (("", Boundary(inputs=leaves)),) if leaves else ())


def uniform_conversions(solution: Solution, calls: Mapping[str, ModuleCall], label: Label,
                        options: RunOptions, arrive: Label | None) -> tuple[Conversion, ...]:
    """The conversions of the model run entirely in ``label``: each top-level input that
    arrives in the other format (``arrive``; ``None``: as the example is), on entry, except
    one the forward changes in place or returns a view of (a copy would split it from the
    caller's)."""
    record = calls.get("module" if options.keywords else "")
    top = next((s for s in solution.regions if s.region.path == ""), None)
    if record is None or top is None:
        return ()
    kept = set(record.mutated)
    unsafe = unsafe_values(top.region.gm)
    for n in top.region.gm.graph.nodes:
        if n.op == "placeholder" and n.name in unsafe and RUN_KEY in n.meta:
            kept.update(positions(record.inputs, n.meta[RUN_KEY].leaves))
    found = []
    for n in top.region.gm.graph.nodes:
        meta = n.meta.get(META_KEY)
        if n.op != "placeholder" or meta is None or meta.label not in LABELS:
            continue
        if (meta.label if arrive is None else arrive) == label or RUN_KEY not in n.meta:
            continue
        where = [p for p in positions(record.inputs, n.meta[RUN_KEY].leaves)
                 if p not in kept and (leaf := record.inputs[p]) is not None
                 and len(leaf.shape) in options.ranks]
        if not where:
            continue
        cost = top.table.conversions.get(n.name)
        found.append(Conversion(
            "", n.name, Label(label).text, [list(t.shape) for t in meta.layout_tensors],
            meta.nbytes, 0.0 if cost is None else cost.to_1 if label else cost.to_0,
            ["in the model"], "", "in",
            [[p, len(record.inputs[p].shape)] for p in where]))  # type: ignore[union-attr]
    return tuple(found)


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def build(reference: nn.Module, steering: Steering, options: RunOptions, *,
          outputs: Formats, input_label: Label | None, nodes: tuple[NodeChoice, ...] = (),
          conversions: tuple[Conversion, ...] = (), label: Label | None = None,
          key: Any = "example") -> Build:
    """A copy of ``reference`` (the original; a keyword-call wrapper around it when the
    model takes keyword inputs) with ``steering`` applied; ``input_label``: the format its
    inputs are converted to on entry (``None``: as they come)."""
    module = copy.deepcopy(reference)
    model = module.module if isinstance(module, KeywordCall) else module
    steer(model, steering, key=key, input_label=input_label, outputs=outputs,
          plan=None, dtype=options.dtype, ranks=options.ranks, max_plans=options.max_plans)
    return Build(module, steering, nodes, conversions, label)


def node_choices(solution: Solution, label: Label | None = None) -> tuple[NodeChoice, ...]:
    """Each layout node's choice (the plan's, or ``label`` for a model run in one format)."""
    return tuple(
        NodeChoice(s.region.path, n, c.op, Label(s.labels[n] if label is None else label).text,
                   {lb.text: t for lb, t in zip(LABELS, c.seconds, strict=True)}, c.timed,
                   notes_of(s.region.gm).get(n, []), c.weights)
        for s in solution.regions for n, c in s.table.nodes.items())


def conversions_of(solution: Solution, options: RunOptions) -> tuple[Conversion, ...]:
    """The conversions the plan's boundaries make, with what each costs."""
    found = []
    for s in solution.regions:
        labels = s.labels
        for c in s.form.crossings:
            outer, inner = labels[c.outer], labels[c.inner]
            if not c.convertible or outer == inner:
                continue
            to = inner if c.side == IN else outer
            cost = s.table.conversions[c.value]
            found.append(Conversion(
                s.region.path, c.value, Label(to).text, [list(x) for x in cost.shapes],
                cost.nbytes, cost.to_1 if to == 1 else cost.to_0,
                [f"{c.side} {c.call or 'the model'}"], user_path(c.module, options), c.side,
                [list(x) for x in c.leaves]))
    return tuple(found)


def wanted_outputs(captured: Captured, inputs: tuple[Any, ...], options: RunOptions) -> Formats:
    """The formats the planned model hands its results back in: as the original does
    (``output_format="keep"``), all in one format, or as they come (``None``)."""
    label = options.output_label
    if label is None:
        return ()
    kept = output_formats(captured.output, inputs, options.ranks)
    if isinstance(label, Request):  # Request.KEEP
        return kept
    return tuple(Returned(i, label if rank in options.ranks else None, rank)
                 for i, _, rank in kept)
