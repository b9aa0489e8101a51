"""``memlayout.optimize``: capture -> costs -> solve -> steer -> guard -> memory -> verify.

``optimize`` takes one :class:`~memlayout.plan.options.PlanOptions` (or its fields as
keywords), resolves it against the model and example into a
:class:`~memlayout.plan.options.RunOptions`, and runs the steps below in order, each
returning a frozen record the next one reads. Analysis (capture, costs, the min cut) works on
a throwaway copy of the model; what is built, guarded, verified and returned is the model's
own class and tree (a copy, or the caller's object with ``inplace=True``), steered:
parameters in their planned formats, conversions at module boundaries
(``memlayout.plan.steer``).

>>> import torch
>>> from torch import nn
>>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.GroupNorm(2, 8), nn.Conv2d(8, 8, 3))
>>> opt = optimize(net, torch.randn(1, 3, 12, 12), measure=False)
>>> opt.plan.verification.ok, opt.plan.verification.check, opt.plan.measured
(True, 'dtype tolerance', 0)
>>> type(opt) is nn.Sequential, torch.equal(opt(torch.ones(1, 3, 12, 12)), opt(torch.ones(1, 3, 12, 12)))
(True, True)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memlayout.errors import LayoutVerificationError, PlanError
from memlayout.plan import reuse
from memlayout.plan.candidates.blocked import measure_blocked
from memlayout.plan.candidates.padding import padding_step
from memlayout.plan.capture.reads import reads_note, refuse_declared_input
from memlayout.plan.capture.regions import Captured, capture, model_signature
from memlayout.plan.check.guard import (
    PLANNED,
    GuardDecision,
    build_uniform,
    guarded_build,
    suspect_costs,
    suspect_note,
)
from memlayout.plan.check.memory import MemoryDecision, plan_signature
from memlayout.plan.check.memory import memory_step as peak_memory_step
from memlayout.plan.check.realized import realized_differences
from memlayout.plan.check.semantics import module_state, restore_state
from memlayout.plan.check.verification import changed_inputs, fall_back, verify
from memlayout.plan.costs.cache import CostCache
from memlayout.plan.costs.faults import fault_notes
from memlayout.plan.costs.regions import measure_regions
from memlayout.plan.costs.table import measured_on
from memlayout.plan.graph import Label
from memlayout.plan.inputs import (
    KeywordCall,
    check_materialized,
    example_inputs_of,
    inputs_in,
    keyword_call,
)
from memlayout.plan.options import PlanOptions, RunOptions, run_options
from memlayout.plan.report.clock import StepClock
from memlayout.plan.report.plan import Plan
from memlayout.plan.report.records import (
    BlockedReport,
    PadChoice,
    Price,
    Verification,
    conv1d_notes,
)
from memlayout.plan.solve.refine import refined_solution
from memlayout.plan.solve.regions import Solution, solve_regions
from memlayout.plan.steer.build import (
    Build,
    build,
    conversions_of,
    node_choices,
    steering_of,
    wanted_outputs,
)
from memlayout.plan.steer.state import Formats, shape_signature
from memlayout.plan.steer.steering import STATE, Steering, planned_state, steer, unsteer
from memlayout.plan.weights import storage_counts
from memlayout.tensors import clone_inputs, device_of, iter_tensors


def optimize(model: nn.Module, example_inputs: Any, *, options: PlanOptions | None = None,
             kwargs: dict[str, Any] | None = None, inplace: bool = False,
             **overrides: Any) -> nn.Module:
    """Plan a format per layout-sensitive operation from costs measured here, steer a copy of
    ``model`` with it and verify it; the caller's model is left unchanged (``inplace=True``:
    the caller's object is planned instead, after the copy verified). What comes back is the
    model's own class and tree running its own ``forward``: parameters in their planned
    formats, conversions at module boundaries (``memlayout.plan.steer``), results in the
    original's strides, each module in its own train/eval mode; ``model.plan`` and
    ``model.memlayout`` hold the plans.

    ``options``: a :class:`~memlayout.plan.options.PlanOptions` (default: its defaults);
    ``overrides``: any of its fields by name, replacing the record's, so
    ``optimize(model, x, measure=False)`` is ``optimize(model, x,
    options=PlanOptions(measure=False))``; a name that is no field is a ``TypeError``. The
    options (each a documented field of ``PlanOptions``; in full: ``docs/planner.md``):

    - ``dtype``: plan and run under autocast (``"bf16"``, ``"fp16"``); ``None``/fp32: as is.
    - ``input_format``: the format inputs arrive in (default: as the example is), or
      ``"auto"``: the plan chooses it (``plan.input_format``); ``output_format``: ``"keep"``
      (as the original returns them), a format, or ``None`` (as they come).
    - ``measure=False``: an analytical cost model instead of timing; ``cache``: ``True`` (the
      user cache), ``False`` or a database path; ``refresh``: measure everything again;
      ``progress(done, total, what)`` is called while measuring; ``rounds``: per op.
    - ``guard`` (with ``measure``): the plan timed as a whole model against the model run all
      NCHW and all NHWC for ``guard_rounds`` interleaved rounds, kept unless one is faster by
      more than ``guard_margin`` (``plan.guard``; ``memlayout.plan.check.guard``).
    - ``train``: plan a training step (costs forward + backward, verification through one
      step's outputs, gradients and running statistics); gradients come back in their
      parameters' strides.
    - ``keep_weight_formats``: nodes owning rank-4/5 parameters run in the parameters' formats;
      ``weights="contiguous"``: every parameter stays contiguous (FSDP's ``fully_shard``).
    - ``max_plans``: a call with another input shape signature is planned on first sight and
      cached, at most this many plans held (``optimized.memlayout.plans``).
    - ``padding``: channel counts padded to the vector width where that measures faster;
      ``blocked``: mkldnn blocked chains timed and reported, never applied.
    - ``memory``: ``plan.memory`` reports peak activation memory; ``memory_budget`` (bytes or
      ``"300MB"``): the fastest plan whose peak fits.
    - ``name``: the model's name in the plan (default: its class name).
    - ``fallback``: a plan that fails verification gives way to the model run in one format
      (the faster first), verified the same way, with a warning and a note; ``False`` raises.
    - ``predict`` (with ``measure``): time only the layout nodes whose costs could change the
      cut, predict the others (``plan.prediction``; off by default).
    - ``reuse`` (with ``measure``): a plan stored in the cost cache for this very model and
      input signature is rebuilt and verified again, nothing captured or measured
      (``memlayout.plan.reuse``; on by default); ``False``: planned again from cached costs.
    - ``same_draws``: dropout masks drawn as the original draws them under the same seed
      (``memlayout.plan.steer.draws``); off: drawn in the plan's layout, with a warning.

    Besides the options, what this call plans: ``kwargs``, the example's keyword inputs (a
    diffusers UNet's ``encoder_hidden_states``); ``inplace``, the caller's object itself.

    Raises ``PlanError`` / ``CaptureError`` for bad input, ``LayoutVerificationError`` when the
    planned model would compute something else (and, with ``fallback``, no model run in one
    format verifies either).
    """
    start = time.perf_counter()
    asked = PlanOptions.of(options, overrides, also=("kwargs", "inplace"))
    if not isinstance(model, nn.Module):
        raise PlanError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if planned_state(model) is not None:
        raise PlanError(f"{type(model).__name__} is planned already (it has a plan, "
                        "model.memlayout): plan the original model, or use it as it is")
    inputs = example_inputs_of(example_inputs)
    if asked.name is None:
        asked = dataclasses.replace(asked, name=type(model).__name__)
    root, inputs = keyword_call(model, inputs, dict(kwargs or {}))
    check_materialized(root, inputs)
    run = run_options(asked, root, inputs,
                      keywords=root is not model or isinstance(model, KeywordCall))
    if run.input_label is not None:
        inputs = inputs_in(inputs, run.input_label, run.ranks)
    reference = reference_copy(root)
    plan, built = plan_model(reference, inputs, run, start=start)
    return finish(model, built, plan, inputs, run, inplace=inplace)


def reference_copy(model: nn.Module) -> nn.Module:
    """The original, as the planner runs it (verification's reference, the template every
    candidate is copied from): a copy, so that the caller's model is never touched."""
    try:
        return copy.deepcopy(model)
    except Exception as exc:
        raise PlanError(f"cannot copy {type(model).__name__} to plan on (copy.deepcopy "
                        f"failed: {exc}); the planner never modifies the caller's model") from exc


def analysis_copy(reference: nn.Module) -> nn.Module:
    """What capture traces and measures: a copy sharing the reference's parameters (it only
    reads them) with buffers and attributes of its own (a trace may assign attributes, a
    train-mode run updates running statistics), unsteered (the user's own code)."""
    shared = {id(p): p for p in reference.parameters()}
    try:
        return unsteer(copy.deepcopy(reference, shared))
    except Exception as exc:
        raise PlanError(f"cannot copy {type(reference).__name__} to trace it (copy.deepcopy "
                        f"failed: {exc}); capture may change what it traces, so it never "
                        "traces the model itself") from exc


def plan_model(reference: nn.Module, inputs: tuple[Any, ...], options: RunOptions, *,
               start: float) -> tuple[Plan, Build]:
    """The steps, in order. ``reference`` is the original (a copy of the caller's model): it
    is run, never changed (state restored after each check), and every candidate is a copy of
    it. Returns the plan and the build kept."""
    store = open_cache(options.cache, refresh=options.refresh) if options.measure else None
    state = module_state(reference)
    example = clone_inputs(inputs)
    rng_state = _rng_state()
    clock = StepClock()
    try:
        stored = reuse.reused(reference, inputs, store, example, options, state, clock, start)
        if stored.made is not None:
            return stored.made
        with clock("capture"):
            captured = capture(analysis_copy(reference), inputs, dtype=options.dtype,
                               ranks=options.ranks, device=options.device)
            outputs = wanted_outputs(captured, inputs, options)
        options = around_reads(captured, options)
        solution, decision, disagree = decided(reference, captured, inputs, options, store,
                                               outputs, clock)
        if decision.input_label is not None and options.auto_input:
            # the inputs arrive in this format from now on: a plan considered later (a memory
            # budget's candidates) must take them so
            inputs = inputs_in(inputs, decision.input_label, options.ranks)
            solution = solution.pin_inputs(decision.input_label)
        # the records below are cached under the plan's signature: a second plan runs no forward
        signature = plan_signature(solution.graphs(), [
            decision.kept, options.root_input_label, options.output_label, options.train,
            "boundaries", *([options.weights] if options.contiguous_weights else [])])
        with clock("padding"):
            padded, padded_build = padding_step(reference, decision.build, inputs, options,
                                                store, signature, outputs)
        decision = dataclasses.replace(decision, build=padded_build)
        with clock("memory"):
            memory = memory_step(reference, captured, solution, decision, inputs, padded,
                                 options, store, signature, outputs)
        with clock("blocked"):
            blocked = blocked_step(memory.build, inputs, options, store, signature)
        ran = optional_steps(padded, memory, blocked)
        notes = reads_notes(captured)
        inplace = changed_inputs(captured, options)
        quiet = not notes  # nothing warned: the plan is stored for reuse once verified
        with clock("verify"):
            try:
                verification = verify(reference, memory.build, example, options, state,
                                      inplace)
            except LayoutVerificationError as failure:
                if not (options.fallback and failure.fallback):
                    raise
                decision, verification, note = fall_back(
                    reference, captured, solution, decision, inputs, example, options, state,
                    failure, outputs, inplace)
                memory, padded, blocked = MemoryDecision(decision.build, None), (), None
                notes.append(note)
                warnings.warn(f"memlayout: {note}", stacklevel=3)
                quiet = False
        notes += stored.notes + draws_notes(verification)
        quiet = quiet and not verification.redrawn
        with clock("verify"):
            realized = realized_step(memory.build, decision, example, solution, options, state)
        notes += later_notes(realized, solution, decision, disagree)
        restore_state(memory.build.module, state)  # as the caller's model is: nothing ran on it
        price = clock.price(time.perf_counter() - start, measured=solution.measured,
                            predicted=(solution.prediction.predicted
                                       if solution.prediction is not None else 0),
                            cached=solution.cached, ran=ran)
        plan = make_plan(captured, solution, decision, memory, inputs, options,
                         verification=verification, padding=padded, blocked=blocked,
                         price=price, notes=notes, training=reference.training,
                         realized=realized)
        if store is not None and stored.key is not None and quiet and disagree is None:
            reuse.remember(store, stored.key, plan, memory.build, inplace,
                           decision.key if decision.record is not None else None)
    finally:
        if store is not None:
            store.close()
        _set_rng_state(rng_state)
    return plan, memory.build


def optional_steps(padded: tuple[PadChoice, ...], memory: MemoryDecision,
                   blocked: BlockedReport | None) -> set[str]:
    """The optional steps that ran and found something to do (a fallback after them drops
    their records, not the time they took)."""
    return {step for step, done in (("padding", bool(padded)),
                                    ("memory", memory.record is not None),
                                    ("blocked", blocked is not None)) if done}


def realized_step(built: Build, decision: GuardDecision, example: tuple[Any, ...],
                  solution: Solution, options: RunOptions, state: Any) -> list[str]:
    """Where the kept plan's formats differ from the ones the steered model realizes (a
    one-format model kept instead: nothing to compare); the model's state restored."""
    if decision.kept != PLANNED:
        return []
    realized = realized_differences(built.module, example, solution, dtype=options.dtype,
                                    device=options.device)
    restore_state(built.module, state)
    return realized


def decided(reference: nn.Module, captured: Captured, inputs: tuple[Any, ...],
            options: RunOptions, store: CostCache | None, outputs: Any,
            clock: StepClock) -> tuple[Solution, GuardDecision, Any]:
    """Costs, the minimum cut and the guard's build; where the cost table and the whole
    model disagree (costs taken under load, or cached from a busier day), all three once
    more, the costs measured again. Returns the solution, the guard's decision and what
    still disagrees (``None``: nothing)."""
    def once(predict: bool) -> tuple[Solution, GuardDecision]:
        if predict:  # only the nodes whose costs could change the cut are measured
            solution = refined_solution(captured, options, store, clock)
        else:
            with clock("costs"):
                costs = measure_regions(captured, options, store)
            with clock("solve"):
                solution = solve_regions(captured, costs, options)
        with clock("guard"):
            decision = guarded_build(reference, captured, solution, inputs, options, store,
                                     outputs)
        return solution, decision

    solution, decision = once(options.predict and options.measure and not options.refresh)
    if suspect_costs(captured, solution, decision) is not None:
        with store.remeasuring() if store is not None else contextlib.nullcontext():
            solution, decision = once(False)  # suspect costs: every node measured again
    return solution, decision, suspect_costs(captured, solution, decision)


def later_notes(realized: list[str], solution: Solution, decision: GuardDecision,
                disagree: Any) -> list[str]:
    """The notes of a verified plan: where eager propagation differed from it (``realized``),
    and, with a warning, costs that still disagree with the whole model (``disagree``)."""
    notes = []
    if realized:
        notes.append(f"eager propagation differed from the plan at {len(realized)} module "
                     f"results (first: {realized[0]}): the plan's formats are where it "
                     "steers, the model's own code decides in between")
    if disagree is not None:
        notes.append(suspect_note(solution.predicted["planned"], decision.record, disagree))
        warnings.warn(f"memlayout: {notes[-1]}", stacklevel=4)
    return notes


def around_reads(captured: Captured, options: RunOptions) -> RunOptions:
    """``options`` for a model whose own code reads layouts (``captured.reads``): refused
    where inputs are converted on entry; else the parameters keep their own formats (a node
    that runs otherwise converts its weight per call), so that a later plan for another
    shape or mode, made on the live weights, sees the layouts the original's code reads."""
    refuse_declared_input(captured.reads, options.input_label is not None or options.auto_input)
    return dataclasses.replace(options, contiguous_weights=True) if captured.reads else options


def reads_notes(captured: Captured) -> list[str]:
    """What a plan says, with a warning, of the layout reads of the model's own code."""
    if not captured.reads:
        return []
    note = reads_note(captured.reads)
    warnings.warn(f"memlayout: {note}", stacklevel=4)
    return [note]


def draws_notes(verification: Verification) -> list[str]:
    """What a plan says of the random masks it draws otherwise than the original: drawn as
    the original (``same_draws``), or, with a warning, in the plan's layout."""
    if verification.draws:
        return [f"random masks drawn as the original draws them (same_draws): "
                f"{', '.join(verification.redrawn)} each on a copy of its activation in the "
                "original's format"]
    if verification.redrawn:
        note = redrawn_note(verification.redrawn)
        warnings.warn(f"memlayout: {note}", stacklevel=4)
        return [note]
    return []


def redrawn_note(modules: list[str]) -> str:
    """What a plan says of the dropouts whose activations it lays out otherwise than the
    original (``Verification.redrawn``)."""
    return (f"random masks drawn in another memory order than the original's: "
            f"{', '.join(modules)}. PyTorch draws a mask in memory order, so under the same "
            "seed the planned model drops other (equally random) elements than the original "
            "there; verification compared them with masks drawn in logical order "
            "(same_draws=True draws them as the original)")


def finish(model: nn.Module, built: Build, plan: Plan, inputs: tuple[Any, ...],
           options: RunOptions, *, inplace: bool) -> nn.Module:
    """The planned model as the caller gets it: the steered copy, or (``inplace``) the
    caller's own object with the same steering, checked once more as it will run; either way
    holding its plan (``model.memlayout``, ``model.plan``) and planning other input shapes on
    first sight."""
    planned = built.model
    if options.train:
        planned.zero_grad(set_to_none=True)  # the guard's and verification's steps left some
    if inplace and isinstance(model, KeywordCall):
        raise PlanError("inplace=True plans the caller's model itself: pass the model and "
                        "its keyword inputs as kwargs=, not a KeywordCall")
    if inplace:
        steer(model, built.steering, key=shape_signature(inputs), input_label=_arrival(plan),
              outputs=planned_state(planned).outputs[_key(planned)], plan=plan,
              dtype=options.dtype, ranks=options.ranks, max_plans=options.max_plans)
        _check_inplace(model, planned, inputs, options)
        planned = model
    state = planned_state(planned)
    key = shape_signature(inputs)
    if state.example != key:  # the build's own key: the example's signature from now on
        state.outputs[key] = state.outputs.pop(state.example)
        for m in planned.modules():
            forward = m.__dict__.get("forward")
            boundaries = getattr(forward, "boundaries", None)
            if boundaries is not None and state.example in boundaries:
                boundaries[key] = boundaries.pop(state.example)
        state.example = key
    state.plan = plan
    state.input_label = _arrival(plan)
    state.replanner = Replanner(options)
    if "plan" not in dir(type(planned)):
        planned.__dict__["plan"] = plan  # ``model.plan``: the example's plan
    if isinstance(model, KeywordCall):
        # the caller's own keyword-call wrapper (the CLI's, the bench's): it gets one back,
        # around the planned model, holding the same plan
        wrapper = built.module
        wrapper.__dict__.update({STATE: state, "plan": plan})
        return wrapper
    return planned


def _key(model: nn.Module) -> Any:
    return planned_state(model).example


def _arrival(plan: Plan) -> Label | None:
    return None if plan.input_format is None else Label.parse(plan.input_format)


def _check_inplace(model: nn.Module, planned: nn.Module, inputs: tuple[Any, ...],
                   options: RunOptions) -> None:
    """The caller's object, steered in place, computes what the verified copy computes."""
    from memlayout.plan.check.semantics import call_twice
    from memlayout.plan.compare import compare

    state = module_state(model)
    try:
        got = call_twice(model, inputs, dtype=options.dtype, device=options.device, calls=1)
        want = call_twice(planned, inputs, dtype=options.dtype, device=options.device, calls=1)
    finally:
        from memlayout.plan.check.semantics import restore_state

        restore_state(model, state)
    ok, err, _ = compare(want.outputs[0], got.outputs[0], options.dtype)
    if not ok:
        raise LayoutVerificationError(
            f"the model planned in place differs from the verified copy by {err:.3g}; "
            "please report this with the model", cause="in-place planning differs",
            fallback=False)


# ---------------------------------------------------------------- steps


def memory_step(reference: nn.Module, captured: Captured, solution: Solution,
                decision: GuardDecision, inputs: tuple[Any, ...], padded: tuple[PadChoice, ...],
                options: RunOptions, store: CostCache | None, signature: str,
                outputs: Formats) -> MemoryDecision:
    """The peak activation memory of the plan against the original's; with a budget, the
    fastest plan whose peak fits (``memlayout.plan.check.memory``)."""
    if not options.memory and options.memory_budget is None:
        return MemoryDecision(decision.build, None)
    arrive = decision.input_label if options.auto_input else options.input_label
    chosen, record = peak_memory_step(
        reference, inputs, options.dtype, decision.build, solution=solution,
        budget=options.memory_budget, padding=padded,
        kept=decision.kept, predicted=solution.predicted,
        build=lambda s: build(reference, steering_of(s, options), options, outputs=outputs,
                              input_label=arrive, nodes=node_choices(s),
                              conversions=conversions_of(s, options)),
        build_uniform=lambda label: build_uniform(reference, captured, solution, label,
                                                  options, outputs, arrive=arrive),
        cache=store, signature=signature, device=options.device)
    return MemoryDecision(chosen, record)


def blocked_step(built: Build, inputs: tuple[Any, ...], options: RunOptions,
                 store: CostCache | None, signature: str) -> BlockedReport | None:
    """The mkldnn report (opt-in, never applied): chains of supported ops timed blocked."""
    if not (options.blocked and options.measure):
        return None
    return measure_blocked(built.module, inputs, dtype=options.dtype, cache=store,
                           rounds=options.rounds, signature=signature, device=options.device)


# ---------------------------------------------------------------- other shapes


class Replanner:
    """Plans a new input signature of a planned model on its live weights (their formats
    kept: one set of parameters serves every shape), no guard, verified against the model's
    own computation unsteered; installs the plan's boundaries under the signature's key."""

    def __init__(self, options: RunOptions) -> None:
        # a plan per shape chooses boundaries only, on the weights as they are: no guard, no
        # padding, memory or mkldnn steps (they stay the example's), one plan
        self.options = dataclasses.replace(
            options, guard=False, keep_weight_formats=True, max_plans=1, memory=False,
            memory_budget=None, padding=False, blocked=False, refresh=False, progress=None)

    def __call__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 key: Any) -> Plan:
        start = time.perf_counter()
        state = planned_state(model)
        live = analysis_copy(model)  # the model's own computation on the live weights
        xs = example_inputs_of(tuple(x.detach() if isinstance(x, torch.Tensor) else x
                                     for x in args))
        root, xs = keyword_call(live, xs, dict(kwargs))
        # the module may have moved since the example's plan (``.to()``): this call's device
        options = dataclasses.replace(self.options, train=model.training,
                                      device=device_of(xs, live), keywords=root is not live)
        if options.input_label is not None:
            xs = inputs_in(xs, options.input_label, options.ranks)
        plan, built = plan_model(root, xs, options, start=start)
        built_state = planned_state(built.model)
        boundaries = Steering((), built.steering.boundaries)
        steer(model, boundaries, key=key, input_label=state.input_label,
              outputs=built_state.outputs[built_state.example], plan=state.plan)
        return plan


def open_cache(cache: bool | str | Path, *, refresh: bool = False) -> CostCache | None:
    """The cost cache (``True``: the user's; a path; ``False``: none)."""
    if cache is False:
        return None
    try:
        return CostCache(None if cache is True else Path(cache), refresh=refresh)
    except Exception as exc:  # an unwritable cache must not stop planning: measure instead
        warnings.warn(f"memlayout: cost cache unavailable ({exc}); measuring without it",
                      stacklevel=3)
        return None


def _rng_state() -> tuple[torch.Tensor, Any]:
    cuda = (torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    return torch.random.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, Any]) -> None:
    torch.random.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def make_plan(captured: Captured, solution: Solution, decision: GuardDecision,
              memory: MemoryDecision, inputs: tuple[Any, ...], options: RunOptions, *,
              verification: Verification, padding: tuple[PadChoice, ...],
              blocked: BlockedReport | None, price: Price, notes: list[str],
              training: bool, realized: list[str]) -> Plan:
    """The plan as plain data (``training``: the model's train/eval mode; ``price``: what
    making it cost, its total the plan's ``planning_seconds``)."""
    entry = decision.input_label
    output = options.output_label
    built = memory.build
    nodes = list(built.nodes)
    notes = [*conv1d_notes(nodes), *fault_notes(s.table for s in solution.regions), *notes]
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
        prediction=solution.prediction,
        planning_seconds=price.total, price=price, verification=verification,
        guard=decision.record,
        padding=padding, memory=memory.record, blocked=blocked, train=options.train,
        input_shapes=[list(t.shape) for t in iter_tensors(inputs)],
        weight_formats_kept=options.keep_weight_formats, coverage=captured.coverage,
        costs_timed=sum(s.table.timed_costs for s in solution.regions),
        costs_noisy=sum(s.table.noisy_costs for s in solution.regions),
        model_signature=model_signature(captured), notes=notes,
        weights=options.weights, mode="train" if training else "eval", realized=realized,
    )


__all__ = ["Plan", "optimize"]
