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
   float64 casts: ``memlayout.plan.compare.widen``), once per rewrite: its passing verdict
   is kept in the cost cache and holds for every way the plan runs. A graph that draws random numbers (dropout
   in training) is checked as the planned graph against the original, both eager with their
   dropouts off (a mask depends on the layout it is drawn in, and Inductor's random stream is
   not eager's). A mismatch drops the plan: the graph is compiled by Inductor with its own
   layouts, with a :class:`BackendWarning`. A passing verdict is kept in the cost cache
   (keyed by the graph's code, the rewrite's, the inputs' shapes, strides and dtypes, how the
   plan runs, and torch): the same graph planned the same way is not run again, and its
   record says "verified before";
5. ``guard``: the ways to run the graph timed, interleaved (a training step: forward, and
   backward into ``.grad``, so a weight gradient the plan leaves channels-last pays its copy
   into the parameter's strides): the compiled plan, the plan run eagerly, and the graph
   compiled by Inductor with its own layouts (what ``torch.compile`` alone runs, the way a
   plan must never be slower than); another than the reference runs only where it is faster
   by more than ``memlayout.timing.KEEP_MARGIN``, and a close call that counts is timed
   twice as long (``memlayout.plan.check.guard``). The race runs on the graph's own calls
   after the first, each way verified before its first (``backend_race.CallRace``), unless
   ``race_on_calls`` is off (then before the first call returns, the compiled plan the
   reference). On the calls, Inductor's own, compiled as ``torch.compile`` compiles it,
   races the plan run eagerly first; where the plan differs from Inductor's rule, the
   compiled plan waits for that race, and is built, verified and raced on a later call only
   where by its costs it could still win (``backend_later``). Where Inductor's own runs a
   known fault channels-last (``memlayout.plan.costs.faults``) it is not raced. The
   decisions are cached with the costs, and a graph decided before builds only the way that
   runs. Inductor's rule for the report (``inductor_rule``, a trace to aten) is cached the
   same way. An inference graph whose plan agrees with Inductor's rule by its costs
   (``agrees_with_inductor``: the convolutions it puts in another format would save less
   than ``KEEP_MARGIN`` of their time) is not timed: the guard keeps Inductor's own, and
   the plan is neither compiled nor verified (its record says so). An inference graph's
   convolutions are measured first, the rest only where they leave it open
   (``every_plan_agrees``). A training graph that agrees races one compiled way against the
   plan run eagerly, which can beat any compiled step: on its calls, Inductor's own (the
   compiled plan is not built); raced before the first call returns, the compiled plan (it
   also decides the gradients' strides, which DDP's buckets compare).

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

Under FSDP2 (``fully_shard`` of each block, each block compiled or the whole model), FSDP's
all-gathers and hooks run outside the graphs (``torch._dynamo.config.skip_fsdp_hooks``): each
graph holds a block's computation on its gathered parameters (plain tensors, in
``MixedPrecisionPolicy``'s ``param_dtype``), and is planned as any graph.

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
before its dynamic-shape exception.) Recompiles and guards stay Dynamo's. A convolution's
stride, padding, dilation or groups passed as a symbolic integer (blocks of one class with
different strides, under FSDP2) is guarded to its example value first
(``fix_convolution_arguments``), as Inductor guards it when it lowers the convolution.

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
import functools
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch._dynamo.exc
import torch._functorch.config
from torch import fx

from memlayout.devices import seam
from memlayout.dtypes import dtype_name, parse_dtype
from memlayout.errors import PlanError, first_line
from memlayout.plan.check.training import Step
from memlayout.plan.compilers import backend_inner
from memlayout.plan.compilers.backend_check import (
    GraphCheck,
    compiled_with_backward,
    graph_signature,
    verify_graph,
)
from memlayout.plan.compilers.backend_graphs import (
    copy_graph,
    fix_convolution_arguments,
    fsdp_managed,
    graph_id,
    is_dynamic,
    real_inputs,
    training,
)
from memlayout.plan.compilers.backend_inner import (
    DYNAMO_SIGNALS,
    Checked,
    as_given,
    built_and_checked,
    ddp_split,
    eager_run,
    fastest_way,
    first_checks,
    inductor_option,
    unplanned,
)
from memlayout.plan.compilers.backend_later import LaterPlan, PlanLater, first_race, ways_of
from memlayout.plan.compilers.backend_plan import (
    AGREES,
    NONE_DIFFERS,
    Planned,
    agrees_with_inductor,
    cached_rule,
    convolution_gain,
    inductor_rule,
    not_planned_reason,
    plan_graph,
)
from memlayout.plan.compilers.backend_race import guard_ratios, races_on_calls
from memlayout.plan.compilers.backend_report import (
    RECORDS,
    BackendWarning,
    GraphRecord,
    guard_seconds,
    open_cache,
)
from memlayout.plan.compilers.backend_shared import (
    Decision,
    ExchangeFailed,
    Job,
    exchange,
    job_of,
    plan_digest,
    untakeable,
)
from memlayout.plan.costs.cache import CostCache
from memlayout.plan.runners import Runner
from memlayout.tensors import device_of

INNER_COMPILERS = ("inductor", "eager")

#: Dynamo's control flow (trace again, skip the frame): raised through, never a failure


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
    keep the fastest (``False``: the compiled plan, untimed); ``race_on_calls``: the guard
    times those ways on the graph's own calls after the first, each call run and timed one
    way until the rounds decide (``backend_race.CallRace``; ``False``: on copies of the
    inputs before the first call returns, as under CUDA graphs and a shared plan); ``mode``: Inductor's
    ``mode`` (``"max-autotune"``, ``"reduce-overhead"``: CUDA graphs, ...); ``inductor``:
    Inductor config options (``torch.compile(..., options=...)`` names that are not
    memlayout's) for every graph Inductor compiles, the plan's and Inductor's own alike;
    ``shared_plan``: under an initialized ``torch.distributed`` process group, one rank per
    device kind measures and decides each graph and every other rank compiles its plan
    (``memlayout.plan.compilers.backend_shared``); every rank must then compile the same
    graphs with the same options, or the others wait for it. ``None`` (the default): shared
    where every rank compiles the graph by construction, the split graphs of DDP's optimizer
    and the graphs of modules FSDP2 manages (``fully_shard``: a block compiled on its own, or
    the whole model); ``True``: every graph (a model compiled on every rank alike);
    ``False``: each rank plans alone (a model compiled on some ranks only, an evaluation on
    rank 0)."""

    cache: bool | str | Path = True
    measure: bool = True
    rounds: int = 5
    dtype: str | torch.dtype | None = None
    inner: str = "inductor"
    guard: bool = True
    race_on_calls: bool = True
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
        unknown = [k for k, _ in self.inductor if not inductor_option(k)]
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
class _Compiled:
    """One graph compiled: what Dynamo runs, its record (not yet in the report), and the
    plan that runs with its rewritten graph's signature (``None``: no plan runs, Inductor's
    own layouts or the graph as given)."""

    fn: Callable[..., Any]
    record: GraphRecord
    plan: Planned | None = None
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
    fix_convolution_arguments(gm)  # constants, as Inductor's kernels take them
    inputs = real_inputs(example_inputs)
    device = device_of(inputs)
    with seam(device).fork_rng():
        try:
            shared = (ddp_split() or fsdp_managed(gm) if options.shared_plan is None
                      else options.shared_plan)
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
    store = open_cache(options.cache)
    try:
        made = _compile_graph(gm, example_inputs, inputs, device, options, store,
                              alone=job is None)
    except Exception as exc:  # the other ranks wait for a decision: they hear of this one
        if job is not None:
            signal = type(exc).__name__ if isinstance(exc, DYNAMO_SIGNALS) else ""
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
    graph = graph_id(gm)
    try:
        decision = exchange(job, None)
    except ExchangeFailed as exc:
        return _without_plan(gm, example_inputs, inputs, device, options, job.rank,
                             f"rank {job.decider}'s decision did not arrive: {exc}")
    if decision.record is None:
        signals = {cls.__name__: cls for cls in DYNAMO_SIGNALS}
        if decision.signal in signals:
            raise signals[decision.signal](f"rank {job.decider} raised it compiling graph {graph}")
        raise PlanError(f"memlayout backend: rank {job.decider} failed to compile graph "
                        f"{graph} (its error says why); rank {job.rank} stops with it")
    problem = untakeable(decision, signature, compiled_as=options.compiled_as,
                         train=training(inputs), dtype=dtype_name(options.run_dtype(device)))
    made = None
    if problem is None:
        try:
            made = _taken(decision, gm, example_inputs, inputs, device, options)
        except DYNAMO_SIGNALS:
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


def _taken(decision: Decision, gm: fx.GraphModule, example_inputs: list[Any],
           inputs: list[Any], device: torch.device, options: Backend) -> _Compiled | None:
    """``decision`` built here: a plan that runs rebuilt from the deciding rank's costs and
    labels (``plan_graph``, nothing measured) and run as it ran there, else the graph as
    Inductor compiles it with its own layouts. ``None`` where the rebuilt graph is not the
    one the deciding rank verified."""
    start = time.perf_counter()
    record = decision.record
    assert record is not None
    train, dtype = training(inputs), options.run_dtype(device)
    mine = {"graph": graph_id(gm), "measured": 0, "cached": 0}
    if decision.table is None:  # Inductor's own layouts, or the graph as given
        given = as_given(gm, example_inputs, train=train)
        fn, ran = unplanned(given, example_inputs, options, dtype, device)
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
    if record.ran == Runner.PLAN_COMPILED:
        fn = backend_inner.inner_compile(planned.graph, example_inputs, options, dtype, device)
    else:
        fn = eager_run(eager_graph, options, device)
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
    graph = graph_id(gm)
    warnings.warn(f"memlayout backend: rank {rank}, graph {graph}: {problem}; the graph is "
                  "compiled with Inductor's own layouts", BackendWarning, stacklevel=3)
    train, dtype = training(inputs), options.run_dtype(device)
    given = as_given(gm, example_inputs, train=train)
    fn, ran = unplanned(given, example_inputs, options, dtype, device)
    RECORDS.add(GraphRecord(graph, train, dtype_name(dtype), is_dynamic(gm), planned=False,
                            ran=ran, reason=f"no shared plan: {problem}",
                            compile_seconds=time.perf_counter() - start, rank=rank,
                            digest=plan_digest(graph_signature(gm, inputs), {}, ran)))
    return fn


def _compile_graph(gm: fx.GraphModule, example_inputs: list[Any], inputs: list[Any],
                   device: torch.device, options: Backend,
                   store: CostCache | None, alone: bool = True) -> _Compiled:
    """``gm`` planned (a planner that fails never stops a compile: Inductor's own runs), then
    built, verified and guarded (``_planned_graph``); ``alone``: no other rank takes it."""
    start = time.perf_counter()
    train = training(inputs)
    dtype = options.run_dtype(device)
    head = {"graph": graph_id(gm), "train": train,
            "dtype": dtype_name(dtype), "dynamic": is_dynamic(gm)}
    rule = cached_rule(gm, example_inputs, inputs, store, dtype=dtype, train=train, device=device)
    given = as_given(gm, example_inputs, train=train)  # what runs without a plan
    try:
        planned = plan_graph(gm, inputs, options, train=train, dtype=dtype, device=device,
                             rule=rule, store=store)
    except DYNAMO_SIGNALS:
        raise
    except Exception as exc:
        fn, ran = unplanned(given, example_inputs, options, dtype, device)
        return _Compiled(fn, GraphRecord(**head, planned=False, ran=ran, inductor_rule=rule,
                                         reason=not_planned_reason(exc, head["graph"]),
                                         plan_seconds=time.perf_counter() - start))
    record = {**head, "planned": True, "inductor_rule": rule,
              "convolutions": planned.convolutions, "conversions": planned.conversions,
              "converted_weights": planned.weights,
              "measured": planned.table.measured, "cached": planned.table.cached,
              "plan_seconds": time.perf_counter() - start}
    return _planned_graph(gm, given, example_inputs, inputs, planned, record, options, store,
                          on_calls=alone and races_on_calls(options), train=train,
                          dtype=dtype, device=device)


def _planned_graph(gm: fx.GraphModule, given: fx.GraphModule, example_inputs: list[Any],
                   inputs: list[Any], planned: Planned, record: dict[str, Any],
                   options: Backend, store: CostCache | None, *, on_calls: bool, train: bool,
                   dtype: torch.dtype | None, device: torch.device) -> _Compiled:
    """A planned graph built as the guard decides: Inductor's own untimed where an inference
    plan agrees with its rule, what a cached decision kept, else the plan verified and raced
    (``on_calls``: on the graph's calls) against the ways it could lose to."""
    start = time.perf_counter()
    agrees = agrees_with_inductor(planned)
    if not train and options.guard and options.measure and agrees:  # Inductor's own, untimed
        fn = unplanned(given, example_inputs, options, dtype, device)[0]
        return _Compiled(fn, GraphRecord(**record, ran=Runner.INDUCTOR_OWN,
                                         verification=AGREES if planned.solved else NONE_DIFFERS,
                                         compile_seconds=time.perf_counter() - start))
    eager_graph = copy_graph(planned.graph)  # compile_fx may change the graph it is given
    later = LaterPlan(gm, planned.graph, eager_graph, example_inputs, inputs, options,
                      functools.partial(open_cache, options.cache), first_checks(None),
                      record["graph"],
                      convolution_gain(planned.convolutions), train, dtype, device)
    own_first, ways, known, kept, pending = ways_of(planned, agrees, later, record, store,
                                                    on_calls=on_calls)
    if kept == Runner.INDUCTOR_OWN:  # what torch.compile alone runs: the plan is not built
        fn = unplanned(given, example_inputs, options, dtype, device, backward_now=train and (
            compiled_with_backward(store, given, inputs, device=device,
                                   compiled_as=options.compiled_as)))[0]
        return _Compiled(fn if pending is None else PlanLater(later, pending=pending).running(fn),
                         GraphRecord(**record, ran=Runner.INDUCTOR_OWN, timed=guard_ratios(known),
                                     racing=(pending, Runner.PLAN_COMPILED) if pending else (),
                                     verification="the plan not run (Inductor's own "
                                     "layouts kept, as timed before)",
                                     compile_seconds=time.perf_counter() - start))
    steps: dict[str, Step] = {}  # the graph's own steps, run once for every way verified
    verify = functools.partial(
        built_and_checked, gm, planned.graph, eager_graph, example_inputs, inputs, options,
        train=train, dtype=dtype, device=device, compiled=options.inner != "eager" and (
            kept == Runner.PLAN_COMPILED or not own_first and kept != Runner.PLAN_EAGER),
        timed=kept is None and options.guard and options.measure, reference_steps=steps)
    spent: dict[str, float] = {}
    if own_first and kept is None:  # the eager plan verified alongside Inductor's own compile
        guarding = time.perf_counter()
        built, check, record["verify_seconds"], record["verify_alongside"] = first_race(
            later, given, verify, store, spent, agrees=agrees)
        if not check.ok:
            return _dropped(given, example_inputs, options, dtype, device, check, record,
                            time.perf_counter() - start, built=built)
    else:
        built, check, record["verify_seconds"] = verify(store)
        guarding = time.perf_counter()
    if built is None or not check.ok:
        return _dropped(given, example_inputs, options, dtype, device, check, record,
                        time.perf_counter() - start)
    fn = built
    ran, timed = (Runner.PLAN_EAGER if options.inner == "eager" else Runner.PLAN_COMPILED), ()
    guarded = kept is None and (own_first or ran == Runner.PLAN_COMPILED and options.guard
                                and options.measure)
    later.checks = first_checks(check)
    if kept is not None:
        ran = Runner.PLAN_EAGER if kept == Runner.PLAN_EAGER else Runner.PLAN_COMPILED
        timed = guard_ratios(known)
        if pending is not None:
            fn = PlanLater(later, pending=pending).running(fn)
            record["racing"] = (pending, Runner.PLAN_COMPILED)
    elif own_first:  # the race's reference, until it ends
        ran = Runner.INDUCTOR_OWN
    elif guarded:
        fn, ran, timed, check = fastest_way(fn, given, eager_graph, example_inputs, inputs,
                                            options, store, Checked(gm, check, steps),
                                            train=train, dtype=dtype, device=device,
                                            spent=spent, ways=ways, on_calls=later.opened
                                            if on_calls else None)
    if guarded:
        record["racing"] = getattr(fn, "ways", ())
        guard_seconds(record, spent, time.perf_counter() - guarding, own_first=own_first)
    runs = ran in (Runner.PLAN_COMPILED, Runner.PLAN_EAGER)
    return _Compiled(fn, GraphRecord(**record, ran=ran, verification=check.how,
                                     max_error=check.error, timed=timed,
                                     compile_seconds=time.perf_counter() - start),
                     planned if runs else None,
                     graph_signature(eager_graph, inputs) if runs else "")


def _dropped(gm: fx.GraphModule, example_inputs: list[Any], options: Backend,
             dtype: torch.dtype | None, device: torch.device, check: GraphCheck,
             record: dict[str, Any], compile_seconds: float,
             built: Callable[..., Any] | None = None) -> _Compiled:
    """A plan that failed verification (or did not compile): the graph as Inductor compiles
    it with its own layouts (``built``: compiled so already), a warning, and the record
    saying why."""
    problem = check.how + ("" if check.error is None else f": relative error {check.error:.3g}")
    warnings.warn(f"memlayout backend: the plan of graph {record['graph']} was dropped "
                  f"({problem}); the graph is compiled with Inductor's own layouts instead. "
                  "Please report this with the model", BackendWarning, stacklevel=3)
    fn, ran = ((built, Runner.INDUCTOR_OWN) if built is not None
               else unplanned(gm, example_inputs, options, dtype, device))
    return _Compiled(fn, GraphRecord(**record, ran=ran, verification=check.how,
                                     max_error=check.error, fallback=problem,
                                     compile_seconds=compile_seconds))


__all__ = ["INNER_COMPILERS", "Backend", "BackendWarning", "compile_graph",
           "inductor_rule", "is_dynamic", "memlayout_backend", "plan_graph", "real_inputs",
           "verify_graph"]
