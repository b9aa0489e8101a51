"""Apply a saved plan (L2 plan): ``memlayout.apply(model, plan)`` rebuilds the planned model
from a :class:`~memlayout.plan.report.plan.Plan` (``Plan.from_json``) without measuring anything,
and verifies it like a fresh plan.

The plan says, per captured region and layout node, which format it runs in (so which format
each parameter takes), where the steered model converts (``Plan.conversions``: the module,
in or out, which leaves), how parameters are stored (``weights``), which convolutions run
padded, and which whole-model candidate the guard kept. ``apply`` captures the model again,
checks that it is the model the plan was made for (torch version, train/eval mode, regions,
every layout node's name and op, the shapes and dtypes of every value and parameter:
``model_signature``), then steers it as the plan says.

>>> import torch
>>> from torch import nn
>>> from memlayout.plan.pipeline import optimize
>>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3)).eval()
>>> saved = optimize(net, torch.randn(1, 3, 12, 12), measure=False, cache=False).plan.to_json()
>>> opt = apply(net, Plan.from_json(saved))
>>> formats = [n.format for n in Plan.from_json(saved).nodes]
>>> opt.plan.measured, [n.format for n in opt.plan.nodes] == formats, type(opt) is nn.Sequential
(0, True, True)
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memlayout.errors import PlanError
from memlayout.plan import pipeline
from memlayout.plan.candidates.padding import block_sizes, padded_channels
from memlayout.plan.capture.regions import Captured, capture, model_signature
from memlayout.plan.check.guard import PLANNED, UNIFORM, build_uniform
from memlayout.plan.check.semantics import module_state
from memlayout.plan.check.verification import verify
from memlayout.plan.costs.regions import measure_regions
from memlayout.plan.graph import Label
from memlayout.plan.inputs import check_materialized, example_inputs_of, inputs_in, keyword_call
from memlayout.plan.options import PlanOptions, RunOptions, run_options
from memlayout.plan.report.plan import Plan
from memlayout.plan.report.records import UNPADDED
from memlayout.plan.solve.mincut import Problem
from memlayout.plan.solve.regions import RegionSolution, Solution, region_formulation, solve_labels
from memlayout.plan.steer.boundary import Boundary, Leaf
from memlayout.plan.steer.build import build, node_choices, steering_of, wanted_outputs
from memlayout.plan.steer.steering import Steering
from memlayout.tensors import clone_inputs, device_of, iter_tensors


def apply(model: nn.Module, plan: Plan | str | Path, example_inputs: Any = None, *,
          kwargs: dict[str, Any] | None = None, inplace: bool = False) -> nn.Module:
    """``model`` planned as ``plan`` says (a :class:`Plan`, or the path of its JSON), nothing
    measured, verified like a fresh plan; a copy, or (``inplace``) the caller's object.

    ``example_inputs`` (and ``kwargs``, the keyword inputs the plan was made with): what to
    capture and verify on (default: random float32 tensors of the plan's input shapes, on the
    model's device). Raises ``PlanError`` when ``plan`` was made for another model (regions,
    layout nodes, shapes), another torch version, or the model in its other train/eval mode,
    and ``LayoutVerificationError`` when the planned model would compute something else.
    Other input shapes are planned on first sight from the analytical cost model (nothing
    measured)."""
    start = time.perf_counter()
    if not isinstance(model, nn.Module):
        raise PlanError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(plan, (str, Path)):
        plan = read_plan(Path(plan))
    if not isinstance(plan, Plan):
        raise PlanError(f"plan must be a memlayout Plan (Plan.from_json) or the path of its "
                        f"JSON, got {type(plan).__name__}")
    if plan.torch_version != torch.__version__:
        raise PlanError(f"the plan was made with torch {plan.torch_version}, this is torch "
                        f"{torch.__version__}: kernels and their formats differ between "
                        "versions; plan the model again with memlayout.optimize")
    inputs = _example(model, plan, example_inputs)
    root, inputs = keyword_call(model, inputs, dict(kwargs or {}))
    check_materialized(root, inputs)
    mode = "train" if model.training else "eval"
    if mode != plan.mode:
        raise PlanError(f"the plan was made for the model in {plan.mode} mode and this one is in "
                        f"{mode} mode (BatchNorm and dropout run otherwise): call "
                        f"model.{plan.mode}() first, or plan it in {mode} mode with "
                        "memlayout.optimize")
    options = run_options(saved_options(plan), root, inputs, keywords=root is not model)
    if options.input_label is not None:
        inputs = inputs_in(inputs, options.input_label, options.ranks)
    reference = pipeline.reference_copy(root)
    state = module_state(reference)
    example = clone_inputs(inputs)
    captured = capture(pipeline.analysis_copy(reference), inputs, dtype=options.dtype,
                       ranks=options.ranks, device=options.device)
    costs = measure_regions(captured, options, None)  # analytical: nothing timed
    _check_matches(plan, captured, costs, inputs)
    solution = _solution(plan, captured, costs, options)
    outputs = wanted_outputs(captured, inputs, options)
    kept = plan.guard.kept if plan.guard is not None else PLANNED
    if kept in UNIFORM:
        built = build_uniform(reference, captured, solution, UNIFORM[kept], options,
                                outputs, arrive=options.input_label)
    else:
        built = build(reference, _steering(plan, solution, options), options, outputs=outputs,
                      input_label=options.input_label, nodes=node_choices(solution),
                      conversions=tuple(plan.conversions))
    chosen = [c for c in plan.padding if c.chosen != UNPADDED]
    if chosen and not plan.train:
        try:
            channels = padded_channels(built.module, chosen,
                                       block_sizes(options.device, options.dtype))
        except (KeyError, AttributeError) as exc:
            raise PlanError(f"the plan pads convolutions ({', '.join(c.module for c in chosen)}) "
                            f"in a way this machine's vector width does not ({exc}); plan the "
                            "model again here") from None
        built = build(reference, built.steering.padded(channels), options, outputs=outputs,
                      input_label=options.input_label, nodes=built.nodes,
                      conversions=built.conversions, label=built.label)
    verification = verify(reference, built, example, options, state, ())
    applied = dataclasses.replace(
        plan, verification=verification, measured=0, cached=0,
        planning_seconds=time.perf_counter() - start,
        notes=[*plan.notes, "applied from a saved plan (memlayout.apply): nothing measured, "
                            "verified here"])
    return pipeline.finish(model, built, applied, inputs, options, inplace=inplace)


def saved_options(plan: Plan) -> PlanOptions:
    """The options ``plan`` was made with, as ``apply`` runs them: nothing measured, guarded,
    padded or timed for memory (the plan's choices stand), verified as a fresh plan."""
    return PlanOptions(
        dtype=plan.dtype, input_format=plan.input_format, output_format=plan.output_format,
        measure=False, cache=False, rounds=1, name=plan.model, guard=False, guard_rounds=0,
        train=plan.train, keep_weight_formats=plan.weight_formats_kept, memory=False,
        padding=False, weights=plan.weights,
        same_draws=bool(plan.verification and getattr(plan.verification, "draws", None)))


def _steering(plan: Plan, solution: Solution, options: RunOptions) -> Steering:
    """The plan's parameters (from its nodes' formats) and its boundaries as it recorded them."""
    params = steering_of(solution, options, {(n.region, n.name): n.weights for n in plan.nodes})
    boundaries: dict[str, dict[str, list[Leaf]]] = {}
    for c in plan.conversions:
        to = Label.parse(c.to)
        side = boundaries.setdefault(c.module, {"in": [], "out": []})[c.side]
        side.extend(Leaf(position, to, rank) for position, rank in c.leaves)
    weights = {path: b.weight_label for path, b in params.boundaries
               if b.weight_label is not None}
    paths = sorted({*boundaries, *weights})
    return Steering(params.parameters, tuple(
        (path, Boundary(tuple(sorted(set(boundaries.get(path, {}).get("in", ())))),
                        tuple(sorted(set(boundaries.get(path, {}).get("out", ())))),
                        weights.get(path)))
        for path in paths))


def read_plan(path: Path) -> Plan:
    """The plan saved at ``path``; ``PlanError`` naming the file and what is wrong with it."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanError(f"plan file {path}: cannot be read ({exc.strerror}); pass the path of "
                        "a plan saved with Plan.to_json or `memlayout optimize --save`") from None
    except UnicodeDecodeError as exc:
        raise PlanError(f"plan file {path}: not text (byte {exc.start} is not UTF-8), so not a "
                        "plan's JSON; pass the path of a plan saved with Plan.to_json or "
                        "`memlayout optimize --save`") from None
    try:
        return Plan.from_json(text)
    except PlanError as exc:
        raise PlanError(f"plan file {path}: {exc}") from None


def _example(model: nn.Module, plan: Plan, example_inputs: Any) -> tuple[Any, ...]:
    if example_inputs is not None:
        return example_inputs_of(example_inputs)
    if not plan.input_shapes:
        raise PlanError("the plan records no input shapes: pass example_inputs to apply")
    device = device_of((), model)
    if device.type == "meta":
        device = torch.device("cpu")  # check_materialized says what to do about the weights
    return tuple(torch.randn(shape, device=device) for shape in plan.input_shapes)


def _check_matches(plan: Plan, captured: Captured, costs: Any, inputs: tuple[Any, ...]) -> None:
    """``PlanError`` naming the first thing the model differs in from the planned one."""
    shapes = [list(t.shape) for t in iter_tensors(inputs)]
    if plan.input_shapes and shapes != plan.input_shapes:
        raise PlanError(f"the example inputs have shapes {shapes}, the plan was made for "
                        f"{plan.input_shapes}; pass inputs of those shapes (other shapes are "
                        "planned on first sight once applied)")
    regions = [r.path for r in captured.regions]
    if regions != plan.regions:
        raise PlanError(f"the model is captured as the regions {regions}, the plan was made for "
                        f"{plan.regions}: another model; plan it with memlayout.optimize")
    for region, table in zip(captured.regions, costs.tables, strict=True):
        planned = {n.name: n for n in plan.nodes if n.region == region.path}
        where = f" in region {region.path!r}" if region.path else ""
        extra = [n for n in table.nodes if n not in planned]
        missing = [n for n in planned if n not in table.nodes]
        if extra or missing:
            what = (f"has layout node {extra[0]!r} ({table.nodes[extra[0]].op}), which the plan "
                    "does not" if extra else f"has no layout node {missing[0]!r} "
                    f"({planned[missing[0]].op}), which the plan has")
            raise PlanError(f"the model{where} {what}: the plan was made for another model; plan "
                            "it with memlayout.optimize")
        for name, cost in table.nodes.items():
            if cost.op != planned[name].op:
                raise PlanError(f"layout node {name!r}{where} runs {cost.op}, the plan has "
                                f"{planned[name].op}: another model; plan it with "
                                "memlayout.optimize")
    if plan.model_signature and plan.model_signature != model_signature(captured):
        raise PlanError("the model's parameter or value shapes or dtypes differ from those of "
                        "the model the plan was made for (same layout nodes): another model or "
                        "another input dtype; plan it with memlayout.optimize")


def _solution(plan: Plan, captured: Captured, costs: Any, options: RunOptions) -> Solution:
    """Each region's formulation with every layout node pinned to the plan's format."""
    regions = []
    for region, table in zip(captured.regions, costs.tables, strict=True):
        form = region_formulation(captured, region, table, options)
        pins = {**form.integer.pins, **{n.name: Label.parse(n.format) for n in plan.nodes
                                         if n.region == region.path}}
        labels = solve_labels(Problem(form.integer.unary, form.integer.tensors, pins,
                                      form.integer.ties))
        regions.append(RegionSolution(region, table, form, labels))
    return Solution(tuple(regions), dict(plan.predicted), 0, 0)


__all__ = ["apply", "read_plan"]
