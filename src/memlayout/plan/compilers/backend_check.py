"""The backend's checks of one planned graph (L2 plan, compilers): verification against the
graph run eagerly (outputs, inputs changed in place, in training the gradients; a graph that
draws random numbers checked with its dropouts off; a passing verdict kept in the cost cache,
so a graph and plan are checked once), and the guard that times the compiled
graph against the planned one run eagerly and against Inductor's own layouts
(``memlayout.plan.compilers.backend``)."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo.exc
from torch import fx, nn

from memlayout.devices import seam
from memlayout.dtypes import autocast, dtype_name
from memlayout.plan.check import guard
from memlayout.plan.check.training import Step, agree, training_loss
from memlayout.plan.compare import float64, rounding_only
from memlayout.plan.compilers.backend_graphs import copy_graph, fresh_inputs, op_name
from memlayout.plan.costs.cache import CostCache
from memlayout.plan.costs.table import measured_on
from memlayout.plan.runners import Runner
from memlayout.tensors import clone_inputs, iter_tensors
from memlayout.timing import Race

_RANDOM = frozenset({"dropout", "dropout_", "alpha_dropout", "alpha_dropout_", "dropout1d",
                     "dropout2d", "dropout3d", "feature_dropout", "feature_alpha_dropout",
                     "native_dropout", "rand", "randn", "rand_like", "randn_like", "randint",
                     "randint_like", "randperm", "bernoulli", "bernoulli_", "multinomial",
                     "normal", "normal_", "uniform_", "exponential_", "rrelu", "rrelu_"})


#: the ``way`` under which the float64 re-check's verdict is kept: the rewrite's own, which
#: holds for every way the plan runs
REWRITE_EXACT = "the rewrite in float64"


def verify_graph(reference: fx.GraphModule, planned: fx.GraphModule, fn: Callable[..., Any],
                 inputs: list[Any], *, train: bool, dtype: torch.dtype | None,
                 device: torch.device, compiled: bool = True,
                 store: CostCache | None = None,
                 reference_steps: dict[str, Step] | None = None) -> GraphCheck:
    """``fn`` (the planned graph, ``compiled`` or not) against ``reference`` run eagerly,
    once (see the module docstring); ``planned``: the rewritten graph, for the float64
    re-check and for a graph that draws random numbers. Beyond the dtype's tolerance, ``fn``
    passes where the rewrite is exact in float64 and ``fn``'s run is no farther from the
    graph's float64 result than rounding takes the graph's own (``compare.rounding_only``).
    Whether the rewrite is exact holds whichever way it runs: ``store`` keeps that verdict,
    so the same rewrite of the same graph is not run in float64 again (the plan verified
    compiled, then run eagerly once the guard kept that). ``reference_steps`` keeps
    ``reference``'s own steps (its dtype's and float64's) for the next way checked against
    it on the same inputs (one compile's)."""
    names = [n.name for n in reference.graph.nodes if n.op == "placeholder"]
    if draws_random(reference):
        return _random_check(reference, planned, inputs, names, train=train, dtype=dtype,
                             device=device)
    how = ("the plan compiled vs the graph eagerly" if compiled
           else "the plan vs the graph, eagerly") + (", gradients" if train else "")
    memo = {} if reference_steps is None else reference_steps
    run = "train" if train else "infer"

    def reference_step(key: str, make: Callable[[], Step]) -> Step:
        if key not in memo:
            memo[key] = make()
        return memo[key]
    want = reference_step(f"{run} {dtype}", lambda: _step(reference, inputs, names, train=train,
                                                          dtype=dtype, device=device))
    got = _step(fn, inputs, names, train=train, dtype=dtype, device=device)
    ok, worst, what, _ = agree(want, got, dtype)
    if ok:
        return GraphCheck(True, how, worst)
    failed = GraphCheck(False, f"{how}, first in the {what}", worst)
    # the rewrite's own verdict, whatever way it runs and in whatever dtype
    exact_rewrite = dict(way=REWRITE_EXACT, train=train, dtype=None, device=device)
    before = verified_before(reference, planned, inputs, store=store, **exact_rewrite)
    wide = functools.cache(lambda: _wide(inputs))  # made only where something runs in float64
    try:
        want64 = reference_step(f"{run} float64", lambda: _step(
            float64(reference), wide(), names, train=train, dtype=None, device=device))
        if before is None:
            got64 = _step(float64(planned), wide(), names, train=train, dtype=None, device=device)
    except Exception:  # a graph that cannot run in float64: no re-check
        return failed
    if before is None:
        exact, error64, _, _ = agree(want64, got64, torch.float32)
        if not exact:
            return failed
        _keep_verdict(store, reference, planned, inputs,
                      GraphCheck(True, REWRITE_EXACT, error64), **exact_rewrite)
    # rounding moves the plan's run about as far from float64 as the graph's own: a kernel
    # wrong in this dtype alone (the rewrite exact) moves it by the size of the values
    original_off, got_off = agree(want64, want, dtype)[1], agree(want64, got, dtype)[1]
    if not rounding_only(original_off, got_off, dtype):
        return GraphCheck(False, f"{how}: {got_off:.2g} from the graph in float64, where the "
                          f"graph's own {dtype_name(dtype)} run is {original_off:.2g} from it "
                          f"(first in the {what})", worst)
    error64 = error64 if before is None else before["error"]
    return GraphCheck(True, f"{how}; beyond {dtype_name(dtype)} tolerance only by rounding "
                      f"(the rewrite in float64: {error64:.2g}"
                      f"{'' if before is None else ', checked before'})", worst)


def verify_once(reference: fx.GraphModule, planned: fx.GraphModule, fn: Callable[..., Any],
                inputs: list[Any], *, store: CostCache | None, way: str, train: bool,
                dtype: torch.dtype | None, device: torch.device, compiled: bool = True,
                reference_steps: dict[str, Step] | None = None) -> GraphCheck:
    """``verify_graph``, once per graph and plan: a plan that passed before (``store`` holds
    its verdict for this graph, this rewrite, the same input shapes, strides and dtypes, this
    ``way`` of running it and this torch on this machine) is not run again; its check says
    so. A graph that draws random numbers is checked eagerly whatever the way (its dropouts
    off), so its verdict holds for every way. A failed check is never kept: the next compile
    checks again."""
    before = verified_before(reference, planned, inputs, store=store, way=way, train=train,
                             dtype=dtype, device=device)
    if before is not None:
        return GraphCheck(True, f"{before['how']} (verified before: this graph, plan and torch)",
                          before["error"])
    check = verify_graph(reference, planned, fn, inputs, train=train, dtype=dtype,
                         device=device, compiled=compiled, store=store,
                         reference_steps=reference_steps)
    if check.ok:
        _keep_verdict(store, reference, planned, inputs, check, way=way, train=train,
                      dtype=dtype, device=device)
    return check


def _keep_verdict(store: CostCache | None, reference: fx.GraphModule, planned: fx.GraphModule,
                  inputs: list[Any], check: GraphCheck, **where: Any) -> None:
    """A passing ``check`` kept in ``store`` for :func:`verified_before` (``where``: its way,
    training, dtype and device)."""
    if store is not None:
        store.put(_verdict_key(reference, planned, inputs, **where),
                  {"how": check.how, "error": check.error}, is_noisy=False)


def verified_before(reference: fx.GraphModule, planned: fx.GraphModule, inputs: list[Any], *,
                    store: CostCache | None, way: str, train: bool, dtype: torch.dtype | None,
                    device: torch.device) -> dict[str, Any] | None:
    """The passing verdict ``store`` keeps for this graph and plan run this ``way``
    (:func:`verify_once`), if it keeps one."""
    if store is None:
        return None
    return store.get(_verdict_key(reference, planned, inputs, way=way, train=train,
                                  dtype=dtype, device=device), _valid_verdict)


def _verdict_key(reference: fx.GraphModule, planned: fx.GraphModule, inputs: list[Any], *,
                 way: str, train: bool, dtype: torch.dtype | None, device: torch.device) -> str:
    if draws_random(reference):  # checked eagerly, dropout off, whatever the way
        way = "eager, dropout off"
    return json.dumps(["backend-verified", measured_on(device), torch.__version__, str(dtype),
                       "train" if train else "infer", way, graph_signature(reference, inputs),
                       graph_signature(planned, inputs)])


def _valid_verdict(record: Any) -> bool:
    return (isinstance(record, dict) and isinstance(record.get("how"), str)
            and (record.get("error") is None or isinstance(record["error"], (int, float))))


def _random_check(reference: fx.GraphModule, planned: fx.GraphModule, inputs: list[Any],
                  names: list[str], *, train: bool, dtype: torch.dtype | None,
                  device: torch.device) -> GraphCheck:
    """The planned graph against the original, both eager with their dropouts off (a mask
    depends on the layout it is drawn in, and Inductor's random stream is not eager's). A
    graph that draws other random numbers (stochastic depth's ``bernoulli_``) runs both from
    one seed: where its draws do not depend on layout they agree; where they differ the
    graph is not compared, and the check says so."""
    calm = [_without_dropout(g) for g in (reference, planned)]
    random = any(draws_random(g) for g in calm)
    how = ("the plan vs the graph, eagerly, dropout off" + (", gradients" if train else "")
           + (", from one random seed" if random else ""))

    def run(g: fx.GraphModule, xs: list[Any], run_dtype: torch.dtype | None) -> Step:
        with seam(device).fork_rng():
            torch.manual_seed(0)
            return _step(g, xs, names, train=train, dtype=run_dtype, device=device)

    want, got = (run(g, inputs, dtype) for g in calm)
    ok, worst, what, _ = agree(want, got, dtype)
    if ok:
        return GraphCheck(True, how, worst)
    try:
        want64, got64 = (run(float64(g), _wide(inputs), None) for g in calm)
    except Exception:  # a graph that cannot run in float64: no re-check
        return GraphCheck(False, f"{how}, first in the {what}", worst)
    exact, error64, _, _ = agree(want64, got64, torch.float32)
    exact = exact and rounding_only(agree(want64, want, dtype)[1], agree(want64, got, dtype)[1],
                                    dtype)
    if exact:
        return GraphCheck(True, f"{how}; rounding only (float64: {error64:.2g})", worst)
    if random:
        return GraphCheck(True, "not compared: the graph draws random numbers that differ by "
                          f"layout (first in the {what})", None)
    return GraphCheck(False, f"{how}, first in the {what}", worst)


def _wide(inputs: list[Any]) -> list[Any]:
    """Float64 copies of ``inputs`` that need a gradient where they do (in any grad mode):
    their float64 step compares tensor by tensor with the run dtype's."""
    return [w.detach().requires_grad_(x.requires_grad)
            if isinstance(w, torch.Tensor) and w.is_floating_point() else w
            for x, w in zip(inputs, float64(inputs), strict=True)]


def _without_dropout(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose dropouts return their input (``native_dropout``, which also
    returns its mask, is left as it is)."""
    work = copy_graph(gm)
    for n in list(work.graph.nodes):
        if (n.op in ("call_function", "call_method") and "dropout" in op_name(n)
                and op_name(n) != "native_dropout" and n.args
                and isinstance(n.args[0], fx.Node)):
            n.replace_all_uses_with(n.args[0])
            work.graph.erase_node(n)
    work.recompile()
    return work


def _step(fn: Callable[..., Any], inputs: list[Any], names: list[str], *, train: bool,
          dtype: torch.dtype | None, device: torch.device) -> Step:
    """What one call of ``fn`` on fresh copies of ``inputs`` (named ``names``) computes: its
    outputs, the inputs that need no gradient after it (changed in place: running
    statistics) and, in training, the gradient of every input that requires grad for
    ``verify.training_loss``."""
    xs = fresh_inputs(inputs)
    # non-leaf copies with the same strides: a graph that works on an input in place must not
    # fail on a leaf that needs a gradient
    args = clone_inputs(xs, requires_grad_only=True)
    with torch.set_grad_enabled(train), autocast(device, dtype):
        out = fn(*args)
    state = {name: x for name, x in zip(names, xs, strict=False)
             if isinstance(x, torch.Tensor) and not x.requires_grad}
    leaves = {name: x for name, x in zip(names, xs, strict=False)
              if isinstance(x, torch.Tensor) and x.requires_grad}
    grads: dict[str, torch.Tensor | None] = {}
    if train and leaves and any(t.requires_grad for t in iter_tensors(out)):
        got = torch.autograd.grad(training_loss(out), list(leaves.values()), allow_unused=True)
        grads = {name: g if g is not None else torch.zeros_like(x)
                 for (name, x), g in zip(leaves.items(), got, strict=True)}
    return Step([t.detach() for t in iter_tensors(out)], grads, [], state, {})


def draws_random(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` draws random numbers (a dropout in training mode, ``rand``, ...)."""
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method") or op_name(n) not in _RANDOM:
            continue
        if "dropout" in op_name(n):
            training = n.kwargs.get("training", n.kwargs.get("train",
                                    n.args[2] if len(n.args) > 2 else True))
            if training is False:
                continue
        return True
    return False


def cached_guard(names: list[str], planned: fx.GraphModule, inputs: list[Any], *,
                 store: CostCache, margin: float, train: bool, dtype: torch.dtype | None,
                 device: torch.device, compiled_as: str) -> Race | None:
    """The guard's race for these ways (``names``) of running ``planned`` on ``inputs``,
    compiled as ``compiled_as`` says (Inductor's mode and options), when ``store`` holds one
    that stands (measured on a quiet machine, not a close call left unsettled); else
    ``None``."""
    race = guard.stored(store, guard_key(names, planned, inputs, train=train, dtype=dtype,
                                          device=device, compiled_as=compiled_as))
    if race is None or race.busy or not race.settled(margin):
        return None
    return race


def guard_graph(candidates: Mapping[str, Callable[[], Callable[..., Any]]],
                planned: fx.GraphModule, inputs: list[Any], *, store: CostCache | None,
                rounds: int, margin: float, train: bool, dtype: torch.dtype | None,
                device: torch.device, compiled_as: str) -> Race:
    """Time the ways to run one graph interleaved (``candidates``: name -> a function making
    it; ``Runner.PLAN_COMPILED``: the compiled plan, the race's reference, the one kept unless another is faster by more than
    ``margin``), or read the record from ``store`` (``cached_guard``); a close call the
    compiled plan could lose by is timed for twice the rounds (``memlayout.plan.check.guard``,
    ``Race.is_close`` with Inductor's own protected). A candidate is made only when it
    is timed. ``race.kept(Runner.PLAN_COMPILED, margin)`` names the fastest."""
    names = list(candidates)
    where = dict(train=train, dtype=dtype, device=device, compiled_as=compiled_as)
    if store is not None:
        cached = cached_guard(names, planned, inputs, store=store, margin=margin, **where)
        if cached is not None:
            return cached
    steps = {name: _timed_step(make(), inputs, train, dtype, device)
             for name, make in candidates.items()}
    # a close call is timed longer where the compiled plan could lose by it: to the plan run
    # eagerly where that one would be kept, to what torch.compile alone runs either way
    race = guard.time_steps(steps, device=device, rounds=rounds, margin=margin,
                            reference=Runner.PLAN_COMPILED, protect=(Runner.INDUCTOR_OWN,))
    if store is not None and not race.errors:
        guard.save(store, guard_key(names, planned, inputs, **where), race)
    return race


def compiled_with_backward(store: CostCache | None, gm: fx.GraphModule, inputs: list[Any], *,
                           device: torch.device, compiled_as: str, keep: bool = False) -> bool:
    """Whether a compile of ``gm`` (training) compiled its backward with its forward, into
    the Inductor cache this process uses (``keep``: say that one did). AOTAutograd's cache
    key holds that setting: a later compile of the same graph that left its backward lazy
    would miss what Inductor's cache holds, and compile both again."""
    if store is None:
        return False
    key = json.dumps(["backend-backward-with-forward", measured_on(device), torch.__version__,
                      compiled_as, _inductor_cache(), graph_signature(gm, inputs)])
    if keep:
        store.put(key, {"with_forward": True}, is_noisy=False)
        return True
    return store.get(key, lambda record: isinstance(record, dict)) is not None


def _inductor_cache() -> str:
    """The folder of Inductor's on-disk caches in this process."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # a torch that keeps it elsewhere: the setting that names it
        import os

        return os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
    return cache_dir()


def forget_guard(store: CostCache | None, names: list[str], planned: fx.GraphModule,
                 inputs: list[Any], *, train: bool, dtype: torch.dtype | None,
                 device: torch.device, compiled_as: str) -> None:
    """Drop the race :func:`guard_graph` stored for these ways of running ``planned`` (the way
    it kept failed its check: a later compile races again)."""
    if store is not None:
        store.delete(guard_key(names, planned, inputs, train=train, dtype=dtype,
                                device=device, compiled_as=compiled_as))


def guard_key(names: list[str], planned: fx.GraphModule, inputs: list[Any], *, train: bool,
               dtype: torch.dtype | None, device: torch.device, compiled_as: str) -> str:
    # the key names how a training step is timed: its gradients go into .grad (_timed_step)
    return json.dumps(["backend-guard", guard.RACE, measured_on(device), torch.__version__, str(dtype),
                       "train into .grad" if train else "infer", sorted(names), compiled_as,
                       graph_signature(planned, inputs)])


def _timed_step(fn: Callable[..., Any], inputs: list[Any], train: bool,
                dtype: torch.dtype | None, device: torch.device) -> Callable[[], Any]:
    """One call of ``fn`` (in training: forward and backward for a fixed output gradient)
    on copies of ``inputs`` made once. The backward accumulates into each input's ``.grad``
    (cleared after the step), as a training step does: a gradient that comes out in other
    strides than its parameter's (a weight the plan converted) is copied into the
    parameter's by autograd's layout contract, and that copy is part of the step's time.
    Parameters (lifted by Dynamo) are handed over as the same tensors every call, as a
    training loop does: CUDA graphs (``mode="reduce-overhead"``) keep their addresses; other
    inputs that need a gradient are cloned per call (a forward may work on them in place)."""
    xs = fresh_inputs(inputs)
    leaves = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
    per_call = [isinstance(x, torch.Tensor) and x.requires_grad
                and not isinstance(original, nn.Parameter)
                for x, original in zip(xs, inputs, strict=True)]
    grads: list[torch.Tensor] = []

    def step() -> Any:
        args = [x.clone() if clone else x for x, clone in zip(xs, per_call, strict=True)]
        with torch.set_grad_enabled(train), autocast(device, dtype):
            out = fn(*args)
        outs = [t for t in iter_tensors(out) if t.requires_grad]
        if train and outs and leaves:
            if not grads:
                grads.extend(torch.randn_like(t) for t in outs)
            torch.autograd.backward(outs, grads, inputs=leaves)
            for x in leaves:
                x.grad = None
        return out
    return step


def graph_signature(gm: fx.GraphModule, inputs: list[Any]) -> str:
    """A hash of a graph's code and its inputs' shapes, strides and dtypes."""
    h = hashlib.sha256(gm.code.encode())
    for x in inputs:
        if isinstance(x, torch.Tensor):
            h.update(f"{list(x.shape)}{list(x.stride())}{x.dtype}{x.requires_grad}".encode())
        else:
            h.update(repr(x).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class GraphCheck:
    """How a planned graph compared with the original (``how``: what was compared), and its
    worst relative error."""

    ok: bool
    how: str
    error: float | None
