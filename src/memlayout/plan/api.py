"""``memlayout.optimize``: capture -> costs -> solve -> rewrite -> verify, as one call.

>>> import torch
>>> from torch import nn
>>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.GroupNorm(2, 8), nn.Conv2d(8, 8, 3))
>>> opt = optimize(net, torch.randn(1, 3, 12, 12), measure=False)
>>> opt.plan.verification["ok"], opt.plan.measured
(True, 0)
>>> torch.equal(opt(torch.ones(1, 3, 12, 12)), opt(torch.ones(1, 3, 12, 12)))
True
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from memlayout.errors import MemlayoutError, PlanError
from memlayout.layout import Format
from memlayout.plan.capture import (
    autocast_context,
    capture,
    device_of,
    iter_nodes,
    layout_ranks,
)
from memlayout.plan.costs import CostCache, device_name, measure_costs
from memlayout.plan.drops import drop_notes, notes_of
from memlayout.plan.problem import AUTO, OUTPUT_PREFIX, baseline_labels, formulate
from memlayout.plan.result import FORMAT_NAMES, Conversion, NodeChoice, Plan, conv1d_notes
from memlayout.plan.rewrite import PlannedGraph, rewrite
from memlayout.plan.solve import Problem, objective, solve_min_cut
from memlayout.plan.verify import TOLERANCE, compare, verify, verify_training
from memlayout.tensors import iter_tensors

_DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None, "float32": None, "float": None,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}

Progress = Callable[[int, int, str], None]


Signature = tuple[tuple[tuple[int, ...], str, str], ...]


def shape_signature(args: Any) -> Signature:
    """What a plan is made for: shape, dtype and device of every tensor argument.

    >>> shape_signature((torch.zeros(2, 3, 8, 8),))
    (((2, 3, 8, 8), 'float32', 'cpu'),)
    """
    return tuple((tuple(t.shape), str(t.dtype).removeprefix("torch."), str(t.device))
                 for t in iter_tensors(args))


def _call_signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Signature:
    """``shape_signature((args, kwargs))``, without walking the structure in the common call
    of plain tensor arguments (this runs on every forward)."""
    if not kwargs and all(type(a) is torch.Tensor for a in args):
        return shape_signature(args)
    return shape_signature((args, kwargs))


#: torch's memory format per (label, rank) where ``Tensor.is_contiguous`` can check it
_TORCH_FORMATS = {(0, 4): torch.contiguous_format, (0, 5): torch.contiguous_format,
                  (1, 4): torch.channels_last, (1, 5): torch.channels_last_3d}


def _arrive(args: tuple[Any, ...], label: int, ranks: tuple[int, ...]) -> tuple[Any, ...]:
    """``args`` with their layout-rank tensors in ``label``'s format, as a plan's inputs
    arrive; ``args`` themselves when every one already is dense in it (the usual call: one
    stride check per tensor, no walk through ``to_format``)."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() in ranks:
            fmt = _TORCH_FORMATS.get((label, a.dim()))
            if fmt is None or not a.is_contiguous(memory_format=fmt):
                return _inputs_in(args, label, ranks)
        elif not isinstance(a, torch.Tensor) and isinstance(a, (tuple, list)):
            return _inputs_in(args, label, ranks)
    return args


class OptimizedModule(nn.Module):
    """The planned model: runs eagerly with the planned layouts (under autocast when planned
    with a dtype); ``state_dict`` keys are the original model's, so state dicts load both
    ways. ``.plan`` is the :class:`Plan` of the example's shape.

    A call whose input shape signature (:func:`shape_signature`) differs from the example's
    is planned on first sight (see ``optimize``'s ``max_plans``): ``.plans`` maps each
    signature held to its plan, ``.replans`` counts the plans made after the example's. A
    shape whose plan fails (capture or verification) runs the original model's computation
    on the same weights, with a warning, and is not planned again.

    >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    >>> opt = optimize(net, torch.randn(2, 3, 8, 8), train=True, measure=False, cache=False)
    >>> opt(torch.randn(3, 3, 8, 8)).sum().backward()  # batch 3: planned now, once
    >>> opt.replans, [p.input_shapes for p in opt.plans.values()]
    (1, [[[2, 3, 8, 8]], [[3, 3, 8, 8]]])
    """

    def __init__(self, module: nn.Module, plan: Plan, dtype: torch.dtype | None, *,
                 replan: _Replanner | None = None, max_plans: int = 8,
                 signature: Signature | None = None,
                 ranks: tuple[int, ...] = (4, 5)) -> None:
        super().__init__()
        self.module = module
        self.plan = plan
        self.autocast_dtype = dtype
        self.max_plans = max_plans
        self.replans = 0
        self.__dict__["_replan"] = replan  # plain attributes, not children: one set of weights
        self.__dict__["_signature"] = signature
        self.__dict__["_shapes"] = OrderedDict()  # signature -> (module, plan), LRU order
        self.__dict__["_ranks"] = tuple(ranks)  # the layout ranks planned (inputs converted)
        self._register_state_dict_hook(_strip_prefix)
        self._register_load_state_dict_pre_hook(_add_prefix)

    @property
    def plans(self) -> dict[Signature, Plan]:
        """The plans held, by input shape signature: the example's first."""
        held: dict[Signature, Plan] = {}
        if self._signature is not None:
            held[self._signature] = self.plan
        held.update((sig, plan) for sig, (_, plan) in self._shapes.items() if plan is not None)
        return held

    def prepare_inputs(self, *args: Any) -> tuple[Any, ...]:
        """``args`` as the plan's inputs arrive: every rank-4/5 tensor (rank 3 too in a 1-d
        model) in ``plan.input_format``, converted once here, so the calls that follow convert
        nothing; ``args`` unchanged when the plan has no input format. What a data pipeline
        (or a benchmark) does before its loop."""
        if self.plan.input_format is None:
            return args
        return _arrive(args, FORMAT_NAMES.index(self.plan.input_format), self._ranks)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        module, plan = self._module_for(args, kwargs)
        if plan is not None and plan.input_format is not None:
            # the format the plan's inputs arrive in: a no-op for inputs already in it
            args = _arrive(args, FORMAT_NAMES.index(plan.input_format), self._ranks)
        with autocast_context(device_of(args, self.module), self.autocast_dtype):
            return module(*args, **kwargs)

    def _module_for(self, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> tuple[nn.Module, Plan | None]:
        if self._replan is None or self._signature is None or _compiling():
            # under torch.compile the example's plan serves every shape (its conversions do
            # not depend on the shape; dynamo recompiles per shape): no planning traced (#6)
            return self.module, self.plan
        sig = _call_signature(args, kwargs)
        if sig == self._signature:
            return self.module, self.plan
        entry = self._shapes.get(sig)
        if entry is not None:
            self._shapes.move_to_end(sig)
            return entry
        try:
            module, plan = self._replan(self, args)
        except MemlayoutError as exc:
            import warnings

            warnings.warn(f"memlayout: planning input shapes {[s for s, _, _ in sig]} failed "
                          f"({exc}); running the original model's computation (same weights) "
                          "for them", stacklevel=3)
            module, plan = self._replan.base, None
        self.replans += 1
        self._shapes[sig] = (module, plan)
        while self._shapes and len(self._shapes) > max(0, self.max_plans - 1):
            self._shapes.popitem(last=False)
        return module, plan

    def train(self, mode: bool = True) -> OptimizedModule:
        super().train(mode)
        for module, _ in self._shapes.values():
            module.train(mode)
        return self

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> OptimizedModule:
        # ``.to()``, ``.cuda()``, ``.double()``: buffers become new tensors, which the plans of
        # other shapes (not children) would not see; they are planned again when next seen.
        super()._apply(fn, *args, **kwargs)
        self._shapes.clear()
        return self


def _compiling() -> bool:
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


def _strip_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                  local_metadata: Any) -> None:
    inner = prefix + "module."
    items = list(state_dict.items())
    state_dict.clear()
    for k, v in items:
        state_dict[prefix + k[len(inner):] if k.startswith(inner) else k] = v
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        for k in [k for k in meta if k.startswith(inner[:-1])]:
            meta[prefix + k[len(inner):] if k.startswith(inner) else prefix[:-1]] = meta.pop(k)


def _add_prefix(state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    inner = prefix + "module."
    for k in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + k[len(prefix):]] = state_dict.pop(k)


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``None``/fp32 (no autocast), bf16 or fp16 (autocast) from a name or ``torch.dtype``."""
    if dtype is None or dtype == torch.float32:
        return None
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.bfloat16, torch.float16):
            return dtype
    elif isinstance(dtype, str) and dtype.strip().lower() in _DTYPES:
        return _DTYPES[dtype.strip().lower()]
    raise PlanError(f"dtype {dtype!r} is not supported; use fp32, bf16 or fp16 "
                    "(or torch.float32 / torch.bfloat16 / torch.float16)")


def _label(fmt: str | Format | None, what: str) -> int | None:
    if fmt is None:
        return None
    parsed = Format.parse(fmt)
    if parsed is Format.CONTIGUOUS:
        return 0
    if parsed in (Format.CHANNELS_LAST, Format.CHANNELS_LAST_3D):
        return 1
    raise PlanError(f"{what} {fmt!r}: the planner handles contiguous and channels_last(_3d)")


def _inputs(example_inputs: Any) -> tuple[Any, ...]:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs.clone(),)
    if isinstance(example_inputs, (tuple, list)) and example_inputs:
        return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in example_inputs)
    raise PlanError(
        f"example_inputs must be a tensor or a non-empty tuple of forward's positional "
        f"arguments, got {type(example_inputs).__name__}"
    )


def optimize(model: nn.Module, example_inputs: Any, *, dtype: str | torch.dtype | None = None,
             input_format: str | Format | None = None, output_format: str | Format | None = "keep",
             measure: bool = True, cache: bool | str | Path = True,
             progress: Progress | None = None, rounds: int = 5, name: str | None = None,
             guard: bool = True, guard_rounds: int = 5, train: bool = False,
             keep_weight_formats: bool = False, max_plans: int = 8,
             guard_margin: float = 0.0, memory: bool = True,
             memory_budget: int | str | None = None, padding: bool = True,
             blocked: bool = False, refresh: bool = False) -> OptimizedModule:
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
      user cache, see ``memlayout.plan.costs.cache_path``), ``False``, or a database path;
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
      costs (see ``memlayout.plan.guard``).
    - ``train``: plan a training step. Costs are forward + backward per node in each format
      (a conversion in the forward brings one of its gradient in the backward: both count),
      the guard times forward + backward, and verification compares one training step
      (outputs, every parameter's and input's gradient, BatchNorm's running statistics after
      it; same RNG state for both, element-wise dropout masks drawn in logical order, as
      PyTorch's follow memory order) with the original's.
      The returned module is in train mode; its parameters are ``nn.Parameter``s any
      optimizer takes (build it from ``optimized.parameters()``), and their gradients come
      back in their strides (what DDP's gradient buckets expect).
    - ``keep_weight_formats``: every node that owns a rank-4/5 parameter runs in the format
      the parameter already has (no new parameter tensors).
    - ``max_plans``: changing shapes. A call with another input shape signature (shapes,
      dtypes, devices of the tensor arguments: another batch size or image size) is planned
      on first sight, on the live weights, with their formats kept (one set of parameters
      serves every shape), no guard, verified; the plan is cached, at most ``max_plans``
      plans held (the example's always), least recently used dropped first. The cost cache
      makes a replan of a known shape measure nothing; it still traces the model, solves,
      and runs the verification (about 3 forward passes; 2 forward + backward in training).
      ``optimized.plans`` holds the plans by signature.
    - ``padding`` (with ``measure``): convolutions whose channel counts are not a multiple of
      the vector width run padded where that measures faster (``memlayout.plan.padding``).
    - ``blocked`` (with ``measure``, default off): where this build has mkldnn tensors, chains
      of supported ops are timed in that blocked format too and reported, never applied
      (``memlayout.plan.blocked``).
    - ``memory``: ``plan.memory`` reports the peak activation memory of the planned model vs
      the original (``memlayout.plan.memory``); ``memory_budget`` (bytes, or ``"300MB"``):
      the fastest plan whose peak fits, or ``PlanError`` saying the smallest peak found.

    Raises ``PlanError`` / ``CaptureError`` for bad input, ``LayoutVerificationError`` when the
    planned model would compute something else.
    """
    start = time.perf_counter()
    if not isinstance(model, nn.Module):
        raise PlanError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    run_dtype = parse_dtype(dtype)
    if not isinstance(max_plans, int) or max_plans < 1:
        raise PlanError(f"max_plans must be an int >= 1 (the example's plan is always held), "
                        f"got {max_plans!r}; 1 plans every other shape at each call")
    auto_input = isinstance(input_format, str) and input_format.strip().lower() == AUTO
    input_label = None if auto_input else _label(input_format, "input_format")
    if output_format == "keep":
        output_label: int | str | None = "keep"
    else:
        output_label = _label(output_format, "output_format")
    inputs = _inputs(example_inputs)
    if input_label is not None:
        inputs = _inputs_in(inputs, input_label)
    try:
        work = copy.deepcopy(model).train(train)
    except Exception as exc:
        raise PlanError(f"cannot copy {type(model).__name__} to plan on (copy.deepcopy "
                        f"failed: {exc}); the planner never modifies the caller's model") from exc
    store = _open_cache(cache, refresh=refresh) if measure else None
    # planning runs the model many times (a training-mode BatchNorm updates its statistics,
    # Dropout draws): the state the model had and the caller's RNG are restored afterwards
    saved_state = {k: b.detach().clone() for k, b in work.named_buffers()}
    rng_state = _rng_state()
    try:
        captured = capture(work, inputs, dtype=run_dtype)
        device = device_of(inputs, work)
        predicted = {"planned": 0.0, "all_contiguous": 0.0, "all_channels_last": 0.0}
        measured = cached = 0
        solved = []
        for region in captured.regions:
            table = measure_costs(region.gm, region.inputs, dtype=run_dtype, measure=measure,
                                  cache=store, rounds=rounds, progress=progress, train=train)
            measured += table.measured
            cached += table.cached
            drop_notes(region.gm, region.inputs, table, dtype=run_dtype)  # into node.meta
            root_input = AUTO if auto_input else input_label
            form = formulate(region.gm, table,
                             input_label=root_input if region.path == "" else None,
                             output_label=output_label if region.path == "" else "keep")
            if keep_weight_formats:
                form = _pin_weight_formats(region.gm, form)
            try:
                labels = solve_min_cut(form.integer).labels
            except ValueError:
                # A shared module pinned two ways (one call fails in a format): solve without
                # the weight ties; verification still guards the result.
                labels = solve_min_cut(Problem(form.integer.unary, form.integer.tensors,
                                               form.integer.pins)).labels
            relaxed = Problem(form.seconds.unary, form.seconds.tensors)
            predicted["planned"] += objective(relaxed, labels) or 0.0
            predicted["all_contiguous"] += objective(relaxed, baseline_labels(form.seconds, 0)) or 0.0
            predicted["all_channels_last"] += objective(relaxed, baseline_labels(form.seconds, 1)) or 0.0
            solved.append((region, table, form, labels))
        # input_format="auto": the format the solver gave the inputs (None: no root graph
        # input in a definite format, they stay as the example is)
        entry = _chosen_input(solved) if auto_input else input_label
        if auto_input and entry is not None:
            inputs = _inputs_in(inputs, entry)
        guard_result: dict[str, Any] = {}
        if guard and measure and any(len(s[3]) for s in solved):
            built, guard_result = _guarded_build(
                work, solved, inputs, run_dtype, store=store, rounds=guard_rounds,
                margin=guard_margin, progress=progress, output_label=output_label,
                reference=captured.output, train=train,
                own_inputs=auto_input and entry is not None,
                extra=[AUTO if auto_input else input_label, output_label,
                       *(["train"] if train else [])])
            kept_label = _guard_uniform_label(guard_result)
            if auto_input and entry is not None and kept_label is not None:
                entry = kept_label  # an eager model won: its inputs arrive in its format
                inputs = _inputs_in(inputs, entry)
        else:
            built = _build(work, solved)
        if auto_input and entry is not None:
            # the inputs arrive in ``entry`` from now on: a plan considered later (a memory
            # budget's candidates) must take them so
            solved = _pin_inputs(solved, entry)
        planned_tree, checks, nodes, conversions = built
        # issue #10: padded channels, blocked formats, peak memory and a memory budget
        from memlayout.plan import memory as mem

        budget = mem.budget_bytes(memory_budget)
        # records below are cached under the plan's signature: a second plan runs no forward
        signature = mem.plan_signature(solved, [guard_result.get("kept", "planned"),
                                                AUTO if auto_input else input_label,
                                                output_label, train])
        padded: list[dict[str, Any]] = []
        # training: a padded convolution's weights are copies made here, they would not train
        if padding and measure and not train:
            from memlayout.plan.padding import plan_padding, records

            padded = records(plan_padding(planned_tree, inputs, dtype=run_dtype, cache=store,
                                          rounds=rounds, progress=progress, signature=signature))
        memory_record: dict[str, Any] = {}
        if memory or budget is not None:
            (planned_tree, checks, nodes, conversions), memory_record = mem.memory_step(
                work, inputs, run_dtype, built, solved=solved, budget=budget, padding=padded,
                kept=guard_result.get("kept", "planned"), predicted=predicted,
                build=lambda s: _build(work, s),
                build_uniform=lambda label: _build_uniform(
                    work, solved, inputs, label, _output_label(captured.output, output_label),
                    arrive=entry if auto_input else None),
                cache=store, signature=signature)
        blocked_record: dict[str, Any] = {}
        if blocked and measure:
            from memlayout.plan.blocked import measure_blocked

            blocked_record = measure_blocked(planned_tree, inputs, dtype=run_dtype, cache=store,
                                             rounds=rounds, signature=signature)
        _restore_buffers(saved_state, work, planned_tree)
        verify_start = time.perf_counter()
        if train:
            verification = _verify_training(work, planned_tree, inputs, checks, run_dtype)
        else:
            verification = _verify(work, planned_tree, inputs, checks, run_dtype,
                                   expected=captured.output)
        verification["seconds"] = time.perf_counter() - verify_start
        plan = Plan(
            model=name or type(model).__name__, device=device_name(device),
            torch_version=torch.__version__,
            dtype=None if run_dtype is None else str(run_dtype).removeprefix("torch."),
            input_format=None if entry is None else FORMAT_NAMES[entry],
            output_format=output_label if output_label in (None, "keep") else FORMAT_NAMES[output_label],  # type: ignore[index]
            nodes=nodes, conversions=conversions, predicted=predicted,
            regions=[r.path for r in captured.regions],
            uncaptured=[[p, r] for p, r in captured.uncaptured],
            measured=measured, cached=cached, measure=measure,
            planning_seconds=time.perf_counter() - start, verification=verification,
            guard=guard_result, padding=padded, memory=memory_record, blocked=blocked_record,
            train=train, input_shapes=[list(t.shape) for t in iter_tensors(inputs)],
            weight_formats_kept=keep_weight_formats,
        )
        plan.notes.extend(conv1d_notes(plan.nodes))  # #6: rank 3, planned or why not
        if auto_input:
            plan.notes.append(
                f"input_format='auto': inputs should arrive {FORMAT_NAMES[entry]} (converted "
                "on entry otherwise)" if entry is not None else
                "input_format='auto': no input in a definite format at the top level; inputs "
                "are taken as they come")
    finally:
        if store is not None:
            store.close()
        _set_rng_state(rng_state)
    if train:
        planned_tree.zero_grad(set_to_none=True)
    replan = _Replanner(work, planned_tree, dict(
        dtype=dtype, input_format=input_format, output_format=output_format, measure=measure,
        cache=cache, rounds=rounds, name=name or type(model).__name__))
    optimized = OptimizedModule(planned_tree, plan, run_dtype, replan=replan,
                                max_plans=max_plans, signature=shape_signature(inputs),
                                ranks=layout_ranks())
    return optimized.train(train)


class _Replanner:
    """Plans a new input shape of an ``OptimizedModule`` on its live weights: ``base`` is the
    original model's structure holding the optimized module's parameters and buffers."""

    def __init__(self, base: nn.Module, planned: nn.Module, options: dict[str, Any]) -> None:
        _share_tensors(base, planned)
        self.base = base
        self.options = options

    def __call__(self, optimized: OptimizedModule,
                 args: tuple[Any, ...]) -> tuple[nn.Module, Plan]:
        base = self.base
        _share_tensors(base, optimized.module)  # the live tensors (after .to(), a load, ...)
        training = optimized.module.training
        base.train(training)
        options = dict(self.options, guard=False, train=training, keep_weight_formats=True,
                       max_plans=1)
        accepted = inspect.signature(optimize).parameters
        # a plan per shape chooses formats only (issue #10's extra steps stay the example's)
        options.update({k: False for k in ("memory", "padding", "blocked") if k in accepted})
        xs = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in args)
        result = optimize(base, xs, **options)
        module = result.module
        _share_tensors(module, base)  # same values (a copy of them was planned on)
        module.train(training)
        return module, result.plan


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


def _pin_weight_formats(gm: fx.GraphModule, form: Any) -> Any:
    """``form`` with every node that owns (or reads) rank-4/5 parameters pinned to the format
    those parameters have (canonical strides), where exactly one format fits."""
    from memlayout.layout import strides_for
    from memlayout.plan.capture import label_format
    from memlayout.plan.costs import module_has_layout_params

    pins: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.name not in form.seconds.unary or n.name in form.integer.pins:
            continue
        tensors: list[torch.Tensor] = []
        if n.op == "call_module" and module_has_layout_params(gm, n):
            sub = gm.get_submodule(n.target)
            tensors += [t for t in [*sub.parameters(), *sub.buffers()] if t.dim() in layout_ranks()]
        for m in n.all_input_nodes:
            if m.op == "get_attr":
                value: Any = gm
                for part in str(m.target).split("."):
                    value = getattr(value, part, None)
                if isinstance(value, torch.Tensor) and value.dim() in layout_ranks():
                    tensors.append(value)
        fits = [label for label in (0, 1) if tensors and all(
            tuple(t.stride()) == strides_for(tuple(t.shape), label_format(label, t.dim()))
            for t in tensors)]
        if len(fits) == 1:
            pins[n.name] = fits[0]
    if not pins:
        return form
    return dataclasses.replace(
        form, integer=dataclasses.replace(form.integer, pins={**form.integer.pins, **pins}),
        seconds=dataclasses.replace(form.seconds, pins={**form.seconds.pins, **pins}))


def _restore_buffers(saved: dict[str, torch.Tensor], *modules: nn.Module) -> None:
    with torch.no_grad():
        for module in modules:
            for name, b in module.named_buffers():
                if name in saved and saved[name].shape == b.shape:
                    b.copy_(saved[name])


def _rng_state() -> tuple[torch.Tensor, Any]:
    cuda = (torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    return torch.random.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, Any]) -> None:
    torch.random.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _build(work: nn.Module, solved: list) -> tuple[nn.Module, list, list[NodeChoice],
                                                   list[Conversion]]:
    """Rewrite a copy of ``work`` with one labelling per region."""
    # The copy shares every parameter and buffer with ``work`` (the rewrite puts converted
    # weights in new tensors), so planning holds the weights once, not twice.
    shared = {id(t): t for t in [*work.parameters(), *work.buffers()]}
    planned_tree = copy.deepcopy(work, shared)
    nodes: list[NodeChoice] = []
    conversions: list[Conversion] = []
    checks = []
    for region, table, form, labels in solved:
        sub = planned_tree.get_submodule(region.path) if region.path else planned_tree
        gm = _graph_module_on(sub, region.gm)
        planned, made = rewrite(sub, gm, form, labels)
        if region.path:
            parent_path, _, child = region.path.rpartition(".")
            parent = planned_tree.get_submodule(parent_path) if parent_path else planned_tree
            setattr(parent, child, planned)
        else:
            planned_tree = planned
        drops = notes_of(region.gm)
        for n, c in table.nodes.items():
            nodes.append(NodeChoice(region.path, n, c.op, FORMAT_NAMES[labels[n]],
                                    dict(zip(FORMAT_NAMES, c.seconds, strict=True)), c.timed,
                                    drops.get(n, [])))
        for value, to, served in made:
            cost = table.conversions[value]
            conversions.append(Conversion(
                region.path, value, FORMAT_NAMES[to], [list(s) for s in cost.shapes],
                cost.nbytes, cost.to_1 if to == 1 else cost.to_0, list(served)))
        checks.append((region, planned))
    return planned_tree, checks, nodes, conversions


def _guarded_build(work: nn.Module, solved: list, inputs: tuple[Any, ...],
                   dtype: torch.dtype | None, *, store: CostCache | None, rounds: int,
                   margin: float, progress: Progress | None, output_label: int | str | None,
                   reference: Any, extra: Any, train: bool = False,
                   own_inputs: bool = False) -> tuple[tuple, dict[str, Any]]:
    """Build the min-cut plan; time it as a whole model against the original run entirely
    in one format (eager NCHW, eager NHWC: weights and inputs converted, outputs as
    ``output_label`` says), skipping a format the plan already is end to end (or read that
    measurement from the cache); return the kept one's build and the guard's record
    (``memlayout.plan.guard``). ``own_inputs`` (``input_format="auto"``): each candidate is
    timed with its inputs already in its format (the plan's: as ``inputs`` are), none of
    them converts on entry."""
    from memlayout.plan import guard as g

    planned = _build(work, solved)
    skipped = [name for name, label in g.UNIFORM.items() if _is_uniform(solved, planned, label)]
    names = [name for name in g.UNIFORM if name not in skipped]
    if _output_label(reference, output_label) == "mixed":
        names, skipped = [], []  # outputs in both formats: a one-format model cannot keep them
    if skipped:
        # The plan runs the model in one format end to end: run it exactly as that eager model
        # (no graph module in between), so it is what it is compared with, not a copy of it.
        eager = _build_uniform(work, solved, inputs, g.UNIFORM[skipped[0]],
                               _output_label(reference, output_label),
                               arrive=g.UNIFORM[skipped[0]] if own_inputs else None)
        planned = (eager[0], [], planned[2], planned[3])
    if not names:
        return planned, {"kept": g.PLANNED, "margin": margin, "source": "none", "rounds": 0,
                         "candidates": {}, "skipped": skipped, "errors": {}}

    def build(name: str) -> tuple:
        if name == g.PLANNED:
            return planned
        return _build_uniform(work, solved, inputs, g.UNIFORM[name],
                              _output_label(reference, output_label),
                              arrive=g.UNIFORM[name] if own_inputs else None)

    device = device_of(inputs, work)
    key = g.cache_key(device_name(device), dtype, g.signature(
        [(r.path, r.gm, labels) for (r, _, _, labels) in solved], [extra, names, skipped]))
    record = store.get(key) if store is not None else None
    if record is not None:
        kept = g.decide(record, margin=margin)
        return build(kept), g.describe(record, kept=kept, margin=margin, source="cache",
                                       skipped=skipped)
    builds = {name: build(name) for name in [g.PLANNED, *names]}
    steps = [0]

    def on_step(_round: int, name: str) -> None:
        steps[0] += 1
        if progress is not None:
            # a close call runs as many rounds again (memlayout.plan.guard.is_close)
            total = rounds * len(builds) * (1 + (steps[0] > rounds * len(builds)))
            progress(steps[0], total, f"whole model, {name}")

    start = time.perf_counter()
    inputs_of = {name: _inputs_in(inputs, g.UNIFORM[name]) for name in names} \
        if own_inputs else None
    record = g.time_candidates({name: b[0] for name, b in builds.items()}, inputs, dtype,
                               rounds=rounds, on_step=on_step, train=train, margin=margin,
                               inputs_of=inputs_of)
    if store is not None and not record["errors"]:
        store.put(key, record)
    kept = g.decide(record, margin=margin)
    described = g.describe(record, kept=kept, margin=margin, source="measured", skipped=skipped)
    described["seconds"] = time.perf_counter() - start
    return builds[kept], described


def _guard_uniform_label(record: dict[str, Any]) -> int | None:
    """The label of the eager model the guard kept (``None``: it kept the plan)."""
    from memlayout.plan.guard import UNIFORM

    return UNIFORM.get(record.get("kept", ""))


def _chosen_input(solved: list) -> int | None:
    """The label the solver gave the top-level graph's inputs (``input_format="auto"``: all
    tied to one), ``None`` when none is a variable (no top-level graph, no input in a
    definite format)."""
    for region, _, form, labels in solved:
        if region.path == "":
            for n in region.gm.graph.nodes:
                if n.op == "placeholder" and n.name in form.seconds.unary:
                    return labels[n.name]
    return None


def _pin_inputs(solved: list, label: int) -> list:
    """``solved`` with the top-level graph's input variables (``input_format="auto"``) pinned
    to ``label``, and that region solved again if its labels had the inputs otherwise (the
    guard kept an eager model whose format is not the one the min cut chose)."""
    out = []
    for region, table, form, labels in solved:
        names = [n.name for n in region.gm.graph.nodes
                 if region.path == "" and n.op == "placeholder" and n.name in form.seconds.unary]
        if names:
            pins = dict.fromkeys(names, label)
            form = dataclasses.replace(
                form, integer=dataclasses.replace(form.integer, pins={**form.integer.pins, **pins}),
                seconds=dataclasses.replace(form.seconds, pins={**form.seconds.pins, **pins}))
            if any(labels[n] != label for n in names):
                try:
                    labels = solve_min_cut(form.integer).labels
                except ValueError:  # weight ties that contradict the pins: drop the ties
                    labels = solve_min_cut(Problem(form.integer.unary, form.integer.tensors,
                                                   form.integer.pins)).labels
        out.append((region, table, form, labels))
    return out


def _inputs_in(inputs: tuple[Any, ...], label: int,
               ranks: tuple[int, ...] | None = None) -> tuple[Any, ...]:
    """``inputs`` with every tensor of a layout rank (``ranks``, default the planning's) in
    ``label``'s format; the same tensor when it already is."""
    from memlayout.plan.costs import convert_value

    return convert_value(tuple(inputs), label, ranks)


def _is_uniform(solved: list, planned: tuple, label: int) -> bool:
    """The plan runs the whole model in ``label`` as eager would: one region (the model),
    every layout node in ``label`` (or pinned), conversions only of inputs or for outputs."""
    if len(solved) != 1 or solved[0][0].path != "":
        return False
    region, _, form, labels = solved[0]
    if labels != baseline_labels(form.seconds, label):
        return False
    inputs = {n.name for n in region.gm.graph.nodes if n.op == "placeholder"}
    return all(c.value in inputs or all(u.startswith(OUTPUT_PREFIX) for u in c.consumers)
               for c in planned[3])


def _output_label(reference: Any, output_label: int | str | None) -> int | str | None:
    """The label the outputs of a one-format model are converted to: ``None`` (as they come),
    0 / 1, or ``"mixed"`` (kept outputs in both formats: not possible)."""
    if output_label != "keep":
        return output_label
    from memlayout.plan.capture import FREE, NONE, value_meta

    label = value_meta(reference).label
    if label in (0, 1):
        return label
    return None if label in (None, FREE) else "mixed" if label == NONE else None


def _inputs_to(module: nn.Module, args: tuple[Any, ...], *, label: int) -> tuple[Any, ...]:
    from memlayout.plan.costs import convert_value

    return convert_value(tuple(args), label)


def _outputs_to(module: nn.Module, args: tuple[Any, ...], output: Any, *, label: int) -> Any:
    from memlayout.tensors import convert_batch

    out = convert_batch(output, Format.CHANNELS_LAST if label else Format.CONTIGUOUS)
    return convert_batch(out, Format.CHANNELS_LAST_3D) if label else out


def _build_uniform(work: nn.Module, solved: list, inputs: tuple[Any, ...], label: int,
                   output_label: int | str | None, *, arrive: int | None = None) -> tuple:
    """The original model run entirely in ``label``, as eager NCHW / NHWC: a copy with its
    weights converted, inputs converted on entry (outputs to ``output_label``) by hooks,
    so ``state_dict`` keys stay the original's. ``arrive``: the label inputs arrive in
    (``None``: as captured), for the conversions listed."""
    import functools

    from memlayout.plan.costs import convert_module_to

    model = convert_module_to(copy.deepcopy(work), label)
    model.register_forward_pre_hook(functools.partial(_inputs_to, label=label))
    if output_label in (0, 1):
        model.register_forward_hook(functools.partial(_outputs_to, label=output_label))
    fmt = FORMAT_NAMES[label]
    nodes = [NodeChoice(r.path, n, c.op, fmt, dict(zip(FORMAT_NAMES, c.seconds, strict=True)),
                        c.timed, notes_of(r.gm).get(n, []))
             for r, t, _, _ in solved for n, c in t.nodes.items()]
    conversions = []
    if solved[0][0].path == "":
        region, table = solved[0][0], solved[0][1]
        for n in region.gm.graph.nodes:
            meta = n.meta.get("memlayout")
            if n.op != "placeholder" or meta is None or meta.label not in (0, 1):
                continue
            if (meta.label if arrive is None else arrive) == 1 - label:
                cost = table.conversions.get(n.name)
                conversions.append(Conversion(
                    "", n.name, fmt, [list(t.shape) for t in meta.layout_tensors], meta.nbytes,
                    0.0 if cost is None else cost.to_1 if label else cost.to_0, ["forward"]))
    return model, [], nodes, conversions


def _open_cache(cache: bool | str | Path, *, refresh: bool = False) -> CostCache | None:
    if cache is False:
        return None
    try:
        return CostCache(None if cache is True else Path(cache), refresh=refresh)
    except Exception as exc:  # an unwritable cache must not stop planning: measure instead
        import warnings

        warnings.warn(f"memlayout: cost cache unavailable ({exc}); measuring without it",
                      stacklevel=3)
        return None


def _graph_module_on(root: nn.Module, traced: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``traced``'s graph (names and meta kept) as a GraphModule over ``root``."""
    graph = copy.deepcopy(traced.graph)
    for n in iter_nodes(traced, "get_attr"):
        head = n.target.split(".")[0]
        if not hasattr(root, head):
            setattr(root, head, copy.deepcopy(getattr(traced, head)))
    return fx.GraphModule(root, graph)


def _verify(work: nn.Module, planned_tree: nn.Module, inputs: tuple[Any, ...], checks: list,
            dtype: torch.dtype | None, *, expected: Any) -> dict[str, Any]:
    """Run the planned model once and compare with ``expected`` (the original's output from
    the capture run). A whole-model plan is one region: compared (and on a mismatch bisected)
    directly. Planned submodules: the whole model is compared; on a mismatch each region is
    checked on its own inputs to name the first divergent node."""
    if len(checks) == 1 and checks[0][0].path == "":
        region, planned = checks[0]
        v = verify(region.gm, planned, region.inputs, dtype=dtype, planned_graph=planned.graph,
                   expected=region.output)
        return {"ok": True, "max_error": v.max_error, "rtol": v.tolerance, "tensors": v.tensors}
    with torch.no_grad(), autocast_context(device_of(inputs, work), dtype):
        got = planned_tree(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
    ok, err, count = compare(expected, got, dtype)
    if not ok:
        for region, planned in checks:  # raises naming the node where a region diverges
            assert isinstance(planned, PlannedGraph)
            verify(region.gm, planned, region.inputs, dtype=dtype, planned_graph=planned.graph,
                   where=region.path, expected=region.output)
        from memlayout.errors import LayoutVerificationError

        where = ("although every planned region matched" if checks else
                 "(the model run entirely in one format, as the guard chose)")
        raise LayoutVerificationError(
            f"the planned model's outputs differ from the original's by {err:.3g} (relative) "
            f"{where}; the plan was not applied")
    rtol = TOLERANCE.get(dtype or torch.float32, TOLERANCE[torch.float32])[0]
    return {"ok": True, "max_error": err, "rtol": rtol, "tensors": count}


def _verify_training(work: nn.Module, planned_tree: nn.Module, inputs: tuple[Any, ...],
                     checks: list, dtype: torch.dtype | None) -> dict[str, Any]:
    """One training step of the planned model against the original's (``work``): a
    whole-model plan is compared (and on a mismatch bisected) directly; planned submodules:
    the whole model, then on a mismatch each region on its own inputs to name the node."""
    if len(checks) == 1 and checks[0][0].path == "":
        region, planned = checks[0]
        v = verify_training(work, planned, inputs, dtype=dtype, reference_graph=region.gm,
                            planned_graph=planned.graph)
    else:
        from memlayout.errors import LayoutVerificationError

        try:
            v = verify_training(work, planned_tree, inputs, dtype=dtype)
        except LayoutVerificationError:
            for region, planned in checks:  # raises naming the node where a region diverges
                verify_training(region.gm, planned, region.inputs, dtype=dtype,
                                reference_graph=region.gm, planned_graph=planned.graph,
                                where=region.path)
            raise
    return {"ok": True, "max_error": v.max_error, "rtol": v.tolerance, "tensors": v.tensors,
            "train": True, "float64_error": v.float64_error}


__all__ = ["MemlayoutError", "OptimizedModule", "Plan", "optimize", "parse_dtype"]


def compare_with_eager(model: nn.Module, optimized: OptimizedModule, example_inputs: Any, *,
                       rounds: int = 7, warmup: int = 1, train: bool = False) -> dict[str, Any]:
    """Time the optimized model against eager NCHW and eager NHWC copies of ``model``,
    interleaved round by round (``memlayout.timing.interleaved``), under the plan's autocast.
    All three get the same input (as the example, or in the plan's ``input_format``); the eager
    modes convert it to their format inside the timed call, as a user of them would.
    ``train``: each call is a training step (gradients cleared, forward, the loss
    ``sum(0.5 * mean(y ** 2))``, backward outside autocast, ``SGD.step``) of the mode's own
    model in train mode; ``optimized`` is trained by it.

    Returns per mode the ``ModeTiming`` and, for each eager mode, the per-round ratios
    ``eager / optimized`` (> 1: the optimized model is faster), their median and range.
    """
    from memlayout.tensors import convert_batch, convert_module
    from memlayout.timing import device_sync, interleaved

    inputs = _inputs(example_inputs)
    dtype = optimized.autocast_dtype
    device = device_of(inputs, model)
    nchw = convert_module(copy.deepcopy(model).train(train), Format.CONTIGUOUS)
    nhwc = copy.deepcopy(model).train(train)
    convert_module(nhwc, Format.CHANNELS_LAST)
    convert_module(nhwc, Format.CHANNELS_LAST_3D)
    inputs = optimized.prepare_inputs(*inputs)

    def runner(module: nn.Module, fmt: Format | None) -> Callable[[], Any]:
        # Every mode gets the same input; an eager mode converts it as its user would.
        sgd = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=1e-4) \
            if train else None

        def run() -> Any:
            xs = inputs
            if fmt is not None:
                xs = convert_batch(xs, fmt)
                if fmt is Format.CHANNELS_LAST:
                    xs = convert_batch(xs, Format.CHANNELS_LAST_3D)
            if sgd is not None:
                from memlayout.plan.guard import train_step

                out = train_step(module, xs, dtype)()
                sgd.step()
                return out
            with torch.no_grad(), autocast_context(device, dtype):
                return module(*xs)
        return run

    c = interleaved({"optimized": runner(optimized, None),
                     "eager_nchw": runner(nchw, Format.CONTIGUOUS),
                     "eager_nhwc": runner(nhwc, Format.CHANNELS_LAST)},
                    rounds=rounds, warmup=warmup, baseline="optimized",
                    sync=device_sync(str(device)))
    return {"comparison": c, **ratios_against(c, "optimized", ("eager_nchw", "eager_nhwc"))}


def ratios_against(c: Any, base: str, others: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Per other mode, the per-round ratios ``other time / base time`` of the interleaved
    comparison ``c`` (> 1: ``base`` is faster) with their median, min and max; a mode with no
    timed round is left out."""
    import statistics

    out: dict[str, dict[str, Any]] = {}
    for name in others:
        ratios = [e / o for e, o in zip(c[name].times, c[base].times, strict=False) if o > 0]
        if ratios:
            out[name] = {"median": statistics.median(ratios), "min": min(ratios),
                         "max": max(ratios), "ratios": ratios}
    return out
