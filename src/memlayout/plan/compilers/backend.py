"""``torch.compile(model, backend="memlayout")``: every graph Dynamo hands over is planned from
measured costs and compiled by Inductor with the plan standing.

Each graph (a graph break makes several; each is planned on its own) goes through:

1. real inputs: the example's own tensors (Dynamo passes the model's parameters, buffers and
   inputs), a tensor made from the metadata of a fake one, and a dynamic size's hint;
2. the planner's analysis on the graph: ``propagate`` (shapes, strides and formats in node
   meta), ``mark_spatial`` (which values are layout variables), ``measure_costs`` (each
   layout node in both formats; in training, when grad mode is on and an input requires
   grad, forward plus backward per node, a conversion its copy both ways), the exact min cut,
   and ``rewrite`` (the fewest explicit conversions);
3. the rewritten graph compiled by Inductor (``compile_fx``) with ``layout_optimization`` off,
   so Inductor's whole-graph rule (``GraphLowering.decide_layout_opt``) never overrides a
   measured choice: each convolution keeps the strides the rewritten graph gives it
   (``constrain_to_fx_strides``); AOTAutograd derives the backward of the rewritten forward;
4. verification, once, against the graph run eagerly: outputs, inputs changed in place
   (running statistics) and, in training, the gradient of every input that requires grad,
   within the dtype's tolerance (``memlayout.plan.compare``); where only rounding
   differs the rewrite is re-checked in float64 (the graph's own casts to float32 made
   float64 casts: ``memlayout.plan.compare.widen``). A graph that draws random numbers (dropout
   in training) is checked as the planned graph against the original, both eager with their
   dropouts off (a mask depends on the layout it is drawn in, and Inductor's random stream is
   not eager's). A mismatch drops the plan: the graph is compiled by Inductor with its own
   layouts, with a :class:`BackendWarning`. A passing verdict is kept in the cost cache
   (keyed by the graph's code, the rewrite's, the inputs' shapes, strides and dtypes, how the
   plan runs, and torch): the same graph planned the same way is not run again, and its
   record says "verified before";
5. ``guard``: the compiled plan timed, interleaved (a training step: forward, and backward
   into ``.grad``, so a weight gradient the plan leaves channels-last pays its copy into the
   parameter's strides, as in training),
   against the planned graph run eagerly and against the graph compiled by Inductor with
   its own layouts (what ``torch.compile`` alone runs); another runs only where it is
   faster by more than ``GUARD_MARGIN``, and a close call is timed twice as long
   (``memlayout.plan.check.guard``). So a measured plan that loses as a whole graph never
   costs the user Inductor's speed. The decision is cached with the costs, and a graph
   decided before builds only the way that runs (the plan is neither compiled nor verified
   where Inductor's own was kept; where the eager plan was, that is what is verified).
   Inductor's rule for the report (``inductor_rule``, a trace to aten) is cached the same way.

Parameters are graph inputs here (Dynamo lifts them), so a weight planned in another format
than it is stored in is converted on every call, and in training its gradient is converted
back: the costs count both, as Inductor's own channels-last pays a copy per call without
freezing. A model stored channels-last (``model.to(memory_format=torch.channels_last)``)
hands its weights over channels-last, and the plan starts from there.

In training, a parameter with a size-1 dim (a 1x1 convolution's weight) gets its gradient
in its own exact strides, in every graph the backend compiles (``grad_in_strides``: a view
of the gradient where only a size-1 dim's stride differs): autograd's layout contract
ignores those strides, DDP's gradient buckets compare them.
Under DDP (``torch._dynamo.config.optimize_ddp``), Dynamo's graph is split at the gradient
buckets and each split graph is planned, verified and guarded on its own; the next split is
given the fake outputs of the previous one's compiled function, in its strides.

Under ``torch.distributed`` (DDP, FSDP2: an initialized process group), one plan per job:
the lowest rank of each device kind (rank 0 on a machine of one kind) measures, solves,
verifies and guards each graph, and every other rank rebuilds its plan from the costs and
labels it sends and runs it as it ran there, measuring nothing
(``memlayout.plan.compilers.backend_shared``). A rank that cannot take the plan (its graph
differs, the exchange fails) says so in a warning and runs Inductor's own layouts. Each
record names the rank that decided and the plan's digest, equal on ranks that run the same
program.

Dynamic shapes (``dynamic=True``, ``mark_dynamic``): the graph is planned at the example's
sizes (the size hints) and that plan serves every size the graph is reused for; a
recompile for another size bucket is planned again at its own example. (Inductor's own
rule keeps its layout optimization on for dynamic graphs on the CPU: the mkldnn rule comes
before its dynamic-shape exception.) Recompiles and guards stay Dynamo's.

>>> import torch
>>> from torch import nn
>>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
>>> fast = torch.compile(net, backend=Backend(inner="eager", guard=False))  # doctest: +SKIP
>>> fast(torch.randn(2, 3, 16, 16)).shape  # doctest: +SKIP
torch.Size([2, 8, 14, 14])
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch._dynamo.exc
import torch._functorch.config
from torch import fx, nn

from memlayout.devices import seam
from memlayout.dtypes import autocast, dtype_name, parse_dtype
from memlayout.errors import MemlayoutError, PlanError, first_line
from memlayout.plan.capture.regions import propagate
from memlayout.plan.check import guard
from memlayout.plan.compilers.backend_check import (
    GraphCheck,
    cached_guard,
    graph_signature,
    guard_graph,
    verify_graph,
    verify_once,
)
from memlayout.plan.compilers.backend_graphs import (
    NotPlanned,
    converted_weights,
    copy_graph,
    fresh_inputs,
    grads_in_parameter_strides,
    is_dynamic,
    mutated_aliases,
    op_name,
    real_inputs,
    refuse_module_state,
)
from memlayout.plan.compilers.backend_report import (
    AS_GIVEN,
    COMPILED,
    EAGER,
    GUARD_MARGIN,
    INDUCTOR_OWN,
    RECORDS,
    ConvolutionChoice,
    GraphRecord,
    convolution_choices,
)
from memlayout.plan.compilers.backend_shared import (
    Decision,
    ExchangeFailed,
    Job,
    exchange,
    job_of,
    plan_digest,
)
from memlayout.plan.convert import convert_value, convert_value_1d
from memlayout.plan.costs.cache import CostCache
from memlayout.plan.costs.measure import measure_costs
from memlayout.plan.costs.table import CostTable, measured_on
from memlayout.plan.graph import BASE_RANKS, CONV1D_RANKS, LABELS, META_KEY, Label, Request
from memlayout.plan.solve.formulate import formulate
from memlayout.plan.solve.regions import solve_labels
from memlayout.plan.steer.rewrite import rewrite
from memlayout.spatial import mark_spatial
from memlayout.tensors import device_of, to_dense

INNER_COMPILERS = ("inductor", "eager")
PLAN_STANDS = {"layout_optimization": False}

#: Dynamo's control flow (trace again, skip the frame): raised through, never a failure
_DYNAMO_SIGNALS = (torch._dynamo.exc.RestartAnalysis, torch._dynamo.exc.SkipFrame)


class BackendWarning(RuntimeWarning):
    """A graph the backend could not plan, or whose plan it dropped (it computed other
    values); the graph still compiles, with Inductor's own layouts."""


@dataclass(frozen=True)
class Backend:
    """The ``memlayout`` Dynamo backend and its options; an instance is the backend:
    ``torch.compile(model, backend=memlayout.backend(inner="eager"))``; the name
    ``backend="memlayout"`` is ``Backend()``. ``torch.compile(..., options={...})`` sets these
    fields too.

    ``cache``: the cost cache (``True``: the user's, a path, ``False``: none); ``measure``:
    time the costs (``False``: the analytical model, no guard); ``rounds``: interleaved rounds
    per measurement; ``dtype``: the autocast dtype the graphs run under (``None``: the
    autocast active when Dynamo compiles, as ``torch.compile`` does; ``"fp32"``: none);
    ``inner``: ``"inductor"`` or ``"eager"`` (the planned graph runs eagerly); ``guard``: time
    the compiled plan against the plan run eagerly and against Inductor's own layouts, and
    keep the fastest (``False``: the compiled plan, untimed); ``mode``: Inductor's
    ``mode`` (``"max-autotune"``, ``"reduce-overhead"``: CUDA graphs, ...); ``inductor``:
    Inductor config options (``torch.compile(..., options=...)`` names that are not
    memlayout's) for every graph Inductor compiles, the plan's and Inductor's own alike;
    ``shared_plan``: under an initialized ``torch.distributed`` process group, one rank per
    device kind measures and decides each graph and every other rank compiles its plan
    (``memlayout.plan.compilers.backend_shared``); every rank must then compile the same
    graphs with the same options, or the others wait for it. ``None`` (the default): shared
    where every rank compiles the graph by construction, the split graphs of DDP's optimizer;
    ``True``: every graph (FSDP, or a model compiled on every rank alike); ``False``: each rank
    plans alone (a model compiled on some ranks only, an evaluation on rank 0)."""

    cache: bool | str | Path = True
    measure: bool = True
    rounds: int = 5
    dtype: str | torch.dtype | None = None
    inner: str = "inductor"
    guard: bool = True
    mode: str | None = None
    inductor: tuple[tuple[str, Any], ...] = ()
    shared_plan: bool | None = None

    def __post_init__(self) -> None:
        if self.inner not in INNER_COMPILERS:
            raise PlanError(f"memlayout backend: inner={self.inner!r}; expected one of "
                            f"{', '.join(INNER_COMPILERS)} (the compiler that runs each "
                            "planned graph)")
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
            raise PlanError(f"memlayout backend: rounds={self.rounds!r}; expected an int >= 1")
        if self.dtype is not None:
            parse_dtype(self.dtype)  # DtypeError names the choices
        unknown = [k for k, _ in self.inductor if not _inductor_option(k)]
        if unknown:
            raise PlanError(f"memlayout backend: options {unknown} are neither memlayout's "
                            f"({', '.join(f.name for f in dataclasses.fields(self))}) nor "
                            "Inductor's (torch._inductor.config)")

    @property
    def compiled_as(self) -> str:
        """How graphs are compiled, a part of every decision's cache key (a guard decided
        under CUDA graphs says nothing of a default compile)."""
        if self.inner == "eager":
            return "eager"
        options = ",".join(f"{k}={v!r}" for k, v in sorted(self.inductor))
        return f"inductor mode={self.mode or 'default'}" + (f" {options}" if options else "")

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any], *,
                 options: Mapping[str, Any] | None = None,
                 mode: str | None = None) -> Callable[..., Any]:
        """Plan and compile one graph (Dynamo calls this); ``options`` and ``mode`` are what
        ``torch.compile(..., options=..., mode=...)`` passes on."""
        chosen = self
        if options or mode:
            fields = {f.name for f in dataclasses.fields(self)} - {"inductor"}
            ours = {k: v for k, v in (options or {}).items() if k in fields}
            theirs = {k: v for k, v in (options or {}).items() if k not in fields}
            chosen = dataclasses.replace(
                self, **ours, **({"mode": mode} if mode else {}),
                inductor=tuple(sorted({**dict(self.inductor), **theirs}.items())))
        return compile_graph(gm, list(example_inputs), chosen)

    def run_dtype(self, device: torch.device) -> torch.dtype | None:
        """The autocast dtype graphs on ``device`` run under (``dtype``, else the one active)."""
        if self.dtype is not None:
            return parse_dtype(self.dtype)
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return None


def memlayout_backend(gm: fx.GraphModule, example_inputs: list[Any],
                      **kwargs: Any) -> Callable[..., Any]:
    """The backend ``torch.compile(model, backend="memlayout")`` names (the entry point):
    ``Backend()``. A function, not the instance: older torch's registry (2.11) sets an
    attribute (``_tags``) on what an entry point names, which a frozen instance refuses."""
    return Backend()(gm, example_inputs, **kwargs)


@dataclass(frozen=True)
class _Planned:
    """A graph's plan: the rewritten copy, its costs, the conversions made, each
    convolution's choice, the weights converted on every call (name, bytes) and the solved
    labels (node name -> label)."""

    graph: fx.GraphModule
    table: CostTable
    conversions: int
    convolutions: tuple[ConvolutionChoice, ...]
    weights: tuple[tuple[str, int], ...] = ()
    labels: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class _Compiled:
    """One graph compiled: what Dynamo runs, its record (not yet in the report), and the
    plan that runs with its rewritten graph's signature (``None``: no plan runs, Inductor's
    own layouts or the graph as given)."""

    fn: Callable[..., Any]
    record: GraphRecord
    plan: _Planned | None = None
    planned_signature: str = ""

    def digest(self, signature: str) -> str:
        labels = dict(self.plan.labels) if self.plan is not None else {}
        return plan_digest(signature, labels, self.record.ran, self.planned_signature)


def compile_graph(gm: fx.GraphModule, example_inputs: list[Any],
                  options: Backend) -> Callable[..., Any]:
    """Plan ``gm`` (one of Dynamo's graphs, ``example_inputs`` as Dynamo gives them) and
    compile it with ``options.inner``; record the decision in ``memlayout.backend_report()``.
    The caller's random number generators are left as they were (planning runs the graph).
    The cost cache (``options.cache``) is opened once for the graph: its costs, Inductor's
    rule, the verdict and the guard's decision are all read and written there.

    Under an initialized ``torch.distributed`` process group (``options.shared_plan``), one
    rank per device kind decides and every other rank compiles its plan without measuring
    (``memlayout.plan.compilers.backend_shared``); a rank that cannot take it warns and
    compiles the graph with Inductor's own layouts."""
    inputs = real_inputs(example_inputs)
    device = device_of(inputs)
    with seam(device).fork_rng():
        try:
            shared = _ddp_split() if options.shared_plan is None else options.shared_plan
            job = job_of(device) if shared else None
        except ExchangeFailed as exc:
            return _without_plan(gm, example_inputs, inputs, device, options, exc.rank,
                                 str(exc))
        if job is not None and not job.decides:
            return _follow(gm, example_inputs, inputs, device, options, job)
        return _decide(gm, example_inputs, inputs, device, options, job)


def _decide(gm: fx.GraphModule, example_inputs: list[Any], inputs: list[Any],
            device: torch.device, options: Backend, job: Job | None) -> Callable[..., Any]:
    """Plan and compile ``gm`` here, and hand the decision to the other ranks of ``job``
    (none: this process alone). A decision that cannot be handed on is not run here either:
    every rank then runs Inductor's own layouts."""
    signature = graph_signature(gm, inputs)
    store = _open_cache(options.cache)
    try:
        made = _compile_graph(gm, example_inputs, inputs, device, options, store)
    except Exception as exc:  # the other ranks wait for a decision: they hear of this one
        if job is not None:
            signal = type(exc).__name__ if isinstance(exc, _DYNAMO_SIGNALS) else ""
            with contextlib.suppress(ExchangeFailed):
                exchange(job, Decision(signature, None, compiled_as=options.compiled_as,
                                       signal=signal))
        raise
    finally:
        if store is not None:
            store.close()
    digest = made.digest(signature)
    if job is None:
        RECORDS.add(dataclasses.replace(made.record, digest=digest))
        return made.fn
    plan = made.plan
    decision = Decision(signature, made.record, options.compiled_as,
                        plan.table if plan is not None else None,
                        plan.labels if plan is not None else (), made.planned_signature)
    try:
        exchange(job, decision)
    except ExchangeFailed as exc:
        return _without_plan(gm, example_inputs, inputs, device, options, job.rank,
                             f"its decision could not be shared: {exc}")
    RECORDS.add(dataclasses.replace(made.record, rank=job.rank, decided_by=job.rank,
                                    digest=digest))
    return made.fn


def _follow(gm: fx.GraphModule, example_inputs: list[Any], inputs: list[Any],
            device: torch.device, options: Backend, job: Job) -> Callable[..., Any]:
    """``gm`` compiled as ``job``'s deciding rank decided it, nothing measured here; where
    that decision cannot be taken, Inductor's own layouts with a warning. The deciding
    rank's failure is raised here too (a Dynamo signal as that signal), so that every rank's
    compiles stay in step."""
    signature = graph_signature(gm, inputs)
    graph = _graph_id(gm)
    try:
        decision = exchange(job, None)
    except ExchangeFailed as exc:
        return _without_plan(gm, example_inputs, inputs, device, options, job.rank,
                             f"rank {job.decider}'s decision did not arrive: {exc}")
    if decision.record is None:
        signals = {cls.__name__: cls for cls in _DYNAMO_SIGNALS}
        if decision.signal in signals:
            raise signals[decision.signal](f"rank {job.decider} raised it compiling graph {graph}")
        raise PlanError(f"memlayout backend: rank {job.decider} failed to compile graph "
                        f"{graph} (its error says why); rank {job.rank} stops with it")
    problem = _untakeable(decision, signature, options, inputs, device)
    made = None
    if problem is None:
        try:
            made = _taken(decision, gm, example_inputs, inputs, device, options)
        except _DYNAMO_SIGNALS:
            raise
        except Exception as exc:
            problem = (f"rebuilding its plan failed ({type(exc).__name__}: "
                       f"{first_line(exc)})")
        if made is None and problem is None:
            problem = "the plan rebuilt here differs from the one it verified"
    if made is None:
        return _without_plan(gm, example_inputs, inputs, device, options, job.rank,
                             f"rank {job.decider}'s plan cannot be taken: {problem}")
    RECORDS.add(dataclasses.replace(made.record, rank=job.rank, decided_by=job.decider,
                                    digest=made.digest(signature)))
    return made.fn


def _untakeable(decision: Decision, signature: str, options: Backend, inputs: list[Any],
                device: torch.device) -> str | None:
    """Why this rank cannot take ``decision`` (its graph, or how it runs, differs), else
    ``None``."""
    record = decision.record
    assert record is not None
    if decision.signature != signature:
        return "the graph differs (its code, or its inputs' shapes, strides or dtypes)"
    if decision.compiled_as != options.compiled_as:
        return (f"the backend's options differ (compiled as {decision.compiled_as!r} there, "
                f"{options.compiled_as!r} here)")
    dtype = dtype_name(options.run_dtype(device))
    if (record.train, record.dtype) != (_training(inputs), dtype):
        return (f"the graph runs otherwise ({'train' if record.train else 'infer'}, "
                f"{record.dtype} there; {'train' if _training(inputs) else 'infer'}, {dtype} "
                "here)")
    return None


def _taken(decision: Decision, gm: fx.GraphModule, example_inputs: list[Any],
           inputs: list[Any], device: torch.device, options: Backend) -> _Compiled | None:
    """``decision`` built here: a plan that runs rebuilt from the deciding rank's costs and
    labels (``plan_graph``, nothing measured) and run as it ran there, else the graph as
    Inductor compiles it with its own layouts. ``None`` where the rebuilt graph is not the
    one the deciding rank verified."""
    start = time.perf_counter()
    record = decision.record
    assert record is not None
    train, dtype = _training(inputs), options.run_dtype(device)
    mine = {"graph": _graph_id(gm), "measured": 0, "cached": 0}
    if decision.table is None:  # Inductor's own layouts, or the graph as given
        given = _as_given(gm, example_inputs, train=train)
        fn, ran = _unplanned(given, example_inputs, options, dtype, device)
        return _Compiled(fn, dataclasses.replace(
            record, **mine, ran=ran, plan_seconds=0.0,
            compile_seconds=time.perf_counter() - start))
    planned = plan_graph(gm, inputs, options, train=train, dtype=dtype, device=device,
                         rule=record.inductor_rule,
                         decided=(decision.table, dict(decision.labels)))
    eager_graph = copy_graph(planned.graph)  # compile_fx may change the graph it is given
    planned_signature = graph_signature(eager_graph, inputs)
    if planned_signature != decision.planned_signature:
        return None
    plan_seconds = time.perf_counter() - start
    if record.ran == COMPILED:
        fn = _inner(planned.graph, example_inputs, options, dtype, device)
    else:
        fn = _eager(eager_graph, options, device)
    return _Compiled(fn, dataclasses.replace(
        record, **mine, plan_seconds=plan_seconds,
        compile_seconds=time.perf_counter() - start - plan_seconds), planned, planned_signature)


def _without_plan(gm: fx.GraphModule, example_inputs: list[Any], inputs: list[Any],
                  device: torch.device, options: Backend, rank: int,
                  problem: str) -> Callable[..., Any]:
    """``gm`` compiled by Inductor with its own layouts (or as given, ``inner="eager"``) on a
    rank that has no shared plan for it, never a plan of its own; a warning naming the rank,
    the graph and why."""
    start = time.perf_counter()
    graph = _graph_id(gm)
    warnings.warn(f"memlayout backend: rank {rank}, graph {graph}: {problem}; the graph is "
                  "compiled with Inductor's own layouts", BackendWarning, stacklevel=3)
    train, dtype = _training(inputs), options.run_dtype(device)
    given = _as_given(gm, example_inputs, train=train)
    fn, ran = _unplanned(given, example_inputs, options, dtype, device)
    RECORDS.add(GraphRecord(graph, train, dtype_name(dtype), is_dynamic(gm), planned=False,
                            ran=ran, reason=f"no shared plan: {problem}",
                            compile_seconds=time.perf_counter() - start, rank=rank,
                            digest=plan_digest(graph_signature(gm, inputs), {}, ran)))
    return fn


def _graph_id(gm: fx.GraphModule) -> str:
    """Dynamo's compile id of ``gm`` (``frame/recompile``)."""
    return str(gm.meta.get("dynamo_compile_id", "?"))


def _training(inputs: list[Any]) -> bool:
    """A graph is compiled for training when grad mode is on and an input requires grad."""
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)


def _compile_graph(gm: fx.GraphModule, example_inputs: list[Any], inputs: list[Any],
                   device: torch.device, options: Backend,
                   store: CostCache | None) -> _Compiled:
    start = time.perf_counter()
    train = _training(inputs)
    dtype = options.run_dtype(device)
    head = {"graph": _graph_id(gm), "train": train,
            "dtype": dtype_name(dtype), "dynamic": is_dynamic(gm)}
    rule = _rule(gm, example_inputs, inputs, store, dtype=dtype, train=train, device=device)
    given = _as_given(gm, example_inputs, train=train)  # what runs without a plan
    try:
        planned = plan_graph(gm, inputs, options, train=train, dtype=dtype, device=device,
                             rule=rule, store=store)
    except _DYNAMO_SIGNALS:
        raise
    except NotPlanned as exc:
        fn, ran = _unplanned(given, example_inputs, options, dtype, device)
        return _Compiled(fn, GraphRecord(**head, planned=False, ran=ran, reason=str(exc),
                                         inductor_rule=rule,
                                         plan_seconds=time.perf_counter() - start))
    except Exception as exc:  # the planner must never stop a compile: Inductor's own instead
        warnings.warn(f"memlayout backend: graph {head['graph']} could not be planned "
                      f"({type(exc).__name__}: {first_line(exc)}); it is compiled with "
                      "Inductor's own layouts", BackendWarning, stacklevel=2)
        fn, ran = _unplanned(given, example_inputs, options, dtype, device)
        return _Compiled(fn, GraphRecord(**head, planned=False, ran=ran,
                                         reason=f"planning failed: {type(exc).__name__}",
                                         inductor_rule=rule,
                                         plan_seconds=time.perf_counter() - start))
    plan_seconds = time.perf_counter() - start
    eager_graph = copy_graph(planned.graph)  # compile_fx may change the graph it is given
    record = {**head, "planned": True, "inductor_rule": rule,
              "convolutions": planned.convolutions, "conversions": planned.conversions,
              "converted_weights": planned.weights,
              "measured": planned.table.measured, "cached": planned.table.cached,
              "plan_seconds": plan_seconds}
    # the guard decided this graph before (the cost cache): build only what will run
    known = _known_decision(eager_graph, inputs, options, store, train=train, dtype=dtype,
                            device=device)
    kept = guard.decide(known, margin=GUARD_MARGIN) if known is not None else None
    if kept == INDUCTOR_OWN:  # what torch.compile alone runs: the plan is not built
        fn = _unplanned(given, example_inputs, options, dtype, device)[0]
        return _Compiled(fn, GraphRecord(
            **record, ran=INDUCTOR_OWN, timed=_timed(known),
            verification="the plan not run (Inductor's own layouts kept, as timed before)",
            compile_seconds=time.perf_counter() - start - plan_seconds))
    compiled = options.inner != "eager" and kept != EAGER
    try:
        fn = (_inner(planned.graph, example_inputs, options, dtype, device) if compiled
              else _eager(eager_graph, options, device))
        check = verify_once(gm, eager_graph, fn, inputs, store=store, train=train, dtype=dtype,
                            device=device, compiled=compiled,
                            way=options.compiled_as if compiled else EAGER)
    except _DYNAMO_SIGNALS:
        raise
    except Exception as exc:  # the plan does not compile or run: Inductor's own instead
        check = GraphCheck(False, f"compiling the plan failed ({type(exc).__name__}: "
                       f"{first_line(exc)})", None)
    compile_seconds = time.perf_counter() - start - plan_seconds
    if not check.ok:
        return _dropped(given, example_inputs, options, dtype, device, check, record,
                        compile_seconds)
    ran, timed = (EAGER if options.inner == "eager" else COMPILED), ()
    if kept is not None:
        ran, timed = (EAGER if kept == EAGER else COMPILED), _timed(known)
    elif ran == COMPILED and options.guard and options.measure:
        fn, ran, timed = _fastest(fn, given, eager_graph, example_inputs, inputs, options,
                                  store, train=train, dtype=dtype, device=device)
    runs = ran in (COMPILED, EAGER)
    return _Compiled(fn, GraphRecord(**record, ran=ran, verification=check.how,
                                     max_error=check.error, timed=timed,
                                     compile_seconds=time.perf_counter() - start - plan_seconds),
                     planned if runs else None,
                     graph_signature(eager_graph, inputs) if runs else "")


def _dropped(gm: fx.GraphModule, example_inputs: list[Any], options: Backend,
             dtype: torch.dtype | None, device: torch.device, check: GraphCheck,
             record: dict[str, Any], compile_seconds: float) -> _Compiled:
    """A plan that failed verification (or did not compile): the graph as Inductor compiles
    it with its own layouts, a warning, and the record saying why."""
    problem = check.how + ("" if check.error is None else f": relative error {check.error:.3g}")
    warnings.warn(f"memlayout backend: the plan of graph {record['graph']} was dropped "
                  f"({problem}); the graph is compiled with Inductor's own layouts instead. "
                  "Please report this with the model", BackendWarning, stacklevel=3)
    fn, ran = _unplanned(gm, example_inputs, options, dtype, device)
    return _Compiled(fn, GraphRecord(**record, ran=ran, verification=check.how,
                                     max_error=check.error, fallback=problem,
                                     compile_seconds=compile_seconds))


#: the ways the guard times a planned graph: the compiled plan, the plan eagerly, Inductor's own
WAYS = [guard.PLANNED, EAGER, INDUCTOR_OWN]


def _known_decision(eager_graph: fx.GraphModule, inputs: list[Any], options: Backend,
                    store: CostCache | None, *, train: bool, dtype: torch.dtype | None,
                    device: torch.device) -> dict[str, Any] | None:
    """The guard's cached record for this planned graph, if the guard runs and one stands."""
    if options.inner == "eager" or not (options.guard and options.measure) or store is None:
        return None
    return cached_guard(WAYS, eager_graph, inputs, store=store, margin=GUARD_MARGIN,
                        train=train, dtype=dtype, device=device,
                        compiled_as=options.compiled_as)


def _timed(record: Mapping[str, Any]) -> tuple[tuple[str, float], ...]:
    """Each other way's median ratio in a guard record (the compiled plan's time over its)."""
    return tuple((name, statistics.median(r)) for name, r in record["ratios"].items() if r)


def _fastest(fn: Callable[..., Any], gm: fx.GraphModule, eager_graph: fx.GraphModule,
             example_inputs: list[Any], inputs: list[Any], options: Backend,
             store: CostCache | None, *,
             train: bool, dtype: torch.dtype | None,
             device: torch.device) -> tuple[Callable[..., Any], str, tuple[tuple[str, float], ...]]:
    """The fastest way to run a verified plan's graph, timed interleaved (``guard_graph``):
    the plan compiled (``fn``, kept unless another is faster by more than ``GUARD_MARGIN``),
    the plan run eagerly, and ``gm`` compiled by Inductor with its own layouts: what
    ``torch.compile`` alone would run. That one is timed even where every convolution's
    planned format is the one Inductor's rule gives it: the layouts between them (attention,
    normalization, conversions) differ too, and can cost more than the convolutions save.
    Returns the function, what runs it and each other way's median ratio (the compiled
    plan's time over its)."""
    made: dict[str, Callable[..., Any]] = {}

    def own() -> Callable[..., Any]:
        if INDUCTOR_OWN not in made:
            made[INDUCTOR_OWN] = _unplanned(gm, example_inputs, options, dtype, device,
                                            backward_now=True)[0]  # timed here
        return made[INDUCTOR_OWN]

    makers: dict[str, Callable[[], Callable[..., Any]]] = {
        guard.PLANNED: lambda: fn, EAGER: lambda: _eager(eager_graph, options, device),
        INDUCTOR_OWN: own}
    record = guard_graph(makers, eager_graph, inputs, store=store, rounds=options.rounds,
                         margin=GUARD_MARGIN, train=train, dtype=dtype, device=device,
                         compiled_as=options.compiled_as)
    timed = _timed(record)
    kept = guard.decide(record, margin=GUARD_MARGIN)
    if kept == EAGER:
        return _eager(eager_graph, options, device), EAGER, timed
    if kept == INDUCTOR_OWN:
        return own(), INDUCTOR_OWN, timed
    return fn, COMPILED, timed


# ---------------------------------------------------------------- planning


def plan_graph(gm: fx.GraphModule, inputs: list[Any], options: Backend, *, train: bool,
               dtype: torch.dtype | None, device: torch.device,
               rule: bool | None = None, store: CostCache | None = None,
               decided: tuple[CostTable, Mapping[str, int]] | None = None) -> _Planned:
    """The plan of one Dynamo graph on real ``inputs``: a rewritten copy of ``gm`` (``gm``
    itself is not changed), its costs measured into ``store`` (none: all measured), or
    ``decided``: the costs and labels another rank measured and solved (nothing measured).
    ``NotPlanned`` says why a graph has nothing to plan."""
    work = copy_graph(gm)
    ranks = CONV1D_RANKS if any(op_name(n) in ("conv1d", "conv_transpose1d")
                                for n in work.graph.nodes) else BASE_RANKS
    try:
        # no run facts: nothing steers a Dynamo graph by module calls
        propagate(work, tuple(fresh_inputs(inputs)), dtype=dtype, ranks=ranks, device=device,
                  facts=False)
    except MemlayoutError as exc:
        raise NotPlanned(f"the graph does not run on real tensors: {first_line(exc)}") from exc
    mark_spatial(work)
    for n in mutated_aliases(work):  # converting these would lose a write someone reads
        n.meta[META_KEY] = dataclasses.replace(n.meta[META_KEY], label=None)
    refuse_module_state(work, ranks)
    if not any(n.meta.get(META_KEY) is not None and n.meta[META_KEY].label in LABELS
               for n in work.graph.nodes):
        raise NotPlanned("no image-like value: no layout to choose")
    if decided is None:
        table = measure_costs(work, tuple(fresh_inputs(inputs)), dtype=dtype,
                              measure=options.measure, cache=store if options.measure else None,
                              rounds=options.rounds, train=train, device=device)
    else:
        table = decided[0]
    form = formulate(work, table, input_label=None, output_label=Request.KEEP)
    labels = solve_labels(form.integer) if decided is None else dict(decided[1])
    convolutions = convolution_choices(work, table, labels, rule)
    _, made = rewrite(nn.Module(), work, form, labels)
    weights = converted_weights(work, inputs, [value for value, _, _ in made])
    if train:
        grads_in_parameter_strides(work, inputs)
    if is_dynamic(gm):
        _traced_conversions(work)
    return _Planned(work, table, len(made), convolutions, weights,
                    tuple(sorted((k, int(v)) for k, v in labels.items())))


def _traced_conversions(gm: fx.GraphModule) -> None:
    """The rewrite's conversions as ``to_label`` calls, which trace with symbolic sizes (the
    layout algebra's cached stride rules hash sizes, and a symbolic size has no hash)."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is convert_value:
            n.target = to_label
        elif n.op == "call_function" and n.target is convert_value_1d:
            n.target, n.args = to_label, (*n.args, CONV1D_RANKS)
    gm.recompile()


def to_label(value: Any, label: int, ranks: tuple[int, ...]) -> Any:
    """Every tensor in ``value`` of a rank in ``ranks`` dense in ``label``'s format (1: N L C,
    channels_last, channels_last_3d by rank; 0: contiguous), by ``contiguous`` (its gradient
    back in the source's format, ``to_dense``): a no-op for a tensor already dense
    in it; other values unchanged.

    >>> to_label((torch.empty(2, 3, 4, 4), 1), 1, (4, 5))[0].stride()
    (48, 1, 12, 3)
    """
    if isinstance(value, (tuple, list)):
        return type(value)(to_label(v, label, ranks) for v in value)
    if not isinstance(value, torch.Tensor) or value.dim() not in ranks:
        return value
    return to_dense(value, Label(label).format(value.dim()))


def inductor_rule(gm: fx.GraphModule, example_inputs: list[Any], *, dtype: torch.dtype | None,
                  train: bool, device: torch.device) -> bool | None:
    """Inductor's whole-graph layout decision for ``gm`` under the current config:
    ``True`` when it would require channels-last for every 2-d convolution; ``None`` when
    this torch cannot say (the internal ``GraphLowering.decide_layout_opt`` missing, or the
    graph not traceable to aten). ``gm`` is traced to aten in Dynamo's own fake mode and
    shape env (``_in_dynamos_mode``: fast, and symbolic where Dynamo's sizes are, as
    Inductor sees them); a graph that does not trace there (one that reads a value, such as
    a float Dynamo passes as a tensor) is traced on real inputs of its sizes instead."""
    try:
        from torch._inductor.graph import GraphLowering

        decide = GraphLowering.decide_layout_opt
    except (ImportError, AttributeError):
        return None
    for trace in (_in_dynamos_mode, _on_real_inputs):
        try:
            aten = trace(gm, example_inputs, dtype=dtype, device=device)
            return bool(decide(aten, is_inference=not train))
        except Exception:  # untraceable this way, or a changed internal: the next, or no answer
            continue
    return None


def _in_dynamos_mode(gm: fx.GraphModule, example_inputs: list[Any], *,
                     dtype: torch.dtype | None, device: torch.device) -> fx.GraphModule:
    """``gm`` traced to aten on new fake tensors of ``example_inputs``' sizes and strides in
    Dynamo's fake mode (a fake mode of their own outside Dynamo), guards suppressed so the
    trace adds none to Dynamo's, and nothing the graph writes in place touching its inputs;
    a real tensor the graph holds (an attribute) read as fake."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = detect_fake_mode(example_inputs) or FakeTensorMode()
    quiet = (mode.shape_env.suppress_guards() if mode.shape_env is not None
             else contextlib.nullcontext())
    allowed, mode.allow_non_fake_inputs = mode.allow_non_fake_inputs, True
    try:
        with mode, quiet, torch.no_grad(), autocast(device, dtype):
            fakes = [torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)
                     if isinstance(x, torch.Tensor) else x for x in example_inputs]
            return make_fx(gm, tracing_mode="real")(*fakes)  # "real": the inputs as given
    finally:
        mode.allow_non_fake_inputs = allowed


def _on_real_inputs(gm: fx.GraphModule, example_inputs: list[Any], *,
                    dtype: torch.dtype | None, device: torch.device) -> fx.GraphModule:
    """``gm`` traced to aten from real inputs made of ``example_inputs`` (``real_inputs``),
    outside Dynamo's tracing context, every size symbolic in a dynamic graph."""
    from torch.fx.experimental.proxy_tensor import make_fx

    inputs = fresh_inputs(real_inputs(example_inputs))
    with torch._guards.tracing(None), torch.no_grad(), autocast(device, dtype):
        return make_fx(gm, tracing_mode="symbolic" if is_dynamic(gm) else "fake",
                       _allow_non_fake_inputs=True)(*inputs)


def _rule(gm: fx.GraphModule, example_inputs: list[Any], inputs: list[Any],
          store: CostCache | None, *, dtype: torch.dtype | None, train: bool,
          device: torch.device) -> bool | None:
    """``inductor_rule``, read from the cost cache where this graph's (same code, input
    shapes, strides and dtypes, torch and Inductor layout config) was found before: asking
    it traces the graph to aten, a large part of a cached compile."""
    if store is None:
        return inductor_rule(gm, example_inputs, dtype=dtype, train=train, device=device)
    from torch._inductor import config

    key = json.dumps(["backend-rule", measured_on(device), torch.__version__, str(dtype),
                      "train" if train else "infer", config.layout_optimization,
                      config.force_layout_optimization, torch.backends.mkldnn.enabled,
                      graph_signature(gm, inputs)])
    found = store.get(key, lambda r: isinstance(r, dict) and r.get("rule") in (True, False, None))
    if found is not None:
        return found["rule"]
    rule = inductor_rule(gm, example_inputs, dtype=dtype, train=train, device=device)
    store.put(key, {"rule": rule}, is_noisy=False)
    return rule


# ---------------------------------------------------------------- compiling


def _inner(gm: fx.GraphModule, example_inputs: list[Any], options: Backend,
           dtype: torch.dtype | None, device: torch.device,
           patches: Mapping[str, Any] = PLAN_STANDS,
           backward_now: bool = True) -> Callable[..., Any]:
    """``gm`` compiled by the inner compiler (Inductor with ``patches``), or run eagerly;
    ``backward_now``: the backward compiled with the forward, for a graph run before Dynamo
    runs it (verified, timed by the guard): compiled lazily, it would be at its first
    backward, inside the backend's call, where Inductor's compile context is already open."""
    if options.inner == "eager":
        return _eager(gm, options, device)
    from torch._inductor.compile_fx import compile_fx

    config = {**dict(options.inductor), **patches}  # the plan's patches win
    if options.mode not in (None, "default"):
        from torch._inductor import list_mode_options

        config = {**list_mode_options(options.mode), **config}
    functorch = torch._functorch.config
    # a torch without the option compiles the backward lazily, as it always did; in a graph
    # of DDP's optimizer never: a lazy backward takes its forward's metadata by counting the
    # split graphs back from the last, which holds only where every split's is lazy
    eager_backward = (functorch.patch(force_non_lazy_backward_lowering=backward_now
                                      or _ddp_split())
                      if hasattr(functorch, "force_non_lazy_backward_lowering")
                      else contextlib.nullcontext())
    with _autocast_for(options, device, dtype), eager_backward:
        fn = compile_fx(gm, example_inputs, config_patches=config or None)
    return _fake_first_call_made(fn, example_inputs)


def _ddp_split() -> bool:
    """Whether the graph being compiled is one of the split graphs of DDP's optimizer
    (``torch._dynamo.config.optimize_ddp``: one graph per gradient bucket)."""
    context = torch._guards.TracingContext.try_get()
    return getattr(context, "ddp_optimizer_ctx", None) is not None


def _fake_first_call_made(fn: Callable[..., Any],
                          example_inputs: list[Any]) -> Callable[..., Any]:
    """``fn`` (compiled by AOTAutograd) runnable on real tensors from its first call.

    DDP's optimizer compiles each split graph with ``fakify_first_call`` set: the compiled
    function's first call returns fake outputs in the strides Inductor chose, whatever it is
    given, and DDP's optimizer makes that call, on fake tensors, to learn what the next split
    graph is given. The backend runs what it compiles first (verification, the guard), so
    here that first call is made, on the fake example inputs in their fake mode as DDP's
    optimizer makes it, and a later call on fake tensors is answered with its outputs."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import is_fake

    context = torch._guards.TracingContext.try_get()
    mode = detect_fake_mode(example_inputs)
    if context is None or not getattr(context, "fakify_first_call", False) or mode is None:
        return fn
    allowed, mode.allow_non_fake_inputs = mode.allow_non_fake_inputs, True
    try:
        with mode:
            pending = [fn(*example_inputs)]
    finally:
        mode.allow_non_fake_inputs = allowed

    def run(*args: Any) -> Any:
        if pending and any(isinstance(a, torch.Tensor) and is_fake(a) for a in args):
            return pending.pop()
        return fn(*args)
    return run


def _as_given(gm: fx.GraphModule, example_inputs: list[Any], *, train: bool) -> fx.GraphModule:
    """``gm`` as the backend runs it without a plan (Inductor's own layouts, or eagerly): in
    training, a copy whose parameters hand their gradients back in their own strides
    (``grads_in_parameter_strides``; Inductor's own channels-last gives a 1x1 convolution's
    weight the gradient strides DDP's buckets warn about), else ``gm`` itself."""
    if not train:
        return gm
    work = copy_graph(gm)
    return work if grads_in_parameter_strides(work, example_inputs) else gm


def _unplanned(gm: fx.GraphModule, example_inputs: list[Any], options: Backend,
               dtype: torch.dtype | None, device: torch.device,
               backward_now: bool = False) -> tuple[Callable[..., Any], str]:
    """``gm`` as Inductor compiles it with its own layouts (or as given, run eagerly);
    ``backward_now`` as for ``_inner``."""
    if options.inner == "eager":
        return _eager(gm, options, device), AS_GIVEN
    return (_inner(gm, example_inputs, options, dtype, device, patches={},
                   backward_now=backward_now), INDUCTOR_OWN)


def _eager(gm: fx.GraphModule, options: Backend, device: torch.device) -> Callable[..., Any]:
    """``gm`` run eagerly (under ``options.dtype``'s autocast when one is set)."""
    if options.dtype is None:
        return gm.forward

    def run(*args: Any) -> Any:
        with _autocast_for(options, device, options.run_dtype(device)):
            return gm(*args)
    return run


def _autocast_for(options: Backend, device: torch.device, dtype: torch.dtype | None) -> Any:
    """The autocast an explicit ``options.dtype`` asks for (fp32: autocast off); none else."""
    if options.dtype is None:
        return contextlib.nullcontext()
    if dtype is None:
        return torch.autocast(device.type, enabled=False)
    return autocast(device, dtype)


def _inductor_option(name: str) -> bool:
    """``name`` is one of Inductor's config options (dotted for a nested one:
    ``triton.cudagraphs``)."""
    from torch._inductor import config

    holder: Any = config
    for part in name.split("."):
        if not hasattr(holder, part):
            return False
        holder = getattr(holder, part)
    return True


# ---------------------------------------------------------------- the cost cache


def _open_cache(cache: bool | str | Path) -> CostCache | None:
    if cache is False:
        return None
    try:
        return CostCache(None if cache is True else Path(cache))
    except Exception as exc:  # an unusable cache must not stop a compile: measure instead
        warnings.warn(f"memlayout backend: cost cache unavailable ({exc}); measuring without it",
                      BackendWarning, stacklevel=3)
        return None


__all__ = ["GUARD_MARGIN", "INNER_COMPILERS", "Backend", "BackendWarning", "compile_graph",
           "inductor_rule", "is_dynamic", "memlayout_backend", "plan_graph", "real_inputs",
           "verify_graph"]
