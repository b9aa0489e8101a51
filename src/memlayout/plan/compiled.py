"""``memlayout.compile``: plan, then ``torch.compile`` so the plan stands, or let Inductor decide.

Inductor makes its own layout decision (``GraphLowering.decide_layout_opt``): when
``torch._inductor.config.layout_optimization`` is on (the default) and the graph has 2-d
convolutions, every 2-d convolution's input and weight are *required* channels-last
(``ir.ExternKernel.require_channels_last`` in ``kernel/conv.py``), whatever strides they arrive
with. On CPU with mkldnn that decision is always "on" for a graph with convolutions; elsewhere a
FLOP-weighted heuristic decides for the whole graph. So ``torch.compile(memlayout.optimize(...))``
works, and gives the same values, but Inductor overrides the plan's choice for every 2-d
convolution (3-d and 1-d convolutions keep the strides they are given: Inductor's layout
optimization covers ``ndim == 2`` only). With ``layout_optimization`` off for that compile,
convolutions keep the strides of the traced graph (``constrain_to_fx_strides``): the plan stands.

``compile`` builds both candidates and keeps the plan where it measures faster here by more than
a margin (2 %), else Inductor's own:

- ``planned``: the planned model, compiled with ``layout_optimization`` off (the plan stands);
- ``inductor``: the original model, compiled with the caller's settings (Inductor decides).

They are timed as whole models, interleaved round by round (``memlayout.plan.guard``'s timer,
i.e. ``memlayout.timing.interleaved``), after one untimed call each (the compile). The result
is cached (same SQLite store as the costs) under the device, torch version, dtype, a signature
of the model, the plan and the compile settings: a second ``compile`` of the same model
compiles only the kept candidate. ``plan.compiled`` records the choice, the ratios and
Inductor's own decision for the graph.

>>> import torch
>>> from torch import nn
>>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
>>> fast = compile(net, torch.randn(1, 3, 16, 16))  # doctest: +SKIP
>>> fast.plan.compiled.kept in ("planned", "inductor")  # doctest: +SKIP
True
"""

from __future__ import annotations

import copy
import hashlib
import json
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from memlayout.dtypes import autocast
from memlayout.errors import LayoutVerificationError
from memlayout.layout import Format
from memlayout.machine import Conditions
from memlayout.plan import guard as g
from memlayout.plan.capture import device_of
from memlayout.plan.compare import ModelComparison, busier
from memlayout.plan.costs import device_name
from memlayout.plan.module import OptimizedModule
from memlayout.plan.pipeline import example_inputs_of, open_cache, optimize
from memlayout.plan.records import Progress
from memlayout.plan.result import CompiledRecord
from memlayout.plan.verify import TOLERANCE, compare
from memlayout.tensors import convert_batch, convert_module
from memlayout.timing import device_sync, interleaved

PLANNED = "planned"  # the planned model, Inductor's layout optimization off: the plan stands
INDUCTOR = "inductor"  # the original model compiled with the settings given: Inductor decides
PLAN_STANDS = {"layout_optimization": False}


def compile(model: nn.Module, example_inputs: Any, *, dtype: str | torch.dtype | None = None,  # noqa: A001
            input_format: str | None = None, output_format: str | None = "keep",
            measure: bool = True, cache: Any = True, progress: Progress | None = None,
            name: str | None = None, rounds: int = 5, margin: float = 0.02,
            guard: bool = True, plan_kwargs: Mapping[str, Any] | None = None,
            **compile_kwargs: Any) -> OptimizedModule:
    """Plan ``model`` (``memlayout.optimize``), then compile it so the plan's strides reach the
    kernels (Inductor's ``layout_optimization`` off for that compile), or compile the original
    and let Inductor decide; ``plan.compiled`` says which. The plan is kept when it is faster
    than Inductor's own layout by more than ``margin`` (median of ``rounds`` interleaved
    per-round ratios), else the original compiled with the settings given: when in doubt, exactly what
    ``torch.compile`` gives.

    ``plan_kwargs`` go to ``memlayout.optimize`` as well (``memory=False``, ...;
    ``refresh=True`` also measures this planned-vs-Inductor decision again);
    ``compile_kwargs`` go to ``torch.compile`` (``backend``, ``mode``, ``options``, ``dynamic``,
    ...). With a backend other than Inductor there is no layout decision to override: the
    planned model is compiled with those settings and nothing is timed. The returned module is compiled in
    place (``nn.Module.compile``), so its ``state_dict`` keys are still the original model's.
    Its outputs are compared with the original's (dtype-aware); a candidate that differs is
    dropped, and ``LayoutVerificationError`` is raised when none is left.
    """
    start = time.perf_counter()
    optimized = optimize(model, example_inputs, dtype=dtype, input_format=input_format,
                         output_format=output_format, measure=measure, cache=cache,
                         progress=progress, name=name, guard=guard, **(plan_kwargs or {}))
    run_dtype = optimized.autocast_dtype
    plan = optimized.plan
    inputs = optimized.prepare_inputs(*example_inputs_of(example_inputs))
    options = _split_options(compile_kwargs)
    backend = compile_kwargs.get("backend", "inductor")
    record: dict[str, Any] = {"backend": backend if isinstance(backend, str) else repr(backend),
                              "settings": {PLANNED: dict(PLAN_STANDS), INDUCTOR: {}}}
    if backend != "inductor":
        optimized.compile(**compile_kwargs)
        plan.compiled = CompiledRecord.from_dict({
            **record, "kept": PLANNED, "source": "none",
            "reason": "not Inductor: no layout decision of its own to override"})
        return optimized

    reference = _reference(model, inputs, run_dtype)
    candidates: dict[str, Callable[[], nn.Module]] = {
        PLANNED: lambda: _compiled(optimized, {**compile_kwargs, "options": {**options, **PLAN_STANDS}}),
        INDUCTOR: lambda: _compiled(OptimizedModule(copy.deepcopy(model).eval(), plan, run_dtype),
                                    compile_kwargs),
    }
    decision = inductor_layout_decision(model, inputs, run_dtype)
    record["inductor_layout_opt"] = decision
    refresh = bool((plan_kwargs or {}).get("refresh", False))  # re-measure this decision too
    store = open_cache(cache, refresh=refresh) if measure else None
    key = _cache_key(model, inputs, run_dtype, plan, compile_kwargs)
    compiled: dict[str, Any] = {}
    try:
        cached = store.get(key, g.valid_record) if store is not None else None
        module = None
        if cached is not None:
            kept = _decide(cached, margin)
            try:
                module = candidates[kept]()
                compile_s = _check(module, inputs, run_dtype, reference, kept)
            except Exception:  # compiled differently this time: measure both again
                module = None
            else:
                compiled = {**record, **_describe(cached), "kept": kept, "source": "cache",
                            "errors": {}, "compile_seconds": {kept: compile_s},
                            "margin": margin}
        if module is None:
            module, compiled = _measure(candidates, inputs, run_dtype, reference,
                                        rounds=rounds, margin=margin, record=record,
                                        timed=measure)
            if store is not None and compiled.get("ratios") is not None:
                g.save(store, key, {"ratios": compiled["ratios"], "rounds": compiled["rounds"],
                                    "repeat": compiled.get("repeat", 1),
                                    "conditions": compiled.get("conditions"),
                                    "spread": compiled.get("spread")})
    finally:
        if store is not None:
            store.close()
    plan.compiled = CompiledRecord.from_dict({**compiled,
                                              "seconds": time.perf_counter() - start})
    assert isinstance(module, OptimizedModule)
    return module


def _measure(candidates: Mapping[str, Callable[[], nn.Module]], inputs: tuple[Any, ...],
             dtype: torch.dtype | None, reference: Any, *, rounds: int, margin: float,
             record: dict[str, Any], timed: bool) -> tuple[nn.Module, dict[str, Any]]:
    """Compile every candidate (first call), drop those that fail or compute something else,
    time the rest interleaved and keep the fastest."""
    built: dict[str, nn.Module] = {}
    errors: dict[str, str] = {}
    compile_s: dict[str, float] = {}
    for name, make in candidates.items():
        try:
            module = make()
            compile_s[name] = _check(module, inputs, dtype, reference, name)
        except LayoutVerificationError as exc:
            errors[name] = str(exc)
            continue
        except Exception as exc:  # a candidate Inductor cannot compile is a result, not a crash
            errors[name] = f"{type(exc).__name__}: {exc}"
            continue
        built[name] = module
        if not timed:
            break  # measure=False: the first candidate that works (the plan) is kept
    if not built:
        raise LayoutVerificationError(
            "neither the compiled plan nor the compiled original model reproduced the original "
            f"model's outputs ({'; '.join(f'{k}: {v}' for k, v in errors.items())}); nothing "
            "compiled was returned. Use memlayout.optimize without compiling")
    out: dict[str, Any] = {**record, "errors": errors, "compile_seconds": compile_s,
                           "margin": margin}
    if len(built) == 1 or not timed:
        kept = next(iter(built))
        return built[kept], {**out, "kept": kept, "source": "none", "candidates": {},
                             "rounds": 0}
    times = g.time_candidates({g.PLANNED: built[PLANNED], INDUCTOR: built[INDUCTOR]}, inputs,
                              dtype, device=device_of(inputs, built[PLANNED]), rounds=rounds)
    errors.update(times["errors"])
    kept = _decide(times, margin)
    return built[kept], {**out, **_describe(times), "kept": kept, "source": "measured",
                         "ratios": times["ratios"], "conditions": times["conditions"],
                         "spread": times["spread"]}


def _decide(record: Mapping[str, Any], margin: float) -> str:
    """``PLANNED`` when the median of the per-round ratios planned / inductor time is below
    ``1 - margin``, else ``INDUCTOR`` (a plain ``torch.compile``, the reference a user
    compares with, wins ties and noise).

    >>> _decide({"ratios": {"inductor": [0.95, 0.97, 0.96]}}, 0.02), _decide({"ratios": {"inductor": [0.99, 1.0, 0.985]}}, 0.02)
    ('planned', 'inductor')
    """
    ratios = record["ratios"].get(INDUCTOR)
    if not ratios:
        return PLANNED
    return PLANNED if statistics.median(ratios) < 1.0 - margin else INDUCTOR


def _describe(record: Mapping[str, Any]) -> dict[str, Any]:
    """Per candidate other than the plan: median, min, max of ``planned / candidate`` time."""
    return {"rounds": record["rounds"], "repeat": record.get("repeat", 1),
            "candidates": {name: {"median": statistics.median(r), "min": min(r), "max": max(r)}
                           for name, r in record["ratios"].items() if r}}


def _split_options(compile_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The Inductor options given; a ``mode`` becomes its options (torch.compile
    takes ``mode`` or ``options``, not both, and the plan's candidate needs ``options``)."""
    options = dict(compile_kwargs.get("options") or {})
    mode = compile_kwargs.get("mode")
    if mode not in (None, "default"):
        from torch._inductor import list_mode_options

        options = {**list_mode_options(mode), **options}
    return options


def _compiled(module: nn.Module, compile_kwargs: Mapping[str, Any]) -> nn.Module:
    """``module`` compiled in place (state_dict keys unchanged)."""
    kwargs = dict(compile_kwargs)
    if kwargs.get("options"):
        kwargs.pop("mode", None)
    module.compile(**kwargs)
    return module


def _reference(model: nn.Module, inputs: tuple[Any, ...], dtype: torch.dtype | None) -> Any:
    work = copy.deepcopy(model).eval()
    with torch.no_grad(), autocast(device_of(inputs, work), dtype):
        return work(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])


def _check(module: nn.Module, inputs: tuple[Any, ...], dtype: torch.dtype | None,
           reference: Any, name: str) -> float:
    """Call ``module`` once (the compile) and compare with ``reference``; the seconds taken."""
    start = time.perf_counter()
    with torch.no_grad():
        got = module(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
    seconds = time.perf_counter() - start
    ok, err, _ = compare(reference, got, dtype)
    if not ok:
        rtol = TOLERANCE.get(dtype or torch.float32, TOLERANCE[torch.float32])[0]
        raise LayoutVerificationError(
            f"the compiled {name} model's outputs differ from the original's by {err:.3g} "
            f"(relative; tolerance {rtol:g})")
    return seconds


def inductor_layout_decision(model: nn.Module, inputs: tuple[Any, ...],
                             dtype: torch.dtype | None = None) -> bool | None:
    """Inductor's own whole-graph decision for ``model`` on ``inputs`` under the current
    ``torch._inductor.config``: ``True`` when it would require channels-last for every 2-d
    convolution, ``False`` when not, ``None`` when this torch cannot say (the internal
    ``GraphLowering.decide_layout_opt`` is missing or the model cannot be traced to aten).

    >>> from torch import nn
    >>> inductor_layout_decision(nn.Sequential(nn.Linear(4, 4)), (torch.randn(2, 4),))
    False
    """
    try:
        from torch._inductor.graph import GraphLowering
        from torch.func import functional_call
        from torch.fx.experimental.proxy_tensor import make_fx

        decide = GraphLowering.decide_layout_opt
    except (ImportError, AttributeError):
        return None
    work = copy.deepcopy(model).eval()
    device = device_of(inputs, work)
    # weights as inputs, so the fake trace holds no real tensor and every node has meta["val"]
    state = {**dict(work.named_parameters()), **dict(work.named_buffers())}

    def run(weights: dict[str, torch.Tensor], *xs: Any) -> Any:
        with autocast(device, dtype):
            return functional_call(work, weights, xs)

    try:
        with torch.no_grad():
            gm = make_fx(run, tracing_mode="fake")(state, *inputs)
        return bool(decide(gm, is_inference=True))
    except Exception:  # an untraceable model or a changed internal: no answer, not a failure
        return None


def _cache_key(model: nn.Module, inputs: tuple[Any, ...], dtype: torch.dtype | None,
               plan: Any, compile_kwargs: Mapping[str, Any]) -> str:
    """The cost-cache key of one candidate comparison: device, torch version, dtype, and a hash
    of the model (structure, parameter shapes), the inputs, the plan and the settings."""
    h = hashlib.sha256()
    h.update(repr(model).encode())
    for pname, p in [*model.named_parameters(), *model.named_buffers()]:
        h.update(f"{pname}{list(p.shape)}{p.dtype}".encode())
    for x in inputs:
        if isinstance(x, torch.Tensor):
            h.update(f"{list(x.shape)}{list(x.stride())}{x.dtype}".encode())
    h.update(json.dumps([[n.region, n.name, n.op, n.format] for n in plan.nodes]).encode())
    h.update(json.dumps([[c.region, c.value, c.to] for c in plan.conversions]).encode())
    kept = plan.guard.kept if plan.guard is not None else None
    h.update(json.dumps([kept, plan.input_format, plan.output_format]).encode())
    h.update(json.dumps(compile_kwargs, sort_keys=True, default=repr).encode())
    device = device_of(inputs, model)
    return json.dumps(["compile", device_name(device), torch.__version__, str(dtype),
                       h.hexdigest()])


def compare_compiled(model: nn.Module, compiled: OptimizedModule, example_inputs: Any, *,
                     rounds: int = 7, warmup: int = 1,
                     **compile_kwargs: Any) -> ModelComparison:
    """Time ``compiled`` (from :func:`compile`) against ``torch.compile(model)`` with Inductor's
    defaults and eager NCHW, interleaved round by round, under the plan's autocast. Returns
    the ``Comparison`` and, per other mode, the per-round ratios ``other / compiled`` (> 1: the
    compiled plan is faster), their median and range."""

    inputs = example_inputs_of(example_inputs)
    dtype = compiled.autocast_dtype
    device = device_of(inputs, model)
    eager = convert_module(copy.deepcopy(model).eval(), Format.CONTIGUOUS)
    default = copy.deepcopy(model).eval()
    default.compile(**compile_kwargs)
    inputs = compiled.prepare_inputs(*inputs)

    def runner(module: nn.Module, fmt: Format | None) -> Callable[[], Any]:
        def run() -> Any:
            xs = inputs if fmt is None else convert_batch(inputs, fmt)
            with torch.no_grad(), autocast(device, dtype):
                return module(*xs)
        return run

    before = Conditions.now()
    c = interleaved({"memlayout.compile": runner(compiled, None),
                     "torch.compile": runner(default, None),
                     "eager_nchw": runner(eager, Format.CONTIGUOUS)},
                    rounds=rounds, warmup=warmup, baseline="memlayout.compile",
                    sync=device_sync(str(device)))
    return ModelComparison.of(c, "memlayout.compile", ("torch.compile", "eager_nchw"),
                              busier(before, Conditions.now()))


__all__ = ["INDUCTOR", "PLANNED", "compare_compiled", "compile", "inductor_layout_decision"]
