"""``memlayout.compile``: the fastest verified way to run a model for inference on this machine.

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

``compile`` builds whole-model candidates (each named by a ``Runner``, whose value the record
shows), checks each against the original's outputs, times those that agree interleaved round by
round, and keeps the fastest:

- ``planned``: the planned model, compiled with ``layout_optimization`` off (the plan stands);
- ``inductor``: the original model, compiled with the caller's settings (Inductor decides);
- ``inductor+freezing`` (inference): the same with ``torch._inductor.config.freezing``:
  parameters become constants, batch norms fold into convolutions, convolution weights are
  prepacked for oneDNN (``mkldnn._convolution_pointwise`` with fused activations). It measured
  faster on some models and slower on others here, so it is measured, not assumed;
- ``openvino``, ``onnxruntime``, ``mkldnn`` (inference on the CPU, where installed): the
  original model converted by ``memlayout.runtimes`` (``mkldnn``: PyTorch's own
  ``torch.utils.mkldnn.to_mkldnn``, for models whose every op has an mkldnn kernel). These run
  convolutions in blocked formats (``nChw16c``) that no strided layout expresses. bf16 is the
  runtime's own (weights cast once), not autocast; its outputs are compared at bf16 tolerance
  and the record says so.

``inductor`` is the default, what a plain ``torch.compile`` gives: another candidate replaces it
only when faster by more than a margin (``memlayout.timing.KEEP_MARGIN``, 2 %). Timing goes
through ``memlayout.plan.check.guard``'s timer (``memlayout.timing.interleaved``), after one
untimed call each (the compile). The race (``memlayout.timing.Race``) is cached (same SQLite
store as the costs) under the device, torch version, dtype, a signature of the model, the plan,
the compile settings and the runtimes asked for: a second ``compile`` of the same model builds
only the kept candidate. ``plan.compiled`` records the choice, the ratios,
each candidate's precision and build seconds, and why a candidate failed or was not built.

>>> import torch
>>> from torch import nn
>>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
>>> fast = compile(net, torch.randn(1, 3, 16, 16), runtimes=())  # doctest: +SKIP
>>> fast.plan.compiled.kept in ("planned+inductor", "inductor")  # doctest: +SKIP
True
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from memlayout import dtypes
from memlayout import runtimes as rt
from memlayout.devices import seam
from memlayout.dtypes import autocast
from memlayout.errors import LayoutVerificationError
from memlayout.layout import Format
from memlayout.machine import Conditions, busier
from memlayout.plan.check.guard import RACE, save, stored, time_candidates
from memlayout.plan.check.speed import ModelComparison
from memlayout.plan.compilers.backend_inner import PLAN_STANDS
from memlayout.plan.compilers.runtime_model import (
    Reference,
    RuntimeModule,
    check_candidate,
    precision_of,
    reference_outputs,
    runtimes_unavailable,
)
from memlayout.plan.costs.cache import CostCache
from memlayout.plan.costs.table import measured_on
from memlayout.plan.inputs import example_inputs_of
from memlayout.plan.options import Progress
from memlayout.plan.pipeline import open_cache, optimize
from memlayout.plan.report.plan import Plan
from memlayout.plan.report.records import CompiledRecord, RatioRange
from memlayout.plan.runners import Runner
from memlayout.plan.steer.steering import Steering, planned_state, steer
from memlayout.tensors import convert_batch, convert_module, device_of
from memlayout.timing import KEEP_MARGIN, Race, interleaved

FREEZING = {"freezing": True}
RUNTIMES: tuple[str, ...] = rt.ADAPTERS  # tried by default, where installed


def compile(model: nn.Module, example_inputs: Any, *, dtype: str | torch.dtype | None = None,  # noqa: A001
            input_format: str | None = None, output_format: str | None = "keep",
            measure: bool = True, cache: Any = True, progress: Progress | None = None,
            name: str | None = None, rounds: int = 5, margin: float = KEEP_MARGIN,
            guard: bool = True, plan_kwargs: Mapping[str, Any] | None = None,
            runtimes: Sequence[str] = RUNTIMES, freezing: bool = True,
            **compile_kwargs: Any) -> nn.Module:
    """Plan ``model`` (``memlayout.optimize``), build the candidates (the plan compiled so its
    strides reach the kernels, the original compiled with Inductor's own layout, and the peer
    ``runtimes``), keep the fastest that computes what the original does; ``plan.compiled``
    says which and why. ``inductor`` (exactly what ``torch.compile`` gives) is kept unless
    another candidate is faster than it by more than ``margin`` (medians of ``rounds``
    interleaved per-round ratios).

    ``freezing``: also the original compiled with Inductor's ``freezing`` (inference only).
    ``runtimes``: the blocked-format runtimes to try (``memlayout.runtimes.ADAPTERS``: OpenVINO,
    ONNX Runtime, mkldnn; those not installed are recorded as unavailable); ``()`` keeps to
    Inductor's strided models. They are candidates for inference on
    the CPU with one tensor input only: not for ``plan_kwargs={"train": True}``, a CUDA device,
    fp16, or several inputs (the record says so). ``plan_kwargs`` go to ``memlayout.optimize``
    (``memory=False``, ...; ``refresh=True`` also measures this decision again);
    ``compile_kwargs`` go to ``torch.compile`` (``backend``, ``mode``, ``options``, ``dynamic``,
    ...). With a backend other than Inductor there is no layout decision to override: the
    planned model is compiled with those settings and nothing is timed.

    The result is an ``nn.Module`` called with tensors; ``result.memlayout.prepare_inputs``
    gives the inputs in the format the kept candidate reads (``plan.compiled.input_format``);
    other inputs are converted per call. A PyTorch candidate is the planned model itself (the
    model's own class, its own forward, planned layouts: ``memlayout.optimize``'s result)
    compiled in place (``nn.Module.compile``): hooks, attributes and replaced submodules are
    seen, as Dynamo guards on them. A runtime winner (:class:`RuntimeModule`) runs no Python
    of the model: what it keeps, loads and refuses is on that class. A candidate whose outputs
    differ from the original's (dtype-aware) is dropped; ``LayoutVerificationError`` is
    raised when none is left.
    """
    start = time.perf_counter()
    optimized = optimize(model, example_inputs, dtype=dtype, input_format=input_format,
                         output_format=output_format, measure=measure, cache=cache,
                         progress=progress, name=name, guard=guard, **(plan_kwargs or {}))
    state = planned_state(optimized)
    run_dtype = state.dtype
    plan = state.plan
    inputs = state.prepare_inputs(*example_inputs_of(example_inputs))
    backend = compile_kwargs.get("backend", "inductor")
    train = bool((plan_kwargs or {}).get("train", False))
    settings: dict[str, dict[str, Any]] = {Runner.PLAN_COMPILED: dict(PLAN_STANDS), Runner.INDUCTOR_OWN: {}}
    if freezing and not train:
        settings[Runner.INDUCTOR_FROZEN] = dict(FREEZING)
    record: dict[str, Any] = {"backend": backend if isinstance(backend, str) else repr(backend),
                              "settings": settings}
    if backend != "inductor":
        optimized.compile(**compile_kwargs)
        _record(optimized, plan, CompiledRecord.from_dict({
            **record, "kept": Runner.PLAN_COMPILED, "source": "none", "input_format": plan.input_format,
            "reason": "not Inductor: no layout decision of its own to override"}))
        return optimized

    reference = reference_outputs(model, inputs, run_dtype)
    candidates = _candidates(model, optimized, inputs, run_dtype, settings, compile_kwargs)
    unavailable = runtimes_unavailable(runtimes, inputs, model, run_dtype, train)
    candidates.update({runtime: _runtime_candidate(model, plan, inputs[0], runtime, run_dtype)
                       for runtime in runtimes if runtime not in unavailable})
    precision = {name: precision_of(name, run_dtype) for name in candidates}
    decision = inductor_layout_decision(model, inputs, run_dtype)
    record.update(inductor_layout_opt=decision, unavailable=unavailable, precision=precision)
    refresh = bool((plan_kwargs or {}).get("refresh", False))  # re-measure this decision too
    store = open_cache(cache, refresh=refresh) if measure else None
    key = _cache_key(model, inputs, run_dtype, plan,
                     {**compile_kwargs, "candidates": _versions(candidates)})
    try:
        module, compiled = _kept(store, key, candidates, inputs, run_dtype, reference,
                                 rounds=rounds, margin=margin, record=record, timed=measure)
    finally:
        if store is not None:
            store.close()
    input_fmt = (module.input_format.value if isinstance(module, RuntimeModule)
                 else plan.input_format)
    _record(module, plan, CompiledRecord.from_dict({**compiled, "input_format": input_fmt,
                                                    "seconds": time.perf_counter() - start}))
    return module


def _candidates(model: nn.Module, optimized: nn.Module, inputs: tuple[Any, ...],
                dtype: torch.dtype | None, settings: Mapping[str, Mapping[str, Any]],
                compile_kwargs: Mapping[str, Any]) -> dict[str, Callable[[], nn.Module]]:
    """How to build each compiled candidate (built when called): the planned model with the
    plan standing, the original with Inductor's own layouts, and frozen where asked."""
    plan = planned_state(optimized).plan
    options = _split_options(compile_kwargs)
    candidates: dict[str, Callable[[], nn.Module]] = {
        Runner.PLAN_COMPILED: lambda: _compiled(optimized, {**compile_kwargs,
                                               "options": {**options, **PLAN_STANDS}}),
        Runner.INDUCTOR_OWN: lambda: _compiled(_unplanned(model, plan, dtype), compile_kwargs),
    }
    if Runner.INDUCTOR_FROZEN in settings:
        candidates[Runner.INDUCTOR_FROZEN] = lambda: _compiled(
            _unplanned(model, plan, dtype), {**compile_kwargs, "options": {**options, **FREEZING}})
    return candidates


def _runtime_candidate(model: nn.Module, plan: Plan, example: torch.Tensor, runtime: str,
                       dtype: torch.dtype | None) -> Callable[[], nn.Module]:
    """How to build ``runtime``'s candidate (built when called)."""
    return lambda: RuntimeModule(model, plan, example, rt.RuntimeOptions(runtime, dtype))


def _kept(store: CostCache | None, key: str, candidates: Mapping[str, Callable[[], nn.Module]],
          inputs: tuple[Any, ...], dtype: torch.dtype | None, reference: Reference, *, rounds: int,
          margin: float, record: Mapping[str, Any], timed: bool) -> tuple[nn.Module, dict[str, Any]]:
    """The candidate a cached decision keeps where it still builds and agrees; else every
    candidate built, checked and timed (``_measure``), and the decision written to ``store``."""
    module, compiled = _cached(store, key, candidates, inputs, dtype, reference, margin=margin,
                               record=record)
    if module is not None:
        return module, compiled
    module, compiled, race = _measure(candidates, inputs, dtype, reference, rounds=rounds,
                                      margin=margin, record=record, timed=timed)
    if store is not None and race is not None:
        save(store, key, race)
    return module, compiled


def _cached(store: CostCache | None, key: str, candidates: Mapping[str, Callable[[], nn.Module]],
            inputs: tuple[Any, ...], dtype: torch.dtype | None, reference: Reference, *,
            margin: float, record: Mapping[str, Any]) -> tuple[nn.Module | None, dict[str, Any]]:
    """The candidate a cached decision keeps, built and checked again, with its record;
    ``(None, {})`` where nothing is cached or it no longer builds or agrees."""
    cached = stored(store, key)
    if cached is None:
        return None, {}
    kept = cached.kept(Runner.INDUCTOR_OWN, margin)
    built_at = time.perf_counter()
    try:
        module = candidates[kept]()
        check_candidate(module, inputs, dtype, reference, kept)
    except Exception:  # built differently this time: measure every candidate again
        return None, {}
    return module, {**record, **_describe(cached), "kept": kept, "source": "cache", "errors": {},
                    "margin": margin, "compile_seconds": {kept: time.perf_counter() - built_at},
                    "precision": _precisions(record["precision"], {kept: module})}


def _unplanned(model: nn.Module, plan: Plan, dtype: torch.dtype | None) -> nn.Module:
    """A copy of the original model in eval mode, its layouts untouched, run under the plan's
    autocast, holding the plan (what Inductor decides layouts for on its own)."""
    work = copy.deepcopy(model).eval()
    steer(work, Steering(), key="compiled", input_label=None, outputs=(), plan=plan,
          dtype=dtype)
    return work


def _record(module: nn.Module, plan: Plan, record: CompiledRecord) -> None:
    """``module``'s plan, with the candidates' record."""
    kept = dataclasses.replace(plan, compiled=record)
    state = planned_state(module)
    if state is not None:
        state.plan = kept
    if "plan" not in dir(type(module)):
        module.__dict__["plan"] = kept


def _measure(candidates: Mapping[str, Callable[[], nn.Module]], inputs: tuple[Any, ...],
             dtype: torch.dtype | None, reference: Reference, *, rounds: int, margin: float,
             record: dict[str, Any], timed: bool
             ) -> tuple[nn.Module, dict[str, Any], Race | None]:
    """Build every candidate (its first call: the compile), drop those that fail or compute
    something else, time the rest interleaved and keep the fastest: ``inductor`` (a plain
    ``torch.compile``, the reference a user compares with, wins ties and noise) unless another
    is faster than it by more than ``margin``. Returns the race too (``None``: nothing timed)."""
    built: dict[str, nn.Module] = {}
    errors: dict[str, str] = {}
    unavailable = dict(record.get("unavailable", {}))
    compile_s: dict[str, float] = {}
    for name, make in candidates.items():
        start = time.perf_counter()
        try:
            module = make()
            check_candidate(module, inputs, dtype, reference, name)
        except rt.RuntimeUnavailable as exc:  # no kernels for this dtype here: not a failure
            unavailable[name] = str(exc)
            continue
        except LayoutVerificationError as exc:
            errors[name] = str(exc)
            continue
        except Exception as exc:  # a candidate that cannot be built is a result, not a crash
            errors[name] = f"{type(exc).__name__}: {exc}"
            continue
        compile_s[name] = time.perf_counter() - start  # conversion + compile + first call
        built[name] = module
        if not timed:
            break  # measure=False: the first candidate that works (the plan) is kept
    if not built:
        raise LayoutVerificationError(
            "no compiled candidate reproduced the original model's outputs "
            f"({'; '.join(f'{k}: {v}' for k, v in errors.items())}); nothing compiled was "
            "returned. Use memlayout.optimize without compiling")
    baseline = Runner.PLAN_COMPILED if Runner.PLAN_COMPILED in built else next(iter(built))
    out: dict[str, Any] = {**record, "errors": errors, "compile_seconds": compile_s,
                           "margin": margin, "baseline": baseline, "unavailable": unavailable,
                           "precision": _precisions(record["precision"], built)}
    if len(built) == 1 or not timed:
        kept = next(iter(built))
        return built[kept], {**out, "kept": kept, "source": "none", "candidates": {},
                             "rounds": 0}, None
    own = {n: _prepared(m, inputs) for n, m in built.items()}
    race = time_candidates(built, inputs, dtype, device=device_of(inputs, built[baseline]),
                           rounds=rounds, inputs_of=own, reference=baseline)
    errors.update(race.errors)
    kept = race.kept(Runner.INDUCTOR_OWN, margin)
    return built[kept], {**out, **_describe(race), "kept": kept, "source": "measured"}, race


def _prepared(module: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """``inputs`` as ``module`` reads them without a copy."""
    state = planned_state(module)
    return state.prepare_inputs(*inputs) if state is not None else inputs


def _describe(race: Race) -> dict[str, Any]:
    """The race's part of the record (``CompiledRecord``'s JSON form): per candidate other
    than the baseline, median, min, max of ``baseline / candidate`` time."""
    return {"rounds": race.rounds, "repeat": race.repeat, "baseline": race.reference,
            "candidates": {name: dataclasses.asdict(RatioRange.of(r))
                           for name, r in race.ratios.items()}}










def _versions(candidates: Mapping[str, Any]) -> dict[str, str]:
    """Every candidate with its runtime's version and settings (a cached decision is for
    these; torch's own version is in the key already)."""
    import importlib.metadata as md

    out = {}
    for name in candidates:
        try:
            version = md.version(name) if name in rt.RUNTIMES else ""  # mkldnn: torch's
        except md.PackageNotFoundError:
            version = ""
        out[name] = " ".join(v for v in (version, rt.SETTINGS.get(name, "")) if v)
    return out


def _precisions(guessed: Mapping[str, str], built: Mapping[str, nn.Module]) -> dict[str, str]:
    """Each candidate's precision: a built runtime's own words, else what was expected."""
    return {**guessed, **{n: m.runtime.precision for n, m in built.items()
                          if isinstance(m, RuntimeModule)}}


def _split_options(compile_kwargs: Mapping[str, Any]) -> dict[str, Any]:
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
    return json.dumps(["compile", RACE, measured_on(device), torch.__version__, str(dtype),
                       h.hexdigest()])


def compare_compiled(model: nn.Module, compiled: nn.Module, example_inputs: Any, *,
                     rounds: int = 7, warmup: int = 1,
                     **compile_kwargs: Any) -> ModelComparison:
    """Time ``compiled`` (from :func:`compile`) against ``torch.compile(model)`` with Inductor's
    defaults and eager NCHW, interleaved round by round, under the plan's autocast. Returns
    the ``Comparison`` and, per other mode, the per-round ratios ``other / compiled`` (> 1: the
    compiled plan is faster), their median and range."""

    inputs = example_inputs_of(example_inputs)
    dtype = compiled.plan.dtype and dtypes.parse_dtype(compiled.plan.dtype)
    device = device_of(inputs, model)
    eager = convert_module(copy.deepcopy(model).eval(), Format.CONTIGUOUS)
    default = copy.deepcopy(model).eval()
    default.compile(**compile_kwargs)
    inputs = _prepared(compiled, inputs) if not isinstance(compiled, RuntimeModule) \
        else compiled.prepare_inputs(*inputs)

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
                    sync=seam(device).synchronize)
    return ModelComparison.of(c, "memlayout.compile", ("torch.compile", "eager_nchw"),
                              busier(before, Conditions.now()))


__all__ = ["RUNTIMES", "RuntimeModule", "Runner", "compare_compiled",
           "compile", "inductor_layout_decision"]
