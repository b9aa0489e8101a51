"""``memlayout.optimize``: capture -> costs -> solve -> rewrite -> guard -> memory -> verify.

``optimize`` derives one :class:`~memlayout.plan.options.PlanOptions` from its keywords and
runs the steps below in order, each returning a frozen record the next one reads.

>>> import torch
>>> from torch import nn
>>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.GroupNorm(2, 8), nn.Conv2d(8, 8, 3))
>>> opt = optimize(net, torch.randn(1, 3, 12, 12), measure=False)
>>> opt.plan.verification.ok, opt.plan.verification.check, opt.plan.measured
(True, 'dtype tolerance', 0)
>>> torch.equal(opt(torch.ones(1, 3, 12, 12)), opt(torch.ones(1, 3, 12, 12)))
True
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import re
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from memlayout import dtypes
from memlayout.errors import (
    DtypeError,
    LayoutError,
    LayoutVerificationError,
    MemlayoutError,
    PlanError,
)
from memlayout.layout import Format, strides_for
from memlayout.plan.apply import model_signature
from memlayout.plan.candidates.blocked import measure_blocked
from memlayout.plan.candidates.padding import plan_padding
from memlayout.plan.capture.regions import Captured, capture
from memlayout.plan.check import guard as g
from memlayout.plan.check import memory as mem
from memlayout.plan.check.verify import (
    TOLERANCE,
    ModuleState,
    call_twice,
    compare,
    float64_agreement,
    inplace_on_inputs,
    module_state,
    mutates_in_place,
    restore_state,
    state_changes,
    verify,
    verify_semantics,
    verify_training,
)
from memlayout.plan.convert import convert_module_to, convert_value
from memlayout.plan.costs.drops import drop_notes, notes_of
from memlayout.plan.costs.measure import (
    CostCache,
    device_name,
    measure_costs,
    module_has_layout_params,
)
from memlayout.plan.graph import FREE, LABELS, NONE, Label, iter_nodes, planned_ranks, value_meta
from memlayout.plan.options import (
    Build,
    Costs,
    GuardDecision,
    MemoryDecision,
    PlanOptions,
    Progress,
    RegionCheck,
    RegionSolution,
    Solution,
    region_formulation,
    solve_labels,
)
from memlayout.plan.report.result import (
    DTYPE_TOLERANCE,
    FLOAT64_RECHECK,
    BlockedReport,
    Conversion,
    GuardRecord,
    NodeChoice,
    PadChoice,
    Plan,
    Verification,
    conv1d_notes,
)
from memlayout.plan.solve.formulate import AUTO, OUTPUT_PREFIX, baseline_labels
from memlayout.plan.solve.mincut import Problem, objective
from memlayout.plan.steer.module import OptimizedModule, inputs_in, keyword_call, shape_signature
from memlayout.plan.steer.rewrite import PlannedGraph, rewrite
from memlayout.plan.steer.weights import (
    CONTIGUOUS,
    CONVERTED,
    WEIGHTS,
    storage_counts,
    store_weights,
)
from memlayout.tensors import convert_batch, device_of, iter_tensors


def optimize(model: nn.Module, example_inputs: Any, *, dtype: str | torch.dtype | None = None,
             input_format: str | Format | None = None, output_format: str | Format | None = "keep",
             measure: bool = True, cache: bool | str | Path = True,
             progress: Progress | None = None, rounds: int = 5, name: str | None = None,
             guard: bool = True, guard_rounds: int = 5, train: bool = False,
             keep_weight_formats: bool = False, max_plans: int = 8,
             guard_margin: float = 0.0, memory: bool = True,
             memory_budget: int | str | None = None, padding: bool = True,
             blocked: bool = False, refresh: bool = False,
             kwargs: dict[str, Any] | None = None,
             weights: str = CONVERTED, fallback: bool = True) -> OptimizedModule:
    """Plan a format per layout-sensitive operation from costs measured here, apply it to a
    copy of ``model`` and verify it; the caller's model is left unchanged.

    - ``dtype``: plan and run under autocast (``"bf16"``, ``"fp16"``); ``None``/fp32: as is.
    - ``input_format``: the format inputs arrive in (default: as the example is), or
      ``"auto"``: the plan chooses it (for a pipeline that can deliver either, as
      ``memlayout.data``'s loader can), with the inputs' conversion costed like any other;
      ``plan.input_format`` says which, and the guard times each candidate with its inputs in
      its own format. Whenever ``plan.input_format`` is set, rank-4/5 inputs are converted to
      it on entry, which costs nothing when they already arrive in it.
    - ``output_format``: ``"keep"`` (as the original returns them), a format, or ``None``.
    - ``measure=False``: an analytical cost model instead of timing; ``cache``: ``True`` (the
      user cache, see ``memlayout.plan.costs.cache.cache_path``), ``False``, or a database path;
      ``refresh=True`` measures everything again (costs and the guard's, padding's, memory's
      records) and overwrites what the cache held, e.g. numbers taken on a busy machine.
    - ``progress(done, total, what)`` is called while measuring.
    - ``guard`` (with ``measure``): per-op costs are measured in isolation, so the min-cut
      plan is also timed as a whole model against the original run entirely NCHW and
      entirely NHWC (as eager runs it; a plan that already is one of them end to end runs as
      that eager model), interleaved for ``guard_rounds`` rounds (twice that for a close
      call); the plan is kept unless one is faster by more than ``guard_margin`` (default 0:
      the fastest in the median of per-round ratios is kept).
      ``plan.guard`` records the ratios and the choice; the measurement is cached with the
      costs (see ``memlayout.plan.check.guard``).
    - ``train``: plan a training step. Costs are forward + backward per node in each format
      (a conversion in the forward brings one of its gradient in the backward: both count),
      the guard times forward + backward, and verification compares one training step
      (outputs, every parameter's and input's gradient, BatchNorm's running statistics after
      it; same RNG state for both, element-wise dropout masks drawn in logical order, as
      PyTorch's follow memory order) with the original's.
      The returned module is in train mode (an inference plan's: in the caller's mode, a
      call in train mode planned for training on first sight); its parameters are
      ``nn.Parameter``s any optimizer takes (build it from ``optimized.parameters()``),
      and their gradients come back in their strides (what DDP's gradient buckets expect).
    - ``keep_weight_formats``: every node that owns a rank-4/5 parameter runs in the format
      the parameter already has (no new parameter tensors).
    - ``weights``: ``"converted"`` (a channels-last node's weights converted once, here) or
      ``"contiguous"``: every parameter stays contiguous (what FSDP's ``fully_shard``
      takes), and each channels-last convolution reads its weight as it is or converts it per
      call, whichever measures faster (``memlayout.plan.steer.weights``).
    - ``max_plans``: changing shapes. A call with another input shape signature (shapes,
      dtypes, devices of the tensor arguments: another batch size or image size) is planned
      on first sight, on the live weights, with their formats kept (one set of parameters
      serves every shape), no guard, verified; the plan is cached, at most ``max_plans``
      plans held (the example's always), least recently used dropped first. The cost cache
      makes a replan of a known shape measure nothing; it still traces the model, solves,
      and runs the verification (about 5 forward passes; 2 forward + backward in training).
      ``optimized.plans`` holds the plans by signature.
    - ``padding`` (with ``measure``): convolutions whose channel counts are not a multiple of
      the vector width run padded where that measures faster (``memlayout.plan.candidates.padding``).
    - ``blocked`` (with ``measure``, default off): where this build has mkldnn tensors, chains
      of supported ops are timed in that blocked format too and reported, never applied
      (``memlayout.plan.candidates.blocked``).
    - ``memory``: ``plan.memory`` reports the peak activation memory of the planned model vs
      the original (``memlayout.plan.check.memory``); ``memory_budget`` (bytes, or ``"300MB"``):
      the fastest plan whose peak fits, or ``PlanError`` saying the smallest peak found.

    - ``kwargs``: keyword inputs of the example (a diffusers UNet's ``encoder_hidden_states``);
      the optimized model is then called with the same keywords.
    - ``fallback``: a plan whose verification fails (a rewrite that is wrong, or a kernel of
      this build that computes something else in one format, e.g. a backward that is wrong
      for a channels-last gradient) gives way to the model run entirely in one format, eager
      NHWC or NCHW, the faster first as the guard measured them, verified the same way; the
      plan then says so in a note (naming the divergent node) and a warning is issued.
      ``False``: raise ``LayoutVerificationError`` instead.

    Raises ``PlanError`` / ``CaptureError`` for bad input, ``LayoutVerificationError`` when the
    planned model would compute something else (and, with ``fallback``, no model run in one
    format verifies either: the original's own forward does not repeat, say).
    """
    start = time.perf_counter()
    if not isinstance(model, nn.Module):
        raise PlanError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    inputs = example_inputs_of(example_inputs)
    name = name or type(model).__name__
    model, inputs = keyword_call(model, inputs, dict(kwargs or {}))
    check_materialized(model, inputs)
    options = plan_options(
        model, inputs, dtype=dtype, input_format=input_format, output_format=output_format,
        measure=measure, cache=cache, progress=progress, rounds=rounds, name=name, guard=guard,
        guard_rounds=guard_rounds, train=train, keep_weight_formats=keep_weight_formats,
        max_plans=max_plans, guard_margin=guard_margin, memory=memory,
        memory_budget=memory_budget, padding=padding, blocked=blocked, refresh=refresh,
        weights=weights, fallback=fallback)
    if options.input_label is not None:
        inputs = inputs_in(inputs, options.input_label, options.ranks)
    work = working_copy(model, options.train)
    plan, planned = plan_model(work, inputs, options, start=start)
    # an inference plan comes back in the caller's mode (a train-mode call is planned for
    # training on first sight); a training plan in train mode, as asked
    return wrap(work, planned, plan, inputs, options, mode=options.train or model.training)


def plan_options(model: nn.Module, inputs: tuple[Any, ...], *, dtype: str | torch.dtype | None,
                 input_format: str | Format | None, output_format: str | Format | None,
                 name: str | None, memory_budget: int | str | None, max_plans: int,
                 weights: str = CONVERTED, **rest: Any) -> PlanOptions:
    """The options record of one planning run: keywords checked and parsed once, the device
    read from the example, the layout ranks from the model."""
    try:
        run_dtype = dtypes.parse_dtype(dtype)
    except DtypeError as exc:
        raise PlanError(f"optimize: {exc}") from None
    if not isinstance(max_plans, int) or max_plans < 1:
        raise PlanError(f"max_plans must be an int >= 1 (the example's plan is always held), "
                        f"got {max_plans!r}; 1 plans every other shape at each call")
    if weights not in WEIGHTS:
        raise PlanError(f"weights must be one of {', '.join(map(repr, WEIGHTS))}, got "
                        f"{weights!r}; 'contiguous' keeps every parameter contiguous (FSDP)")
    auto_input = isinstance(input_format, str) and input_format.strip().lower() == AUTO
    output_label = "keep" if output_format == "keep" else format_label(output_format, "output_format")
    return PlanOptions(
        name=name or type(model).__name__, device=device_of(inputs, model), dtype=run_dtype,
        ranks=planned_ranks(model),
        input_label=None if auto_input else format_label(input_format, "input_format"),
        auto_input=auto_input, output_label=output_label, max_plans=max_plans,
        memory_budget=mem.budget_bytes(memory_budget),
        contiguous_weights=weights == CONTIGUOUS, **rest)


def plan_model(work: nn.Module, inputs: tuple[Any, ...], options: PlanOptions, *,
               start: float) -> tuple[Plan, nn.Module]:
    """The steps, in order, on ``work`` (the caller's model is never touched). Planning runs
    the model many times (a training-mode BatchNorm updates its statistics, a forward counts
    its calls, Dropout draws, a forward changes its input in place): verification starts
    from the state ``work`` had and copies of the example as given, and the planned model is
    returned in that state, with the caller's RNG state as it was."""
    store = open_cache(options.cache, refresh=options.refresh) if options.measure else None
    state = module_state(work)
    example = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)
    rng_state = _rng_state()
    try:
        captured = capture(work, inputs, dtype=options.dtype, ranks=options.ranks,
                           device=options.device)
        costs = measure_regions(captured, options, store)
        solution = solve_regions(captured, costs, options)
        decision = guarded_build(work, captured, solution, inputs, options, store)
        disagree = suspect_costs(captured, solution, decision)
        if disagree is not None:
            # the cost table and the whole model disagree (costs taken under load, or cached
            # from a busier day): measure the costs, and the guard, once more
            with store.remeasuring() if store is not None else contextlib.nullcontext():
                costs = measure_regions(captured, options, store)
                solution = solve_regions(captured, costs, options)
                decision = guarded_build(work, captured, solution, inputs, options, store)
            disagree = suspect_costs(captured, solution, decision)
        if decision.input_label is not None and options.auto_input:
            # the inputs arrive in this format from now on: a plan considered later (a memory
            # budget's candidates) must take them so
            inputs = inputs_in(inputs, decision.input_label, options.ranks)
            solution = solution.pin_inputs(decision.input_label)
        # the records below are cached under the plan's signature: a second plan runs no forward
        signature = mem.plan_signature(solution.graphs(), [
            decision.kept, options.root_input_label,
            options.output_label, options.train,
            *([options.weights] if options.contiguous_weights else [])])
        padded = padding_step(decision.build, inputs, options, store, signature)
        memory = memory_step(work, captured, solution, decision, inputs, padded, options,
                             store, signature)
        blocked = blocked_step(memory.build, inputs, options, store, signature)
        try:
            verification = verify_step(work, captured, memory.build, example, options, state)
        except LayoutVerificationError as failure:
            if not (options.fallback and failure.fallback):
                raise
            decision, verification, fell_back = verified_fallback(
                work, captured, solution, decision, inputs, example, options, state, failure)
            memory, padded, blocked = MemoryDecision(decision.build, None), (), None
        else:
            fell_back = None
        plan = make_plan(captured, solution, decision, memory, inputs, options,
                         verification=verification, padding=padded, blocked=blocked,
                         seconds=time.perf_counter() - start)
        if fell_back is not None:
            plan.notes.append(fell_back)
            warnings.warn(f"memlayout: {fell_back}", stacklevel=3)
        if disagree is not None:
            note = g.suspect_note(solution.predicted["planned"], decision.record, disagree)
            plan.notes.append(note)
            warnings.warn(f"memlayout: {note}", stacklevel=3)
    finally:
        if store is not None:
            store.close()
        _set_rng_state(rng_state)
    return plan, memory.build.module


def wrap(work: nn.Module, planned: nn.Module, plan: Plan, inputs: tuple[Any, ...],
         options: PlanOptions, *, mode: bool) -> OptimizedModule:
    """The planned model as the caller gets it, in train mode ``mode``, planning other input
    shapes (and the other mode) on first sight."""
    if options.train:
        planned.zero_grad(set_to_none=True)
    optimized = OptimizedModule(planned, plan, options.dtype, replan=Replanner(work, planned, options),
                                max_plans=options.max_plans, signature=shape_signature(inputs),
                                ranks=options.ranks)
    return optimized.train(mode)


# ---------------------------------------------------------------- steps


def measure_regions(captured: Captured, options: PlanOptions,
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


def solve_regions(captured: Captured, costs: Costs, options: PlanOptions) -> Solution:
    """The min-cut labels of every region, and the predicted seconds of the plan and of the
    model run entirely in one format."""
    predicted = {"planned": 0.0, "all_contiguous": 0.0, "all_channels_last": 0.0}
    solved = []
    for region, table in zip(captured.regions, costs.tables, strict=True):
        top = region.path == ""
        form = region_formulation(region, table, options)
        if options.keep_weight_formats and not options.contiguous_weights:
            # (contiguous weights say nothing of the format their node runs in)
            form = _pin_weight_formats(region.gm, form, options.ranks)
        if top:
            form = _pin_inplace_on_inputs(region.gm, form)
        labels = solve_labels(form.integer)
        relaxed = Problem(form.seconds.unary, form.seconds.tensors)
        predicted["planned"] += objective(relaxed, labels) or 0.0
        for label, key in ((0, "all_contiguous"), (1, "all_channels_last")):
            predicted[key] += objective(relaxed, baseline_labels(form.seconds, label)) or 0.0
        solved.append(RegionSolution(region, table, form, labels))
    return Solution(tuple(solved), predicted, costs.measured, costs.cached)


def guarded_build(work: nn.Module, captured: Captured, solution: Solution,
                  inputs: tuple[Any, ...], options: PlanOptions,
                  store: CostCache | None) -> GuardDecision:
    """Build the min-cut plan; with the guard on (and measuring), time it as a whole model
    against the original run entirely in one format (eager NCHW, eager NHWC: weights and
    inputs converted, outputs as the plan keeps them), skipping a format the plan already is
    end to end (or read that measurement from the cache), and keep the fastest
    (``memlayout.plan.check.guard``). With ``input_format="auto"`` each candidate is timed with its
    inputs already in its format, and the inputs then arrive in the kept one's."""
    entry = solution.chosen_input() if options.auto_input else options.input_label
    if not (options.guard and options.measure and solution.has_variables):
        return GuardDecision(build(work, solution, options), None, entry)
    own_inputs = options.auto_input and entry is not None
    if own_inputs:
        inputs = inputs_in(inputs, entry, options.ranks)
    outputs = _output_label(captured.output, options.output_label, options.ranks)

    def uniform(label: int) -> Build:
        return build_uniform(work, solution, inputs, label, outputs, options,
                             arrive=label if own_inputs else None)

    planned = build(work, solution, options)
    skipped = [name for name, label in g.UNIFORM.items() if _is_uniform(solution, planned, label)]
    names = [name for name in g.UNIFORM if name not in skipped]
    if outputs == "mixed":
        names, skipped = [], []  # outputs in both formats: a one-format model cannot keep them
    if skipped:
        # The plan runs the model in one format end to end: run it exactly as that eager model
        # (no graph module in between), so it is what it is compared with, not a copy of it.
        eager = uniform(g.UNIFORM[skipped[0]])
        planned = Build(eager.module, (), planned.nodes, planned.conversions)
    if not names:
        return GuardDecision(planned, GuardRecord(g.PLANNED, options.guard_margin, "none", 0,
                                                  skipped=tuple(skipped)), entry)

    def candidate(name: str) -> Build:
        return planned if name == g.PLANNED else uniform(g.UNIFORM[name])

    def decided(kept: str, record: GuardRecord) -> GuardDecision:
        label = g.UNIFORM.get(kept)  # an eager model won: its inputs arrive in its format
        return GuardDecision(candidate(kept), record,
                             label if own_inputs and label is not None else entry)

    margin = options.guard_margin
    key = g.cache_key(device_name(options.device), options.dtype, g.signature(
        solution.graphs(), [options.signature_extra, names, skipped]))
    record = store.get(key, g.valid_record) if store is not None else None
    if record is not None and not g.measured_busy(record):  # a busy machine's: measure again
        kept = g.decide(record, margin=margin)
        return decided(kept, g.describe(record, kept=kept, margin=margin, source="cache",
                                        skipped=skipped))
    builds = {name: candidate(name) for name in [g.PLANNED, *names]}
    rounds = options.guard_rounds
    steps = [0]

    def on_step(_round: int, name: str) -> None:
        steps[0] += 1
        if options.progress is not None:
            # a close call runs as many rounds again (memlayout.plan.check.guard.is_close)
            total = rounds * len(builds) * (1 + (steps[0] > rounds * len(builds)))
            options.progress(steps[0], total, f"whole model, {name}")

    start = time.perf_counter()
    inputs_of = ({name: inputs_in(inputs, g.UNIFORM[name], options.ranks) for name in names}
                 if own_inputs else None)
    record = g.time_candidates({name: b.module for name, b in builds.items()}, inputs,
                               options.dtype, device=options.device, rounds=rounds,
                               on_step=on_step,
                               train=options.train, margin=margin, inputs_of=inputs_of)
    if store is not None and not record["errors"]:
        g.save(store, key, record)
    kept = g.decide(record, margin=margin)
    return decided(kept, g.describe(record, kept=kept, margin=margin, source="measured",
                                    skipped=skipped, seconds=time.perf_counter() - start))


def suspect_costs(captured: Captured, solution: Solution, decision: GuardDecision) -> float | None:
    """How far the predicted plan time exceeds the guard's measured one, when beyond
    ``guard.SUSPECT`` (``None`` too when the guard did not time the plan, or parts of the model
    run eager outside the plan's prediction)."""
    if decision.record is None or any(r.path for r in captured.regions) or captured.uncaptured:
        return None
    return g.suspect(solution.predicted.get("planned"), decision.record.planned_seconds)


def padding_step(built: Build, inputs: tuple[Any, ...], options: PlanOptions,
                 store: CostCache | None, signature: str) -> tuple[PadChoice, ...]:
    """Convolutions padded to the vector width where that measures faster (inference only:
    a padded convolution's weights are copies made here, they would not train)."""
    if not (options.padding and options.measure) or options.train:
        return ()
    return tuple(plan_padding(built.module, inputs, dtype=options.dtype, cache=store,
                                rounds=options.rounds, progress=options.progress,
                                signature=signature, device=options.device))


def memory_step(work: nn.Module, captured: Captured, solution: Solution,
                decision: GuardDecision, inputs: tuple[Any, ...], padded: tuple[PadChoice, ...],
                options: PlanOptions, store: CostCache | None, signature: str) -> MemoryDecision:
    """The peak activation memory of the plan against the original's; with a budget, the
    fastest plan whose peak fits (``memlayout.plan.check.memory``)."""
    if not options.memory and options.memory_budget is None:
        return MemoryDecision(decision.build, None)
    outputs = _output_label(captured.output, options.output_label, options.ranks)
    arrive = decision.input_label if options.auto_input else None
    chosen, record = mem.memory_step(
        work, inputs, options.dtype, decision.build, solution=solution,
        budget=options.memory_budget, padding=padded,
        kept=decision.kept, predicted=solution.predicted,
        build=lambda s: build(work, s, options),
        build_uniform=lambda label: build_uniform(work, solution, inputs, label, outputs,
                                                  options, arrive=arrive),
        cache=store, signature=signature, device=options.device)
    return MemoryDecision(chosen, record)


def blocked_step(built: Build, inputs: tuple[Any, ...], options: PlanOptions,
                 store: CostCache | None, signature: str) -> BlockedReport | None:
    """The mkldnn report (opt-in, never applied): chains of supported ops timed blocked."""
    if not (options.blocked and options.measure):
        return None
    return measure_blocked(built.module, inputs, dtype=options.dtype, cache=store,
                           rounds=options.rounds, signature=signature, device=options.device)


def verify_step(work: nn.Module, captured: Captured, built: Build, inputs: tuple[Any, ...],
                options: PlanOptions, state: ModuleState) -> Verification:
    """The planned model against the original, both from ``state`` (the caller's) on
    ``inputs`` (the example as given): one call (one training step when training) compared
    value by value, then two calls each (the second call's output, the inputs and buffers
    after them) and the parameters (names, ties, ``requires_grad``). Raises
    ``LayoutVerificationError`` naming the first divergent node or what else differs; leaves
    both models in ``state``."""
    start = time.perf_counter()
    planned = built.module
    inplace = [f for r in captured.regions if r.path == "" for f in inplace_on_inputs(r.gm)]
    if inplace and (options.input_label is not None or options.auto_input):
        raise _no_fallback(LayoutVerificationError(
            f"the forward changes its input in place ({', '.join(inplace)}), and with "
            "input_format the planned model converts inputs that arrive in another format on "
            "entry: the change would land on that copy, not on the caller's tensor. Plan "
            "without input_format (inputs taken as they come), or make the op out of place "
            "(x = x * 2 instead of x.mul_(2)); the plan was not applied"))
    restore_state(work, state)
    want = call_twice(work, inputs, dtype=options.dtype, device=options.device)
    changes = state_changes(state, work)
    try:
        restore_state(work, state)
        restore_state(planned, state)
        verification = (_verify_training(work, built, inputs, options) if options.train
                        else _verify(work, built, inputs, options, expected=want.outputs[0]))
        count = verify_semantics(work, planned, inputs, state, want, dtype=options.dtype,
                                 device=options.device, inplace=tuple(inplace))
    except LayoutVerificationError as exc:
        if exc.inputs_changed and (options.input_label is not None or options.auto_input):
            # inputs that arrive in another format are converted on entry whichever format
            # the model runs in: no model run in one format keeps the change either
            raise _no_fallback(exc) from None
        if changes:  # a likelier cause than a wrong conversion
            raise LayoutVerificationError(
                f"{_cause_known(exc)}. The original's forward changes "
                f"{', '.join(changes[:3])} on every call, which the captured graph does not "
                "repeat (torch.fx runs such an update once, while tracing, and keeps a Python "
                "attribute as a constant): keep per-call state out of the planned forward"
                ) from exc
        if inplace:
            raise LayoutVerificationError(
                f"{_cause_known(exc)}. The forward changes its input in place "
                f"({', '.join(inplace)}), and a conversion in the plan separates that input from its copy: make the op out "
                "of place (x = x * 2 instead of x.mul_(2))") from exc
        raise
    finally:
        restore_state(work, state)
        restore_state(planned, state)
    verification = dataclasses.replace(verification, semantics=count)
    return dataclasses.replace(verification, seconds=time.perf_counter() - start)


def verified_fallback(work: nn.Module, captured: Captured, solution: Solution,
                      decision: GuardDecision, inputs: tuple[Any, ...], example: tuple[Any, ...],
                      options: PlanOptions, state: ModuleState,
                      failure: LayoutVerificationError) -> tuple[GuardDecision, Verification, str]:
    """The plan failed verification: the model run entirely in one format, the faster first
    (as the guard measured them; unmeasured: NHWC, then NCHW), the first that verifies, with
    the note that says so. Raises ``failure`` when none does."""
    timed = decision.record.candidates if decision.record is not None else {}
    names = sorted((n for n in g.UNIFORM if n != decision.kept),
                   key=lambda n: (-timed[n].median if n in timed else 0.0,
                                  -g.UNIFORM[n]))  # faster first; unmeasured: NHWC first
    outputs = _output_label(captured.output, options.output_label, options.ranks)
    own_inputs = options.auto_input and decision.input_label is not None
    why = _first_sentence(failure)
    tried = []
    for name in names:
        label = g.UNIFORM[name]
        built = build_uniform(work, solution, inputs_in(inputs, label, options.ranks)
                              if own_inputs else inputs, label, outputs, options,
                              arrive=label if own_inputs else None)
        try:
            verification = verify_step(work, captured, built, example, options, state)
        except LayoutVerificationError as exc:
            tried.append(f"{name}: {_first_sentence(exc)}")
            continue
        record = (dataclasses.replace(decision.record, kept=name) if decision.record is not None
                  else GuardRecord(name, options.guard_margin, "none", 0))
        kept = GuardDecision(built, record, label if own_inputs else decision.input_label)
        note = (f"the {decision.kept} model failed verification ({why}); kept {name}, the "
                f"model run entirely {'channels-last' if label else 'contiguous'}, verified"
                + (f" (also failed: {'; '.join(tried)})" if tried else ""))
        return kept, verification, note
    raise failure


def _no_fallback(exc: LayoutVerificationError) -> LayoutVerificationError:
    exc.fallback = False  # no format changes this: the model run in one format would fail too
    return exc


def _first_sentence(exc: BaseException) -> str:
    """What went wrong, without what the error goes on to advise."""
    return re.split(r"[.;] [Tt]he plan was not applied", str(exc))[0].strip()


def _cause_known(exc: LayoutVerificationError) -> str:
    """``exc``'s message without its request to report a planner bug: the cause is named
    after it (state the forward changes, an input it changes in place)."""
    return str(exc).split("; please report")[0].rstrip(".")


def make_plan(captured: Captured, solution: Solution, decision: GuardDecision,
              memory: MemoryDecision, inputs: tuple[Any, ...], options: PlanOptions, *,
              verification: Verification, padding: tuple[PadChoice, ...],
              blocked: BlockedReport | None, seconds: float) -> Plan:
    """The plan as plain data."""
    entry = decision.input_label
    output = options.output_label
    built = memory.build
    plan = Plan(
        model=options.name, device=device_name(options.device), torch_version=torch.__version__,
        dtype=None if options.dtype is None else str(options.dtype).removeprefix("torch."),
        input_format=None if entry is None else Label(entry).text,
        output_format=output if output in (None, "keep") else Label(output).text,  # type: ignore[index]
        nodes=list(built.nodes), conversions=list(built.conversions),
        predicted=solution.predicted, regions=[r.path for r in captured.regions],
        uncaptured=[[p, r] for p, r in captured.uncaptured],
        measured=solution.measured, cached=solution.cached, measure=options.measure,
        planning_seconds=seconds, verification=verification, guard=decision.record,
        padding=padding, memory=memory.record, blocked=blocked, train=options.train,
        input_shapes=[list(t.shape) for t in iter_tensors(inputs)],
        weight_formats_kept=options.keep_weight_formats, coverage=captured.coverage,
        costs_timed=sum(s.table.timed_costs for s in solution.regions),
        costs_noisy=sum(s.table.noisy_costs for s in solution.regions),
        model_signature=model_signature(captured),
    )
    plan.notes.extend(conv1d_notes(plan.nodes))  # rank 3: planned, or why not
    if options.contiguous_weights and decision.kept != "planned":
        plan.notes.append(f"weights='contiguous': every parameter contiguous; the guard kept "
                          f"{decision.kept}, whose nodes read their weights as they are")
    elif options.contiguous_weights:
        counts = {"as_is": 0, "per_call": 0}
        for s in solution.regions:
            for kind, k in storage_counts(s.labels, _storage(s)).items():
                counts[kind] += k
        plan.notes.append(
            f"weights='contiguous': every parameter contiguous; {counts['as_is']} channels-last "
            f"nodes read their weights as they are, {counts['per_call']} convert them per call "
            "(whichever measured faster)")
    if options.auto_input:
        plan.notes.append(
            f"input_format='auto': inputs should arrive {Label(entry).text} (converted "
            "on entry otherwise)" if entry is not None else
            "input_format='auto': no input in a definite format at the top level; inputs "
            "are taken as they come")
    return plan


# ---------------------------------------------------------------- building


def build(work: nn.Module, solution: Solution, options: PlanOptions) -> Build:
    """Rewrite a copy of ``work`` with one labelling per region."""
    # The copy shares every parameter and buffer with ``work`` (the rewrite puts converted
    # weights in new tensors), so planning holds the weights once, not twice.
    shared = {id(t): t for t in [*work.parameters(), *work.buffers()]}
    planned_tree = copy.deepcopy(work, shared)
    nodes: list[NodeChoice] = []
    conversions: list[Conversion] = []
    checks = []
    converted: dict[int, torch.Tensor] = {}  # a tensor shared by several modules: one conversion
    for s in solution.regions:
        region = s.region
        sub = planned_tree.get_submodule(region.path) if region.path else planned_tree
        gm = _graph_module_on(sub, region.gm)
        planned, made = rewrite(sub, gm, s.form, s.labels, converted)
        if options.contiguous_weights:
            store_weights(planned, gm, s.labels, _storage(s), options.ranks)
        if region.path:
            parent_path, _, child = region.path.rpartition(".")
            parent = planned_tree.get_submodule(parent_path) if parent_path else planned_tree
            setattr(parent, child, planned)
        else:
            planned_tree = planned
        drops = notes_of(region.gm)
        for n, c in s.table.nodes.items():
            nodes.append(NodeChoice(region.path, n, c.op, Label(s.labels[n]).text,
                                    {lb.text: t for lb, t in zip(LABELS, c.seconds, strict=True)}, c.timed,
                                    drops.get(n, [])))
        for value, to, served in made:
            cost = s.table.conversions[value]
            conversions.append(Conversion(
                region.path, value, Label(to).text, [list(x) for x in cost.shapes],
                cost.nbytes, cost.to_1 if to == 1 else cost.to_0, list(served)))
        checks.append(RegionCheck(region, planned))
    return Build(planned_tree, tuple(checks), tuple(nodes), tuple(conversions))


def build_uniform(work: nn.Module, solution: Solution, inputs: tuple[Any, ...], label: int,
                  output_label: int | str | None, options: PlanOptions, *,
                  arrive: int | None = None) -> Build:
    """The original model run entirely in ``label``, as eager NCHW / NHWC: a copy with its
    weights converted, inputs converted on entry (outputs to ``output_label``) by hooks,
    so ``state_dict`` keys stay the original's. ``arrive``: the label inputs arrive in
    (``None``: as captured), for the conversions listed."""
    model = convert_module_to(copy.deepcopy(work), label, options.ranks,
                              weights=options.weights)
    model.register_forward_pre_hook(functools.partial(_inputs_to, label=label,
                                                      ranks=options.ranks))
    if output_label in (0, 1):
        model.register_forward_hook(functools.partial(_outputs_to, label=output_label))
    fmt = Label(label).text
    nodes = tuple(NodeChoice(s.region.path, n, c.op, fmt,
                             {lb.text: t for lb, t in zip(LABELS, c.seconds, strict=True)}, c.timed,
                             notes_of(s.region.gm).get(n, []))
                  for s in solution.regions for n, c in s.table.nodes.items())
    conversions = []
    first = solution.regions[0]
    if first.region.path == "":
        for n in first.region.gm.graph.nodes:
            meta = n.meta.get("memlayout")
            if n.op != "placeholder" or meta is None or meta.label not in (0, 1):
                continue
            if (meta.label if arrive is None else arrive) == 1 - label:
                cost = first.table.conversions.get(n.name)
                conversions.append(Conversion(
                    "", n.name, fmt, [list(t.shape) for t in meta.layout_tensors], meta.nbytes,
                    0.0 if cost is None else cost.to_1 if label else cost.to_0, ["forward"]))
    return Build(model, (), nodes, tuple(conversions))


def _storage(s: RegionSolution) -> dict[str, str | None]:
    """How each node of a region reads its contiguous weights (``weights="contiguous"``)."""
    return {n: c.weights for n, c in s.table.nodes.items()}


def _is_uniform(solution: Solution, planned: Build, label: int) -> bool:
    """The plan runs the whole model in ``label`` as eager would: one region (the model),
    every layout node in ``label`` (or pinned), conversions only of inputs or for outputs."""
    if len(solution.regions) != 1 or solution.regions[0].region.path != "":
        return False
    s = solution.regions[0]
    if s.labels != baseline_labels(s.form.seconds, label):
        return False
    inputs = {n.name for n in s.region.gm.graph.nodes if n.op == "placeholder"}
    return all(c.value in inputs or all(u.startswith(OUTPUT_PREFIX) for u in c.consumers)
               for c in planned.conversions)


def _output_label(reference: Any, output_label: int | str | None,
                  ranks: tuple[int, ...]) -> int | str | None:
    """The label the outputs of a one-format model are converted to: ``None`` (as they come),
    0 / 1, or ``"mixed"`` (kept outputs in both formats: not possible)."""
    if output_label != "keep":
        return output_label
    label = value_meta(reference, ranks).label
    if label in (0, 1):
        return label
    return None if label in (None, FREE) else "mixed" if label == NONE else None


def _inputs_to(module: nn.Module, args: tuple[Any, ...], *, label: int,
               ranks: tuple[int, ...]) -> tuple[Any, ...]:
    return convert_value(tuple(args), label, ranks)


def _outputs_to(module: nn.Module, args: tuple[Any, ...], output: Any, *, label: int) -> Any:
    out = convert_batch(output, Label(label).format(4))
    return convert_batch(out, Label(label).format(5))


def _graph_module_on(root: nn.Module, traced: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``traced``'s graph (names and meta kept) as a GraphModule over ``root``."""
    graph = copy.deepcopy(traced.graph)
    for n in iter_nodes(traced, "get_attr"):
        head = n.target.split(".")[0]
        if not hasattr(root, head):
            setattr(root, head, copy.deepcopy(getattr(traced, head)))
    return fx.GraphModule(root, graph)


def _pin_inplace_on_inputs(gm: fx.GraphModule, form: Any) -> Any:
    """``form`` with every node that changes a graph input in place pinned to the format that
    input arrives in: run in the other, it would change a converted copy and the caller's
    tensor would not see the change."""
    pins: dict[str, int] = {}
    for n in gm.graph.nodes:
        first = n.args[0] if n.args else None
        if (isinstance(first, fx.Node) and first.op == "placeholder"
                and n.name in form.seconds.unary and n.name not in form.integer.pins
                and mutates_in_place(gm, n)):
            arrives = form.producers.get(first.name)
            if arrives in (0, 1):
                pins[n.name] = int(arrives)
    if not pins:
        return form
    return dataclasses.replace(
        form, integer=dataclasses.replace(form.integer, pins={**form.integer.pins, **pins}),
        seconds=dataclasses.replace(form.seconds, pins={**form.seconds.pins, **pins}))


def _pin_weight_formats(gm: fx.GraphModule, form: Any, ranks: tuple[int, ...]) -> Any:
    """``form`` with every node that owns (or reads) layout-rank parameters pinned to the
    format those parameters have (canonical strides), where exactly one format fits."""
    pins: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.name not in form.seconds.unary or n.name in form.integer.pins:
            continue
        tensors: list[torch.Tensor] = []
        if n.op == "call_module" and module_has_layout_params(gm, n):
            sub = gm.get_submodule(n.target)
            tensors += [t for t in [*sub.parameters(), *sub.buffers()] if t.dim() in ranks]
        for m in n.all_input_nodes:
            if m.op == "get_attr":
                value: Any = gm
                for part in str(m.target).split("."):
                    value = getattr(value, part, None)
                if isinstance(value, torch.Tensor) and value.dim() in ranks:
                    tensors.append(value)
        fits = [label for label in (0, 1) if tensors and all(
            tuple(t.stride()) == strides_for(tuple(t.shape), Label(label).format(t.dim()))
            for t in tensors)]
        if len(fits) == 1:
            pins[n.name] = fits[0]
    if not pins:
        return form
    return dataclasses.replace(
        form, integer=dataclasses.replace(form.integer, pins={**form.integer.pins, **pins}),
        seconds=dataclasses.replace(form.seconds, pins={**form.seconds.pins, **pins}))


# ---------------------------------------------------------------- verifying


def _verify(work: nn.Module, built: Build, inputs: tuple[Any, ...], options: PlanOptions, *,
            expected: Any) -> Verification:
    """Run the planned model once and compare with ``expected`` (the original's output on
    the same inputs, from the same state). A whole-model plan is one region: compared (and on
    a mismatch bisected)
    directly. Planned submodules: the whole model is compared; on a mismatch each region is
    checked on its own inputs to name the first divergent node."""
    dtype, checks = options.dtype, built.checks
    if len(checks) == 1 and checks[0].region.path == "":
        region, planned = checks[0].region, checks[0].planned
        v = verify(region.gm, planned, inputs, dtype=dtype, planned_graph=planned.graph,
                   expected=expected, device=options.device)
        return Verification(True, DTYPE_TOLERANCE if v.float64_error is None else FLOAT64_RECHECK,
                            v.max_error, v.tolerance, v.tensors, float64_error=v.float64_error)
    with torch.no_grad(), dtypes.autocast(options.device, dtype):
        got = built.module(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
    ok, err, count = compare(expected, got, dtype)
    rtol = TOLERANCE.get(dtype or torch.float32, TOLERANCE[torch.float32])[0]
    exact = None if ok else float64_agreement(work, built.module, inputs, device=options.device)
    if exact is not None:  # rounding of the run dtype, equal in float64
        return Verification(True, FLOAT64_RECHECK, err, rtol, count, float64_error=exact)
    if not ok:
        for check in checks:  # raises naming the node where a region diverges
            assert isinstance(check.planned, PlannedGraph)
            verify(check.region.gm, check.planned, check.region.inputs, dtype=dtype,
                   planned_graph=check.planned.graph, where=check.region.path,
                   expected=check.region.output, device=options.device)
        where = ("although every planned region matched" if checks else
                 "(the model run entirely in one format, as the guard chose)")
        raise LayoutVerificationError(
            f"the planned model's outputs differ from the original's by {err:.3g} (relative) "
            f"{where}; the plan was not applied")
    return Verification(True, DTYPE_TOLERANCE, err, rtol, count)


def _verify_training(work: nn.Module, built: Build, inputs: tuple[Any, ...],
                     options: PlanOptions) -> Verification:
    """One training step of the planned model against the original's (``work``): a
    whole-model plan is compared (and on a mismatch bisected) directly; planned submodules:
    the whole model, then on a mismatch each region on its own inputs to name the node."""
    dtype, checks = options.dtype, built.checks
    if len(checks) == 1 and checks[0].region.path == "":
        region, planned = checks[0].region, checks[0].planned
        v = verify_training(work, planned, inputs, dtype=dtype, reference_graph=region.gm,
                            planned_graph=planned.graph, device=options.device)
    else:
        try:
            v = verify_training(work, built.module, inputs, dtype=dtype, device=options.device)
        except LayoutVerificationError:
            for check in checks:  # raises naming the node where a region diverges
                verify_training(check.region.gm, check.planned, check.region.inputs,
                                dtype=dtype, reference_graph=check.region.gm,
                                planned_graph=check.planned.graph, where=check.region.path,
                                device=options.device)
            raise
    # verify_training runs the float64 re-check only when the dtype-tolerance compare failed
    check = DTYPE_TOLERANCE if v.float64_error is None else FLOAT64_RECHECK
    return Verification(True, check, v.max_error, v.tolerance, v.tensors, train=True,
                        float64_error=v.float64_error)


# ---------------------------------------------------------------- inputs, state, replanning


def check_materialized(model: nn.Module, inputs: tuple[Any, ...]) -> None:
    """``PlanError`` before any work for a model or input on the meta device: it has shapes
    but no values, so nothing can be measured or verified."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    meta = [name for name, t in tensors if t.is_meta]
    if meta:
        raise PlanError(
            f"{type(model).__name__} has {len(meta)} of {len(tensors)} parameters and buffers on "
            f"the meta device ({', '.join(meta[:3])}{', ...' if len(meta) > 3 else ''}): they "
            "have shapes but no values, so nothing can be measured or verified. Materialize "
            "the weights first, e.g. model.to_empty(device='cpu') then initialize them "
            "(reset_parameters() per module, or load_state_dict from a checkpoint)")
    if any(t.is_meta for t in iter_tensors(inputs)):
        raise PlanError("example_inputs are on the meta device (shapes without values): pass "
                        "real tensors, e.g. torch.randn(shape), on the model's device")


def example_inputs_of(example_inputs: Any) -> tuple[Any, ...]:
    """``forward``'s positional arguments from an example (a tensor or a tuple), cloned."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs.clone(),)
    if isinstance(example_inputs, (tuple, list)) and example_inputs:
        return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in example_inputs)
    raise PlanError(
        f"example_inputs must be a tensor or a non-empty tuple of forward's positional "
        f"arguments, got {type(example_inputs).__name__}"
    )


def working_copy(model: nn.Module, train: bool) -> nn.Module:
    """The copy planning runs on: the planner never modifies the caller's model."""
    try:
        return copy.deepcopy(model).train(train)
    except Exception as exc:
        raise PlanError(f"cannot copy {type(model).__name__} to plan on (copy.deepcopy "
                        f"failed: {exc}); the planner never modifies the caller's model") from exc


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


def format_label(fmt: str | Format | None, what: str) -> Label | None:
    """The label of a requested input or output format; ``PlanError`` for a format the
    planner does not take (channels_last_1d: 1-d models are planned from the costs only)."""
    if fmt is None:
        return None
    try:
        parsed = Format.parse(fmt)
    except LayoutError as exc:
        raise PlanError(f"{what} {fmt!r}: {exc}") from None
    if parsed is Format.CHANNELS_LAST_1D:
        raise PlanError(f"{what} {fmt!r}: the planner handles contiguous and channels_last(_3d)")
    return Label.parse(parsed)


class Replanner:
    """Plans a new input shape of an ``OptimizedModule`` on its live weights: ``base`` is the
    original model's structure holding the optimized module's parameters and buffers."""

    def __init__(self, base: nn.Module, planned: nn.Module, options: PlanOptions) -> None:
        _share_tensors(base, planned)
        self.base = base
        # a plan per shape chooses formats only, on the weights as they are: no guard, no
        # padding, memory or mkldnn steps (they stay the example's), one plan
        self.options = dataclasses.replace(
            options, guard=False, keep_weight_formats=True, max_plans=1, memory=False,
            memory_budget=None, padding=False, blocked=False, refresh=False, progress=None)

    def __call__(self, optimized: OptimizedModule,
                 args: tuple[Any, ...]) -> tuple[nn.Module, Plan]:
        start = time.perf_counter()
        base = self.base
        _share_tensors(base, optimized.module)  # the live tensors (after .to(), a load, ...)
        training = optimized.module.training
        base.train(training)
        xs = example_inputs_of(tuple(x.detach() if isinstance(x, torch.Tensor) else x
                                     for x in args))
        # the module may have moved since the example's plan (``.to()``): this call's device
        options = dataclasses.replace(self.options, train=training, device=device_of(xs, base))
        if options.input_label is not None:
            xs = inputs_in(xs, options.input_label, options.ranks)
        # planned on the live tensors themselves (kept formats: the rewrite makes no new
        # parameter), so every reference to them, a plain list of submodules too, stays one
        # tensor; the state planning's runs change is put back, whatever happens
        live = {id(t): t for t in [*base.parameters(), *base.buffers()]}
        work = copy.deepcopy(base, live).train(training)
        state = module_state(base)
        try:
            plan, module = plan_model(work, xs, options, start=start)
        finally:
            restore_state(base, state)
        _share_tensors(module, base)  # where the rewrite made new tensors: the live ones
        module.train(training)
        return module, plan


def _share_tensors(dst: nn.Module, src: nn.Module) -> None:
    """Point ``dst``'s parameters and buffers at ``src``'s of the same name and shape."""
    for kind in ("_parameters", "_buffers"):
        named = src.named_parameters if kind == "_parameters" else src.named_buffers
        live = dict(named(remove_duplicate=False))
        mine = dst.named_parameters if kind == "_parameters" else dst.named_buffers
        for name, t in list(mine(remove_duplicate=False)):
            other = live.get(name)
            if other is None or other is t or other.shape != t.shape:
                continue
            owner, _, attr = name.rpartition(".")
            getattr(dst.get_submodule(owner) if owner else dst, kind)[attr] = other


def _rng_state() -> tuple[torch.Tensor, Any]:
    cuda = (torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    return torch.random.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, Any]) -> None:
    torch.random.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


__all__ = ["MemlayoutError", "OptimizedModule", "Plan", "optimize"]
