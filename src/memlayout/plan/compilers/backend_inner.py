"""Compiling and running one Dynamo graph for the ``torch.compile`` backend
(``backend.py``): Inductor with the plan standing, Inductor's own layouts, the graph
run eagerly, and the guard's choice among them."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch._dynamo.exc
import torch._functorch.config
from torch import fx

from memlayout.dtypes import autocast
from memlayout.errors import first_line
from memlayout.plan.check.training import Step
from memlayout.plan.compilers.backend_check import (
    GraphCheck,
    cached_guard,
    compiled_with_backward,
    forget_guard,
    guard_graph,
    guard_key,
    verified_before,
    verify_once,
)
from memlayout.plan.compilers.backend_graphs import (
    copy_graph,
    grad_in_strides,
    grads_in_parameter_strides,
    graph_id,
)
from memlayout.plan.compilers.backend_race import (
    CallRace,
    Decided,
    chained,
    decided_here,
    guard_ratios,
)
from memlayout.plan.costs.cache import CostCache
from memlayout.plan.runners import Runner
from memlayout.timing import KEEP_MARGIN, Race

if TYPE_CHECKING:
    from memlayout.plan.compilers.backend import Backend
    from memlayout.plan.costs.cache import CostCache

T = TypeVar("T")

#: the nice value of a thread that works alongside a compile (the lowest priority)
LOWEST_PRIORITY = 19

#: Inductor's config with the plan standing: its own layout optimization off, so the strides
#: of the traced graph reach the kernels (``memlayout.compile``'s planned candidate too)
PLAN_STANDS = {"layout_optimization": False}


#: the ways the guard times a planned graph: the compiled plan, the plan eagerly, Inductor's own
WAYS = [Runner.PLAN_COMPILED, Runner.PLAN_EAGER, Runner.INDUCTOR_OWN]


#: what Dynamo raises through a backend to restart or skip a frame: never caught as a failure
DYNAMO_SIGNALS = (torch._dynamo.exc.RestartAnalysis, torch._dynamo.exc.SkipFrame)

def known_decision(eager_graph: fx.GraphModule, inputs: list[Any], options: Backend,
                    store: CostCache | None, *, train: bool, dtype: torch.dtype | None,
                    device: torch.device, ways: Sequence[Runner] = WAYS) -> Race | None:
    """The guard's cached race of ``ways`` for this planned graph, if the guard runs and one
    stands."""
    if options.inner == "eager" or not (options.guard and options.measure) or store is None:
        return None
    return cached_guard(list(ways), eager_graph, inputs, store=store, margin=KEEP_MARGIN,
                        train=train, dtype=dtype, device=device,
                        compiled_as=options.compiled_as)


def fastest_way(fn: Callable[..., Any], gm: fx.GraphModule, eager_graph: fx.GraphModule,
                example_inputs: list[Any], inputs: list[Any], options: Backend,
                store: CostCache | None, checked: Checked, *,
                train: bool, dtype: torch.dtype | None,
                device: torch.device, spent: dict[str, float] | None = None,
                ways: Sequence[Runner] = WAYS, on_calls: Callable[[], Any] | None = None
                ) -> tuple[Callable[..., Any], Runner, tuple[tuple[str, float], ...], GraphCheck]:
    """The fastest way to run a verified plan's graph, timed interleaved (``guard_graph``):
    the plan compiled (``fn``, kept unless another is faster by more than ``KEEP_MARGIN``),
    the plan run eagerly, and ``gm`` compiled by Inductor with its own layouts: what
    ``torch.compile`` alone would run. In training that one is timed even where every
    convolution's planned format is the one Inductor's rule gives it: the layouts between
    them (attention, normalization, conversions) and the gradients' strides differ too, and
    can cost more than the convolutions save, unless ``ways`` leaves it out (a training graph
    whose plan saves less than the margin over Inductor's rule by its costs: then only the
    plan compiled and eager are raced; an inference graph that agrees runs Inductor's own
    untimed: ``backend_plan.agrees_with_inductor``). The eager plan, where it is kept, is
    verified as ``checked`` says the compiled plan was (:func:`eager_kept`); where it fails,
    the compiled plan runs and the race is forgotten, so that no later compile reads it.
    Returns the function, what runs it, each other way's median ratio (the compiled plan's
    time over its) and the check of what runs; ``spent[Runner.INDUCTOR_OWN]``: the seconds
    Inductor's own compile took (what ``torch.compile`` alone spends on the graph),
    ``spent["verify"]`` those verifying the eager plan took.

    ``on_calls`` (a function opening the cost cache): the race runs on the graph's own calls
    (``backend_race.CallRace``, returned as the function, what runs it the compiled plan
    until the race ends), each way built and verified before the first."""
    made: dict[str, Callable[..., Any]] = {}
    spent = {} if spent is None else spent

    def own() -> Callable[..., Any]:
        if Runner.INDUCTOR_OWN not in made:
            start = time.perf_counter()
            # timed here, its backward is compiled with it; raced on the calls, lazily, as
            # torch.compile compiles it (at its first backward, the race's first call of it)
            now = train and on_calls is None
            made[Runner.INDUCTOR_OWN] = unplanned(gm, example_inputs, options, dtype, device,
                                                   backward_now=now)[0]
            spent[Runner.INDUCTOR_OWN] = time.perf_counter() - start
            if now:  # where it is kept, a later compile reads what this one cached
                compiled_with_backward(store, gm, inputs, device=device,
                                       compiled_as=options.compiled_as, keep=True)
        return made[Runner.INDUCTOR_OWN]

    makers: dict[str, Callable[[], Callable[..., Any]]] = {
        Runner.PLAN_COMPILED: lambda: fn,
        Runner.PLAN_EAGER: lambda: eager_run(eager_graph, options, device),
        Runner.INDUCTOR_OWN: own}
    makers = {way: make for way, make in makers.items() if way in ways}
    where = dict(train=train, dtype=dtype, device=device, compiled_as=options.compiled_as)
    if on_calls is not None:
        return _racing(fn, makers, eager_graph, inputs, options, store, checked, on_calls,
                       spent, **where), Runner.PLAN_COMPILED, (), checked.check
    race = guard_graph(makers, eager_graph, inputs, store=store, rounds=options.rounds,
                       margin=KEEP_MARGIN, **where)
    timed = guard_ratios(race)
    kept = race.kept(Runner.PLAN_COMPILED, KEEP_MARGIN)
    if kept == Runner.PLAN_EAGER:
        eager, ran, check, spent["verify"] = eager_kept(
            eager_run(eager_graph, options, device), fn, checked, eager_graph, inputs, store,
            train=train, dtype=dtype, device=device)
        if ran != Runner.PLAN_EAGER:
            forget_guard(store, list(makers), eager_graph, inputs, **where)
        return eager, ran, timed, check
    if kept == Runner.INDUCTOR_OWN:
        return own(), Runner.INDUCTOR_OWN, timed, checked.check
    return fn, Runner.PLAN_COMPILED, timed, checked.check


def _racing(fn: Callable[..., Any], makers: Mapping[str, Callable[[], Callable[..., Any]]],
            eager_graph: fx.GraphModule, inputs: list[Any], options: Backend,
            store: CostCache | None, checked: Checked, opened: Callable[[], Any],
            spent: dict[str, float], *,
            train: bool, dtype: torch.dtype | None, device: torch.device,
            compiled_as: str) -> CallRace:
    """The guard's race of ``makers``' ways, on the graph's calls (``fastest_way``): the plan
    run eagerly verified first (left out where it fails), Inductor's own compiled."""
    fns: dict[str, Callable[..., Any]] = {}
    checks: dict[str, GraphCheck] = {}
    compiled = checked.check
    for way, make in makers.items():
        if way != Runner.PLAN_EAGER:
            fns[way] = make()
            continue
        eager = make()
        check, spent["verify"] = eager_check(eager, checked, eager_graph, inputs, store,
                                             train=train, dtype=dtype, device=device)
        if check.ok:
            fns[way], checks[way] = eager, check
        else:
            compiled = GraphCheck(True, f"{compiled.how}; the plan run eagerly failed its "
                                  f"check ({check.how}): not raced", compiled.error)
    checks.update(dict.fromkeys((Runner.PLAN_COMPILED.value, Runner.INDUCTOR_OWN.value),
                                compiled))
    whole = len(fns) == len(makers)  # a way left out: the race is not stored
    key = guard_key(list(makers), eager_graph, inputs, train=train, dtype=dtype,
                    device=device, compiled_as=compiled_as) if whole else None
    graph = graph_id(checked.gm)
    return CallRace(fns, reference=Runner.PLAN_COMPILED.value, margin=KEEP_MARGIN,
                    rounds=options.rounds, protect=(Runner.INDUCTOR_OWN,), train=train,
                    device=device, decided=decided_here(graph, key, opened, checks))


def own_against_eager(own: Callable[..., Any], eager: Callable[..., Any],
                      eager_graph: fx.GraphModule, inputs: list[Any], options: Backend,
                      check: GraphCheck, opened: Callable[[], Any], *, graph: str, train: bool,
                      dtype: torch.dtype | None, device: torch.device,
                      then: Decided | None = None) -> CallRace:
    """The race on the calls of a graph whose compiled plan is not built up front: Inductor's
    own layouts (``own``, compiled as ``torch.compile`` compiles the graph: its backward
    lazily, at its first backward) against the plan run eagerly (``eager``, verified as
    ``check`` says). Inductor's own is the compiled way, and the race's reference: where the
    plan agrees with Inductor's rule (``backend_plan.agrees_with_inductor``), its
    convolutions are in the formats Inductor's own gives them and the rest differs by less
    than the margin by its costs; where it differs, the compiled plan waits for this race
    (``backend_later``, whose ``then`` hears its end too). ``graph``: Dynamo's compile id
    of the graph, whose record the race's end updates."""
    ways = [Runner.INDUCTOR_OWN, Runner.PLAN_EAGER]
    key = guard_key(list(ways), eager_graph, inputs, train=train, dtype=dtype, device=device,
                    compiled_as=options.compiled_as)
    here = decided_here(graph, key, opened, first_checks(check))
    return CallRace({Runner.INDUCTOR_OWN: own, Runner.PLAN_EAGER: eager},
                    reference=Runner.INDUCTOR_OWN.value, margin=KEEP_MARGIN,
                    rounds=options.rounds, protect=(), train=train, device=device,
                    decided=here if then is None else chained(here, then))


def overlaps(options: Backend, device: torch.device) -> bool:
    """Whether a verification may run on a thread of its own while Inductor compiles: on a
    CPU (Inductor's compile is mostly Python, on one core; a GPU's kernels would share the
    device with it), where Inductor times nothing as it compiles (no autotuning, whose
    timings the verification's kernels would disturb)."""
    inductor = dict(options.inductor)
    return (device.type == "cpu" and options.mode in (None, "default")
            and not any(v for k, v in inductor.items() if "autotune" in k))


def alongside(work: Callable[[], T], *, overlap: bool) -> Callable[[], T]:
    """``work`` run on a thread of its own while the caller goes on (``overlap``), else now:
    a function that returns its result once it is there (or raises what it raised).

    >>> alongside(lambda: 2 + 2, overlap=True)(), alongside(lambda: 3, overlap=False)()
    (4, 3)
    """
    if not overlap:
        result = work()
        return lambda: result

    def behind() -> T:
        lowest_priority()
        return work()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memlayout-verify")
    future = pool.submit(behind)
    pool.shutdown(wait=False)
    return future.result


def lowest_priority() -> None:
    """The calling thread, and the threads it starts from now (its OpenMP team), at the
    lowest CPU priority, where the OS lets a thread lower its own (Linux): work alongside a
    compile then takes only what the compile leaves idle (its own Python, and the C++
    compilers it starts, go first)."""
    if not sys.platform.startswith("linux"):  # elsewhere the id would name a process
        return
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)


def first_checks(eager: GraphCheck | None) -> dict[str, GraphCheck]:
    """How each way of the race of Inductor's own against the plan run eagerly was
    verified: the eager plan as ``eager`` says (``None``: not verified in this compile, so
    left out); Inductor's own is what ``torch.compile`` runs."""
    own = GraphCheck(True, "Inductor's own layouts, what torch.compile runs, kept over the "
                     "plan run eagerly", None)
    return {Runner.INDUCTOR_OWN.value: own,
            **({} if eager is None else {Runner.PLAN_EAGER.value: eager})}


def inner_compile(gm: fx.GraphModule, example_inputs: list[Any], options: Backend,
           dtype: torch.dtype | None, device: torch.device,
           patches: Mapping[str, Any] = PLAN_STANDS,
           backward_now: bool = True) -> Callable[..., Any]:
    """``gm`` compiled by the inner compiler (Inductor with ``patches``), or run eagerly;
    ``backward_now``: the backward compiled with the forward, for a graph run before Dynamo
    runs it (verified, timed by the guard): compiled lazily, it would be at its first
    backward, inside the backend's call, where Inductor's compile context is already open."""
    if options.inner == "eager":
        return eager_run(gm, options, device)
    from torch._inductor.compile_fx import compile_fx

    config = {**dict(options.inductor), **patches}  # the plan's patches win
    if calls_ours(gm) and inductor_option("unsafe_marked_cacheable_functions"):
        from torch._inductor import config as inductor_config

        config["unsafe_marked_cacheable_functions"] = {
            **inductor_config.unsafe_marked_cacheable_functions,
            **config.get("unsafe_marked_cacheable_functions", {}), **cacheable_functions()}
    if options.mode not in (None, "default"):
        from torch._inductor import list_mode_options

        config = {**list_mode_options(options.mode), **config}
    functorch = torch._functorch.config
    # a torch without the option compiles the backward lazily, as it always did; in a graph
    # of DDP's optimizer never: a lazy backward takes its forward's metadata by counting the
    # split graphs back from the last, which holds only where every split's is lazy
    eager_backward = (functorch.patch(force_non_lazy_backward_lowering=backward_now
                                      or ddp_split())
                      if hasattr(functorch, "force_non_lazy_backward_lowering")
                      else contextlib.nullcontext())
    with autocast_for(options, device, dtype), eager_backward:
        fn = compile_fx(gm, example_inputs, config_patches=config or None)
    return fake_first_call_made(fn, example_inputs)


@functools.lru_cache(maxsize=1)
def _ours() -> dict[str, Callable[..., Any]]:
    """The functions of memlayout's a planned graph calls (its conversions, a weight's
    gradient strides), by the name AOTAutograd's cache check gives a call's target: it
    caches a graph that calls a function outside torch only where Inductor's config names
    that function cacheable, with a key of its own."""
    from memlayout.plan.compilers.backend_plan import to_label
    from memlayout.plan.convert import convert_value, convert_value_1d

    return {f"{fn.__module__}.{fn.__name__}": fn
            for fn in (convert_value, convert_value_1d, to_label, grad_in_strides)}


def calls_ours(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` calls one of memlayout's functions (``_ours``)."""
    return any(n.op == "call_function"
               and f"{getattr(n.target, '__module__', '')}.{getattr(n.target, '__name__', '')}"
               in _ours() for n in gm.graph.nodes)


@functools.lru_cache(maxsize=1)
def cacheable_functions() -> dict[str, str]:
    """Memlayout's functions a planned graph calls, each keyed by what decides what it
    computes: memlayout's version and the source of the modules that define them and of the
    layout code they call (a change to either is a new key, so a compile cached by other
    code is not read)."""
    from memlayout import __version__, layout, tensors

    digest = hashlib.sha256(__version__.encode())
    modules = {fn.__module__ for fn in _ours().values()}
    for path in sorted({str(sys.modules[m].__file__) for m in modules}
                       | {str(layout.__file__), str(tensors.__file__)}):
        digest.update(Path(path).read_bytes())
    return dict.fromkeys(_ours(), digest.hexdigest()[:16])


def ddp_split() -> bool:
    """Whether the graph being compiled is one of the split graphs of DDP's optimizer
    (``torch._dynamo.config.optimize_ddp``: one graph per gradient bucket)."""
    context = torch._guards.TracingContext.try_get()
    return getattr(context, "ddp_optimizer_ctx", None) is not None


def fake_first_call_made(fn: Callable[..., Any],
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


def as_given(gm: fx.GraphModule, example_inputs: list[Any], *, train: bool) -> fx.GraphModule:
    """``gm`` as the backend runs it without a plan (Inductor's own layouts, or eagerly): in
    training, a copy whose parameters hand their gradients back in their own strides
    (``grads_in_parameter_strides``; Inductor's own channels-last gives a 1x1 convolution's
    weight the gradient strides DDP's buckets warn about), else ``gm`` itself."""
    if not train:
        return gm
    work = copy_graph(gm)
    return work if grads_in_parameter_strides(work, example_inputs) else gm


def unplanned(gm: fx.GraphModule, example_inputs: list[Any], options: Backend,
               dtype: torch.dtype | None, device: torch.device,
               backward_now: bool = False) -> tuple[Callable[..., Any], Runner]:
    """``gm`` as Inductor compiles it with its own layouts (or as given, run eagerly);
    ``backward_now`` as for ``inner_compile``."""
    if options.inner == "eager":
        return eager_run(gm, options, device), Runner.ORIGINAL_EAGER
    return (inner_compile(gm, example_inputs, options, dtype, device, patches={},
                   backward_now=backward_now), Runner.INDUCTOR_OWN)


def eager_run(gm: fx.GraphModule, options: Backend, device: torch.device) -> Callable[..., Any]:
    """``gm`` run eagerly (under ``options.dtype``'s autocast when one is set)."""
    if options.dtype is None:
        return gm.forward

    def run(*args: Any) -> Any:
        with autocast_for(options, device, options.run_dtype(device)):
            return gm(*args)
    return run


def autocast_for(options: Backend, device: torch.device, dtype: torch.dtype | None) -> Any:
    """The autocast an explicit ``options.dtype`` asks for (fp32: autocast off); none else."""
    if options.dtype is None:
        return contextlib.nullcontext()
    if dtype is None:
        return torch.autocast(device.type, enabled=False)
    return autocast(device, dtype)


def inductor_option(name: str) -> bool:
    """``name`` is one of Inductor's config options (dotted for a nested one:
    ``triton.cudagraphs``)."""
    from torch._inductor import config

    holder: Any = config
    for part in name.split("."):
        if not hasattr(holder, part):
            return False
        holder = getattr(holder, part)
    return True


def built_and_checked(gm: fx.GraphModule, graph: fx.GraphModule, eager_graph: fx.GraphModule,
                       example_inputs: list[Any], inputs: list[Any], options: Backend,
                       store: CostCache | None, *, train: bool, dtype: torch.dtype | None,
                       device: torch.device, compiled: bool, timed: bool = True,
                       reference_steps: dict[str, Step] | None = None
                       ) -> tuple[Callable[..., Any] | None, GraphCheck, float]:
    """The planned ``graph`` built (``compiled`` by the inner compiler, else run eagerly) and
    verified once against ``gm``: the function, the check and the seconds verifying took. A
    plan that does not compile or run is a failed check (Inductor's own runs instead).
    ``timed``: the guard times the compiled plan after this. A training plan that is neither
    timed nor verified here (its verdict kept from before) first runs where Dynamo runs it:
    its backward is compiled lazily then, as ``torch.compile`` does (compiled with the
    forward, a backward takes measurably longer to compile: ``docs/benchmarks.md``), unless
    a compile of it put the two into the Inductor cache this process uses
    (``compiled_with_backward``): then with its forward again, and read from there.
    ``reference_steps``: ``gm``'s own step, kept for the next way verified in this compile."""
    fn: Callable[..., Any] | None = None
    verifying = 0.0
    way = options.compiled_as if compiled else Runner.PLAN_EAGER
    where = dict(device=device, compiled_as=options.compiled_as)
    try:
        # with its forward where it runs here, or where an earlier compile of it did, into
        # the Inductor cache this one reads (lazily, it would miss that)
        backward_now = train and (timed or verified_before(
            gm, eager_graph, inputs, store=store, way=way, train=train, dtype=dtype,
            device=device) is None or compiled_with_backward(store, eager_graph, inputs, **where))
        fn = (inner_compile(graph, example_inputs, options, dtype, device,
                            backward_now=backward_now)
              if compiled else eager_run(eager_graph, options, device))
        if compiled and backward_now:
            compiled_with_backward(store, eager_graph, inputs, keep=True, **where)
        began = time.perf_counter()
        try:
            check = verify_once(gm, eager_graph, fn, inputs, store=store, train=train,
                                dtype=dtype, device=device, compiled=compiled, way=way,
                                reference_steps=reference_steps)
        finally:
            verifying = time.perf_counter() - began
    except DYNAMO_SIGNALS:
        raise
    except Exception as exc:
        check = GraphCheck(False, f"compiling the plan failed ({type(exc).__name__}: "
                           f"{first_line(exc)})", None)
    return fn, check, verifying


@dataclass
class Checked:
    """How the compiled plan of ``gm`` was verified (``check``), and ``gm``'s own steps on
    the inputs (``steps``: one compile's, for the next way verified against it)."""

    gm: fx.GraphModule
    check: GraphCheck
    steps: dict[str, Step] = field(default_factory=dict)


def eager_kept(eager_fn: Callable[..., Any], compiled_fn: Callable[..., Any], checked: Checked,
               eager_graph: fx.GraphModule, inputs: list[Any], store: CostCache | None, *,
               train: bool, dtype: torch.dtype | None, device: torch.device
               ) -> tuple[Callable[..., Any], Runner, GraphCheck, float]:
    """The plan run eagerly (``eager_fn``), which the guard kept over the compiled plan,
    verified (:func:`eager_check`). Where it fails, the compiled plan (``compiled_fn``) runs,
    and its check says why. Returns the function, its runner, the check and the seconds
    verifying took."""
    check, seconds = eager_check(eager_fn, checked, eager_graph, inputs, store, train=train,
                                 dtype=dtype, device=device)
    if check.ok:
        return eager_fn, Runner.PLAN_EAGER, check, seconds
    return compiled_fn, Runner.PLAN_COMPILED, GraphCheck(
        True, f"{checked.check.how}; the plan run eagerly was faster but failed its check "
        f"({check.how}): the compiled plan runs", checked.check.error), seconds


def eager_check(eager_fn: Callable[..., Any], checked: Checked, eager_graph: fx.GraphModule,
                inputs: list[Any], store: CostCache | None, *, train: bool,
                dtype: torch.dtype | None, device: torch.device) -> tuple[GraphCheck, float]:
    """The plan run eagerly (``eager_fn``) verified against the graph as the compiled plan
    was (``checked``): other kernels run it (those of the eager formats), and what runs is
    what is verified. Once per graph and plan, as ``built_and_checked``: a compile that reads
    the guard's decision from the cost cache reads this verdict too. Returns the check and
    the seconds it took."""
    began = time.perf_counter()
    try:
        check = verify_once(checked.gm, eager_graph, eager_fn, inputs, store=store, train=train,
                            dtype=dtype, device=device, compiled=False, way=Runner.PLAN_EAGER,
                            reference_steps=checked.steps)
    except DYNAMO_SIGNALS:
        raise
    except Exception as exc:
        check = GraphCheck(False, f"running the plan eagerly failed ({type(exc).__name__}: "
                           f"{first_line(exc)})", None)
    return check, time.perf_counter() - began
