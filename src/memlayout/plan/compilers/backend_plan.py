"""Planning one Dynamo graph for the ``torch.compile`` backend (``backend.py``): the graph
propagated on real inputs, its costs measured (or another rank's taken), the minimum cut
solved (solved again after measuring once more the convolutions that make it differ from
Inductor's rule: :func:`to_confirm`) and a rewritten copy made; and Inductor's own
whole-graph layout rule, for the report."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch._dynamo.exc
import torch._functorch.config
from torch import fx, nn

from memlayout.dtypes import autocast
from memlayout.errors import MemlayoutError, first_line
from memlayout.plan.capture.regions import propagate
from memlayout.plan.compilers.backend_check import graph_signature
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
    BackendWarning,
    ConvolutionChoice,
    convolution_nodes,
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
from memlayout.tensors import to_dense
from memlayout.timing import KEEP_MARGIN

if TYPE_CHECKING:
    from memlayout.plan.compilers.backend import Backend


@dataclass(frozen=True)
class Planned:
    """A graph's plan: the rewritten copy, its costs, the conversions made, each
    convolution's choice, the weights converted on every call (name, bytes) and the solved
    labels (node name -> label)."""

    graph: fx.GraphModule
    table: CostTable
    conversions: int
    convolutions: tuple[ConvolutionChoice, ...]
    weights: tuple[tuple[str, int], ...] = ()
    labels: tuple[tuple[str, Label], ...] = ()
    #: ``False``: no cut solved, nothing rewritten: by the convolutions' costs alone every
    #: plan agrees with Inductor's rule (:func:`every_plan_agrees`), so Inductor's own layouts
    #: run, and each convolution's format is Inductor's
    solved: bool = True


def plan_graph(gm: fx.GraphModule, inputs: list[Any], options: Backend, *, train: bool,
               dtype: torch.dtype | None, device: torch.device,
               rule: bool | None = None, store: CostCache | None = None,
               decided: tuple[CostTable, Mapping[str, Label]] | None = None) -> Planned:
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
        convolutions_first = not train and options.guard and options.measure and rule is not None
        table = measure_costs(work, tuple(fresh_inputs(inputs)), dtype=dtype,
                              measure=options.measure, cache=store if options.measure else None,
                              rounds=options.rounds, train=train, device=device,
                              **_convolutions_only(work) if convolutions_first else {})
        if convolutions_first:
            choices = convolution_nodes(work, table, {}, rule)
            if every_plan_agrees([choice for _, choice in choices]):
                return Planned(work, table, 0, tuple(_as_inductors(c) for _, c in choices),
                               solved=False)
            table = _the_rest(work, inputs, table, store=store, rounds=options.rounds,
                              dtype=dtype, device=device)
    else:
        table = decided[0]
    form = formulate(work, table, input_label=None, output_label=Request.KEEP)
    labels = solve_labels(form.integer) if decided is None else dict(decided[1])
    choices = convolution_nodes(work, table, labels, rule)
    if decided is None and options.measure and (again := to_confirm(choices, table)):
        table = measured_again(work, inputs, table, again, options=options, store=store,
                               dtype=dtype, train=train, device=device)
        form = formulate(work, table, input_label=None, output_label=Request.KEEP)
        labels = solve_labels(form.integer)
        choices = convolution_nodes(work, table, labels, rule)
    convolutions = tuple(choice for _, choice in choices)
    _, made = rewrite(nn.Module(), work, form, labels)
    weights = converted_weights(work, inputs, [value for value, _, _ in made])
    if train:
        grads_in_parameter_strides(work, inputs)
    if is_dynamic(gm):
        traced_conversions(work)
    return Planned(work, table, len(made), convolutions, weights, tuple(sorted(labels.items())))


def every_plan_agrees(convolutions: Sequence[ConvolutionChoice],
                      margin: float = KEEP_MARGIN) -> bool:
    """Whether :func:`agrees_with_inductor` holds for every plan of a graph whose
    convolutions are ``convolutions`` (their formats as traced, their costs measured),
    whatever its other nodes and conversions cost: putting each convolution in its faster
    format would save at most ``margin`` of the least time the convolutions can take. The
    gain of any plan is no larger, and its convolutions' time no smaller, so an inference
    graph needs nothing else measured to run Inductor's own layouts.

    >>> def conv(inductor, seconds):
    ...     return ConvolutionChoice("c", "conv2d", (8, 3, 8, 8), "contiguous", inductor,
    ...                              seconds, True)
    >>> cl = "channels_last"
    >>> every_plan_agrees([conv(cl, (1.0, 0.5)), conv("contiguous", (1.0, 2.0))])
    True
    >>> every_plan_agrees([conv(cl, (1.0, 2.0)), conv(cl, (0.9, 1.0))])  # 0.1 s of 1.9 s
    False
    >>> every_plan_agrees([conv(cl, (1.0, None))]), every_plan_agrees([conv(None, (1.0, 1.0))])
    (False, False)
    """
    if not convolutions:
        return False
    total, gain = 0.0, 0.0
    for c in convolutions:
        if c.inductor is None or c.planned is None:
            return False  # a format no plan states: not known to agree
        if Label.EITHER.text in (c.planned, c.inductor):
            continue  # in both formats at once: never differs, its time not counted
        theirs = c.seconds_in(c.inductor)
        if theirs is None:
            return False
        best = min(s for s in c.seconds or () if s is not None)
        gain += theirs - best
        total += best
    return gain <= margin * total


def _as_inductors(choice: ConvolutionChoice) -> ConvolutionChoice:
    """``choice`` run in Inductor's format (an input in both formats stays in both)."""
    return (choice if choice.planned == Label.EITHER.text
            else dataclasses.replace(choice, planned=choice.inductor))


def _convolutions_only(work: fx.GraphModule) -> dict[str, Any]:
    """``measure_costs``' arguments that cost ``work``'s convolutions alone."""
    names = frozenset(name for name, _ in convolution_nodes(work, CostTable(), {}, None))
    return {"only": names, "conversions": False}


def _the_rest(work: fx.GraphModule, inputs: list[Any], table: CostTable, *,
              store: CostCache | None, rounds: int, dtype: torch.dtype | None,
              device: torch.device) -> CostTable:
    """``table`` (an inference graph's convolutions) with the graph's other nodes and its
    conversions costed; the counts of both passes."""
    return _both(table, measure_costs(work, tuple(fresh_inputs(inputs)), dtype=dtype,
                                      cache=store, rounds=rounds, device=device,
                                      previous=table))


def _both(first: CostTable, second: CostTable) -> CostTable:
    """``second`` (a pass that kept what ``first`` held) with the counts of both passes."""
    return dataclasses.replace(second, measured=first.measured + second.measured,
                               cached=first.cached + second.cached,
                               fresh=first.fresh | second.fresh)


def to_confirm(choices: list[tuple[str, ConvolutionChoice]], table: CostTable,
               margin: float = KEEP_MARGIN) -> frozenset[str]:
    """The convolutions to measure again before a plan is taken to differ from Inductor's
    rule (and so to be compiled and raced against Inductor's own): those it puts in another
    format and this pass timed, where by their costs the plan saves more than ``margin``
    (:func:`agrees_with_inductor`). The cut picked them by their costs, noise included: a
    format that read faster by chance is among them more often than not. Measured again,
    independently, their costs decide; what the cache holds was decided on before."""
    if convolutions_agree([choice for _, choice in choices], margin):
        return frozenset()
    return frozenset(name for name, choice in choices if choice.differs and name in table.fresh)


def measured_again(work: fx.GraphModule, inputs: list[Any], table: CostTable,
                   names: frozenset[str], *, options: Backend, store: CostCache | None,
                   dtype: torch.dtype | None, train: bool, device: torch.device) -> CostTable:
    """``table`` with the nodes ``names`` measured again, their new costs replacing the
    first ones (in ``store`` too); the counts of both passes."""
    with store.remeasuring() if store is not None else contextlib.nullcontext():
        again = measure_costs(work, tuple(fresh_inputs(inputs)), dtype=dtype, cache=store,
                              rounds=options.rounds, train=train, device=device,
                              previous=table, timed=names)
    return _both(table, again)  # read nothing from the cache (remeasuring)


def traced_conversions(gm: fx.GraphModule) -> None:
    """The rewrite's conversions as ``to_label`` calls, which trace with symbolic sizes (the
    layout algebra's cached stride rules hash sizes, and a symbolic size has no hash)."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is convert_value:
            n.target = to_label
        elif n.op == "call_function" and n.target is convert_value_1d:
            n.target, n.args = to_label, (*n.args, CONV1D_RANKS)
    gm.recompile()


def to_label(value: Any, label: Label, ranks: tuple[int, ...]) -> Any:
    """Every tensor in ``value`` of a rank in ``ranks`` dense in ``label``'s format
    (``CHANNELS_LAST``: N L C, channels_last, channels_last_3d by rank; ``CONTIGUOUS``:
    contiguous), by ``contiguous`` (its gradient back in the source's format, ``to_dense``): a
    no-op for a tensor already dense in it; other values unchanged.

    >>> to_label((torch.empty(2, 3, 4, 4), 1), Label.CHANNELS_LAST, (4, 5))[0].stride()
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
    shape env (``in_dynamos_mode``: fast, and symbolic where Dynamo's sizes are, as
    Inductor sees them); a graph that does not trace there (one that reads a value, such as
    a float Dynamo passes as a tensor) is traced on real inputs of its sizes instead."""
    try:
        from torch._inductor.graph import GraphLowering

        decide = GraphLowering.decide_layout_opt
    except (ImportError, AttributeError):
        return None
    for trace in (in_dynamos_mode, on_real_inputs):
        try:
            aten = trace(gm, example_inputs, dtype=dtype, device=device)
            return bool(decide(aten, is_inference=not train))
        except Exception:  # untraceable this way, or a changed internal: the next, or no answer
            continue
    return None


def in_dynamos_mode(gm: fx.GraphModule, example_inputs: list[Any], *,
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


def on_real_inputs(gm: fx.GraphModule, example_inputs: list[Any], *,
                    dtype: torch.dtype | None, device: torch.device) -> fx.GraphModule:
    """``gm`` traced to aten from real inputs made of ``example_inputs`` (``real_inputs``),
    outside Dynamo's tracing context, every size symbolic in a dynamic graph."""
    from torch.fx.experimental.proxy_tensor import make_fx

    inputs = fresh_inputs(real_inputs(example_inputs))
    with torch._guards.tracing(None), torch.no_grad(), autocast(device, dtype):
        return make_fx(gm, tracing_mode="symbolic" if is_dynamic(gm) else "fake",
                       _allow_non_fake_inputs=True)(*inputs)


def cached_rule(gm: fx.GraphModule, example_inputs: list[Any], inputs: list[Any],
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


#: the record's verification of an inference graph no plan of which could differ from
#: Inductor's rule (:func:`every_plan_agrees`)
NONE_DIFFERS = ("the plan not made: by the convolutions' measured costs no plan could save "
                "the keep margin over Inductor's rule, so Inductor's own layouts run, not timed "
                "against it, and nothing else was measured")
#: the record's verification of a graph whose plan agrees with Inductor's rule
AGREES = ("the plan not run: its convolutions' formats save less than the keep margin over "
          "Inductor's rule's, by their measured costs, so Inductor's own layouts run, not "
          "timed against it")


def inductor_runs_a_fault(planned: Planned) -> bool:
    """Whether Inductor's own layouts would run a convolution channels-last that must never
    run so (``memlayout.plan.costs.faults``): not a way the guard may time or keep.

    >>> def conv(fault, inductor):
    ...     return ConvolutionChoice("c", "conv2d", (1, 3, 8, 8), "contiguous", inductor,
    ...                              None, True, fault)
    >>> [inductor_runs_a_fault(Planned(None, None, 0, (conv(f, i),)))
    ...  for f, i in (("a fault", "channels_last"), ("a fault", None),
    ...               ("a fault", "contiguous"), ("", "channels_last"))]
    [True, True, False, False]
    """
    return any(c.fault and c.inductor != Label.CONTIGUOUS.text for c in planned.convolutions)


def agrees_with_inductor(planned: Planned, margin: float = KEEP_MARGIN) -> bool:
    """Whether the plan's convolutions (one at least, each with a format Inductor's rule
    states) would save less than ``margin`` of their time in the formats the rule gives them:
    by their costs, the convolutions where the two differ cost less in the plan's format
    than in Inductor's by less than ``margin`` times every convolution's planned time (so
    each agreeing, or a difference within the costs' own noise). The conversions the plan
    needs around them are left out: they only make its gain smaller.

    >>> def conv(planned, inductor, seconds=(1.0, 1.0)):
    ...     return ConvolutionChoice("c", "conv2d", (1, 3, 8, 8), planned, inductor, seconds, True)
    >>> def plan(*convolutions):
    ...     return Planned(None, None, 0, convolutions)
    >>> cl, c = "channels_last", "contiguous"
    >>> agrees_with_inductor(plan(conv(cl, cl), conv(c, c)))
    True
    >>> agrees_with_inductor(plan(*[conv(cl, cl)] * 9, conv(c, cl, (0.99, 1.0))))  # 1 % of 10 s
    True
    >>> agrees_with_inductor(plan(conv(cl, cl), conv(c, cl, (0.5, 1.0))))  # 0.5 s of 1.5 s
    False
    >>> agrees_with_inductor(plan()), agrees_with_inductor(plan(conv(cl, None)))
    (False, False)
    """
    return convolutions_agree(planned.convolutions, margin)


def convolutions_agree(convolutions: Sequence[ConvolutionChoice],
                       margin: float = KEEP_MARGIN) -> bool:
    """:func:`agrees_with_inductor` of a plan's convolution choices."""
    if not convolutions or any(c.inductor is None or c.planned is None for c in convolutions):
        return False
    gain = convolution_gain(convolutions)
    if gain is None:
        return False  # no cost to weigh: not known to agree
    return gain <= margin * sum(c.seconds_in(c.planned) or 0.0 for c in convolutions)


def convolution_gain(convolutions: Sequence[ConvolutionChoice]) -> float | None:
    """The seconds a plan's convolutions save, by their costs, in its formats over those
    Inductor's rule gives them, summed over the convolutions where the two differ (``None``:
    one of those without a cost in either format). The conversions the plan needs around
    them are left out: with them, the plan saves less.

    >>> cl, c = "channels_last", "contiguous"
    >>> convolution_gain([ConvolutionChoice("a", "conv2d", (1, 3, 8, 8), c, cl, (1.0, 3.0), True),
    ...                   ConvolutionChoice("b", "conv2d", (1, 3, 8, 8), cl, cl, (9.0, 1.0), True)])
    2.0
    """
    gain = 0.0
    for c in convolutions:
        if c.differs:
            mine, theirs = c.seconds_in(c.planned), c.seconds_in(c.inductor)
            if mine is None or theirs is None:
                return None
            gain += theirs - mine
    return gain


def not_planned_reason(exc: Exception, graph: str) -> str:
    """Why ``graph`` runs unplanned: the planner's own reason (``NotPlanned``), or its failure,
    which is warned of too."""
    if isinstance(exc, NotPlanned):
        return str(exc)
    warnings.warn(f"memlayout backend: graph {graph} could not be planned "
                  f"({type(exc).__name__}: {first_line(exc)}); it is compiled with "
                  "Inductor's own layouts", BackendWarning, stacklevel=3)
    return f"planning failed: {type(exc).__name__}"
