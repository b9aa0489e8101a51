"""Costs (L2 plan, step 2): each layout node's time in each format, and each conversion's.

A *layout node* is a graph node that takes a rank-4/5 tensor whose format is a choice (a value
in one definite format, or a rank-4/5 parameter) or owns rank-4/5 parameters (a convolution).
Each one is run with its inputs (and weights) in each format on the example's device, shape
and dtype: what format its output really comes back in is recorded (GroupNorm, pads, views
drop channels-last; a view may even fail), and, unless the op is layout-agnostic (elementwise,
activations: same kernel either way), how long it takes, through ``memlayout.timing``. Each
value in a definite format gets the time of converting it either way.

Each op's time is the fastest of its interleaved rounds: on a shared machine the noise only ever
adds time, so the minimum is the least disturbed estimate of the op itself. The rounds are a
sequential test, ``rounds`` at most: an op's formats stop once every round puts them on the same
side (or every round within ``timing.KEEP_MARGIN`` of each other: a tie, whichever the cut
takes), after ``timing.SEQUENTIAL_ROUNDS`` at least; a conversion once its rounds agree within
``timing.STEADY``. What more rounds would refine is not what moves the cut. A measurement whose
rounds spread more than ``machine.SPREAD_LIMIT`` is taken again (at most ``RETRIES`` times);
one still spread that far, or taken while the machine was busy (load above the cores), is
*noisy*: ``NodeCost.noisy`` / ``ConversionCost.noisy`` say so, and the plan counts them.

Measurements are cached (``memlayout.plan.costs.cache``), keyed by device name, torch version,
autocast dtype, op, shapes, strides and dtype, and the machine's fingerprint, with the
conditions they were taken under: a second plan of the same model measures nothing, except what
was taken on a busy machine, when this one is quiet now. ``measure=False`` runs each layout node once per format (formats only) and
uses an analytical cost model (``memlayout.plan.costs.analytical``) instead of timing; the records
and which nodes are layout nodes are in ``memlayout.plan.costs.table``.

A node torch's kernels run wrongly channels-last (``memlayout.plan.costs.faults``), or one whose
channels-last run took an earlier planning process down (``memlayout.plan.costs.attempts``:
each node's measurement is recorded in the cache while it runs), is never run channels-last.

With a fitted cost model (``memlayout.plan.costs.predict``), a node the cache does not hold is
*predicted* instead (run once per format for its output's format, its seconds from the model,
its uncertainty in ``CostTable.predicted``), unless it is named in ``timed``; the solver's
refinement (``memlayout.plan.solve.refine``) names the nodes whose costs could change the
cut, and measures them in another pass that keeps what the earlier one found (``previous``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from memlayout.devices import Device, seam
from memlayout.dtypes import autocast
from memlayout.layout import strides_for
from memlayout.machine import Conditions, busier, noisy
from memlayout.plan.convert import convert_module_to, convert_value, fresh_value
from memlayout.plan.costs.analytical import analytical_seconds
from memlayout.plan.costs.attempts import attempting, crashed
from memlayout.plan.costs.cache import CostCache
from memlayout.plan.costs.conversions import conversion_cost, look_up_conversions
from memlayout.plan.costs.faults import channels_last_fault
from memlayout.plan.costs.predict import CostModel, analytic_pair, op_kind, pair_id
from memlayout.plan.costs.table import (
    ConversionCost,
    CostTable,
    NodeCost,
    input_kind,
    is_agnostic,
    is_layout_node,
    measured_on,
    module_has_layout_params,
    valid_node_record,
)
from memlayout.plan.graph import (
    LABELS,
    META_KEY,
    Label,
    ValueMeta,
    graph_ranks,
    node_target_name,
    value_meta,
)
from memlayout.plan.options import Progress
from memlayout.plan.weights import (
    AS_IS,
    CONTIGUOUS,
    CONVERTED,
    PER_CALL,
    can_convert_per_call,
)
from memlayout.tensors import device_of, iter_tensors
from memlayout.timing import (
    KEEP_MARGIN,
    Comparison,
    interleaved,
    repeats_for,
    separated,
    steady,
)

#: how many times a measurement whose rounds spread beyond ``machine.SPREAD_LIMIT`` is taken
#: again before it is kept as noisy (a burst of another job passes; a steady load does not)
RETRIES = 2


# ---------------------------------------------------------------- measuring


def measure_costs(gm: fx.GraphModule, inputs: tuple[Any, ...], *,
                  dtype: torch.dtype | None = None, measure: bool = True,
                  cache: CostCache | None = None, rounds: int = 5,
                  progress: Progress | None = None, train: bool = False,
                  device: torch.device | None = None, weights: str = CONVERTED,
                  clock: Callable[[], float] = time.perf_counter,
                  conditions: Callable[[], Conditions] = Conditions.now,
                  model: CostModel | None = None, timed: frozenset[str] = frozenset(),
                  previous: CostTable | None = None, only: frozenset[str] | None = None,
                  conversions: bool = True) -> CostTable:
    """The cost table of every layout node and definite-format value of a captured graph.

    ``train``: a node's cost is its forward plus its backward (gradients of its inputs and
    parameters for a gradient of its output's strides), cached under keys that say so; a
    conversion costs its forward copy plus the reverse copy of its gradient in the backward
    (``to_1 + to_0`` either way). ``device``: where it runs (default: the inputs').
    ``weights=CONTIGUOUS``: weights stay contiguous; a convolution's channels-last time is the
    faster of reading them as they are and converting them per call.
    ``clock`` and ``conditions`` (the machine's load) are injectable, so tests decide what a
    measurement sees.
    ``model`` (with ``measure``): each layout-sensitive node the cache does not hold and
    ``timed`` does not name is predicted, not timed. ``previous``: this graph's table from an
    earlier pass: its conversions and measured nodes are kept, its predicted ones predicted
    again from ``model`` (measured where ``timed`` names them, read from the cache where an
    identical op was measured since), and the nodes and conversions it lacks costed.
    ``only``: the layout nodes to cost (``None``: every one); ``conversions=False``: no
    conversion costed (a first pass that may make the rest unnecessary)."""
    device = device_of(inputs, gm) if device is None else device
    nodes_context = node_context(device, dtype, train=train, weights=weights)
    layout_nodes = [n for n in gm.graph.nodes
                    if is_layout_node(gm, n) and (only is None or n.name in only)]
    node_keys = {n.name: [json.dumps(["node", *nodes_context, _describe(gm, n, label), label])
                          for label in LABELS] for n in layout_nodes}
    table = CostTable(faults={n.name: why for n in layout_nodes if (
        why := channels_last_fault(gm, n, train=train, device=device)
        or crashed(cache, node_keys[n.name][1])) is not None})
    todo_nodes: dict[str, list[str]] = {}
    todo_predicted: dict[str, list[str]] = {}
    predicting = model is not None and measure
    for n in layout_nodes:
        keys = node_keys[n.name]
        old = previous.nodes.get(n.name) if previous is not None else None
        if old is not None and n.name not in timed and n.name not in previous.predicted:
            table.nodes[n.name] = old  # measured in an earlier pass
            continue
        entries = ([cache.entry(k, valid_node_record) for k in keys]
                   if cache is not None and measure else [None, None])
        if all(e is not None for e in entries):
            table.cached += old is None  # not one measured in an earlier pass of this run
            table.nodes[n.name] = _node_cost(gm, n, [e.value for e in entries], True,
                                             noisy=any(e.noisy for e in entries))
        elif predicting and n.name not in timed and not is_agnostic(gm, n):
            assert model is not None
            if old is not None:  # its formats are known: only its seconds change
                table.nodes[n.name], table.predicted[n.name] = _predicted_cost(
                    gm, n, old.seconds, old.out, old.weights, model, train=train)
            else:
                todo_predicted[n.name] = keys
        else:
            todo_nodes[n.name] = keys
    kept = previous.conversions if previous is not None else {}  # kept as they are
    todo_values = (look_up_conversions(gm, table, cache, device=device, dtype=dtype,
                                        measure=measure, known=frozenset(kept))
                   if conversions else {})
    total = len(todo_nodes) + len(todo_values) + len(todo_predicted)
    if total:
        runner = _Measurer(gm, todo_nodes, todo_values, table, measure=measure, cache=cache,
                           rounds=rounds, device=seam(device), progress=progress,
                           total=total, train=train, weights=weights, clock=clock,
                           conditions=conditions, model=model, predicted=todo_predicted)
        with torch.no_grad(), autocast(device, dtype):
            runner.run(*inputs)
    return _finished(table, kept, train=train)


def _finished(table: CostTable, kept: dict[str, ConversionCost], *, train: bool) -> CostTable:
    """``table`` as a pass leaves it: in training its new conversions cost both ways (a
    converted value's gradient is converted back), an earlier pass's ``kept`` ones added, and
    a faulting node's channels-last cost (cached or predicted) dropped."""
    if train:
        table.conversions = {
            name: ConversionCost(c.value, c.to_1 + c.to_0, c.to_0 + c.to_1, c.nbytes, c.shapes,
                                 c.timed, c.noisy)
            for name, c in table.conversions.items()}
    table.conversions.update(kept)
    for name in table.faults:  # a cached or predicted channels-last cost is not a way to run
        if (cost := table.nodes.get(name)) is not None:
            table.nodes[name] = dataclasses.replace(cost, seconds=(cost.seconds[0], None),
                                                    out=(cost.out[0], None))
    return table


def node_context(device: torch.device, dtype: torch.dtype | None, *, train: bool,
                 weights: str) -> list[str]:
    """What a node's cached timing depends on beside the op: the device's fingerprint, torch,
    the autocast dtype, and a training step or contiguous weights where they apply (a node
    key's elements after ``"node"``)."""
    context = [measured_on(device), torch.__version__, str(dtype)]
    if train:
        context.append("train")
    if weights != CONVERTED:
        context.append(f"weights={weights}")
    return context


def _node_cost(gm: fx.GraphModule, n: fx.Node, records: list[Any], timed: bool, *,
               noisy: bool = False) -> NodeCost:
    seconds = tuple(r["s"] for r in records)
    out = tuple(None if r["out"] is None else Label(r["out"]) for r in records)
    timed = timed and not is_agnostic(gm, n)
    return NodeCost(n.name, node_target_name(gm, n), seconds, out,  # type: ignore[arg-type]
                    timed, noisy=noisy and timed, weights=records[1].get("w"))


def _predicted_cost(gm: fx.GraphModule, n: fx.Node, seconds: tuple[float | None, float | None],
                    out: tuple[Label | None, Label | None], weights: str | None,
                    model: CostModel, *, train: bool) -> tuple[NodeCost, float]:
    """``n``'s cost predicted by ``model`` (``seconds``: ``None`` where a format fails, as
    its run found) and the uncertainty of its ``c1 - c0``."""
    a0, a1 = analytic_pair(gm, n, train=train)
    guess = model.predict(op_kind(gm, n), (None if seconds[0] is None else a0,
                                           None if seconds[1] is None else a1))
    return (NodeCost(n.name, node_target_name(gm, n), guess.seconds, out, False,
                     weights=weights), guess.width)


def _describe(gm: fx.GraphModule, n: fx.Node, label: Label) -> str:
    """The op and its inputs as they would be fed in ``label``: the cache key's op part."""
    if n.op == "call_module":
        sub = gm.get_submodule(n.target)
        op = f"module:{type(sub).__module__}.{type(sub).__qualname__}:{sub!r}:train={sub.training}"
    elif n.op == "call_function":
        op = f"function:{getattr(n.target, '__module__', '')}.{getattr(n.target, '__qualname__', repr(n.target))}"
    else:
        op = f"method:{n.target}"

    ranks = graph_ranks(gm)

    def arg(m: fx.Node) -> str:
        kind = input_kind(gm, m)
        meta: ValueMeta | None = m.meta.get(META_KEY)
        if meta is None:
            return "?"
        parts = []
        for t in meta.tensors:
            strides = t.strides
            if kind in ("term", "param") and len(t.shape) in ranks:
                strides = strides_for(t.shape, Label(label).format(len(t.shape)))
            parts.append(f"{t.dtype}{list(t.shape)}{list(strides)}")
        return "T(" + ",".join(parts) + ")"

    args = fx.node.map_arg((n.args, n.kwargs), arg)
    return f"{op}{args!r}"


class _Measurer(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, todo_nodes: dict[str, list[str]],
                 todo_values: dict[str, list[str]], table: CostTable, *, measure: bool,
                 cache: CostCache | None, rounds: int, device: Device,
                 progress: Progress | None, total: int, train: bool = False,
                 weights: str = CONVERTED,
                 clock: Callable[[], float] = time.perf_counter,
                 conditions: Callable[[], Conditions] = Conditions.now,
                 model: CostModel | None = None,
                 predicted: dict[str, list[str]] | None = None) -> None:
        super().__init__(gm)
        self.model, self.predicted = model, predicted or {}
        self.clock, self.conditions = clock, conditions
        self.ranks = graph_ranks(gm)
        self.train = train
        self.weights = weights
        self.todo_nodes, self.todo_values, self.table = todo_nodes, todo_values, table
        self.measure, self.cache, self.rounds = measure, cache, rounds
        self.device, self.sync = device, device.synchronize
        self.progress, self.total, self.done = progress, total, 0
        self.memo: dict[str, Any] = {}  # key -> record measured in this run
        self.memo_noisy: set[str] = set()  # of those, the noisy ones

    def _step(self, what: str) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total, what)

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.name in self.todo_nodes:
            keys = self.todo_nodes[n.name]
            if all(k in self.memo for k in keys):  # an identical op measured in this run
                self.table.nodes[n.name] = _node_cost(
                    self.module, n, [self.memo[k] for k in keys], self.measure,
                    noisy=any(k in self.memo_noisy for k in keys))
                if self.table.nodes[n.name].timed:
                    self.table.fresh.add(n.name)
            else:
                with attempting(self.cache, keys[1]):  # a crash here is remembered
                    self._measure_node(n)
            self._step(n.name)
        if n.name in self.predicted:
            assert self.model is not None
            with attempting(self.cache, self.predicted[n.name][1]):
                records, _, _ = self._formats(n)
            seconds = tuple(r["s"] for r in records)
            out = tuple(None if r["out"] is None else Label(r["out"]) for r in records)
            self.table.nodes[n.name], self.table.predicted[n.name] = _predicted_cost(
                self.module, n, seconds, out, records[1].get("w"),  # type: ignore[arg-type]
                self.model, train=self.train)
            self._step(f"{n.name} (predicted)")
        if n.name in self.todo_values:
            keys = self.todo_values[n.name]
            if all(k in self.memo for k in keys):
                self.table.conversions[n.name] = conversion_cost(
                    n.name, n.meta[META_KEY], [self.memo[k] for k in keys],
                    noisy=any(k in self.memo_noisy for k in keys))
            else:
                self._measure_conversion(n, result)
            self._step(f"{n.name} (conversion)")
        return result

    def _call(self, n: fx.Node, how: Label | str, *, grad: bool = False) -> Callable[[], Any]:
        """The node run on fresh inputs in label ``how``; ``grad``: a training step of it
        instead (forward, then the gradients of its inputs and parameters, see
        :func:`_train_step`). ``"1:per_call"``: in label 1, its contiguous weights converted
        per call."""
        gm = self.module
        # a Label's str() is its name before Python 3.11: the number, as an int, spelled out
        number, _, storage = (how if isinstance(how, str) else str(int(how))).partition(":")
        label = Label(int(number))
        wrt: list[torch.Tensor] = []
        args, kwargs = fx.node.map_arg((n.args, n.kwargs),
                                       lambda m: self._input(m, label, wrt if grad else None))
        if n.op == "call_module":
            target = gm.get_submodule(n.target)
            if module_has_layout_params(gm, n) or grad:  # a copy: training must not touch it
                target = copy.deepcopy(target)
            if module_has_layout_params(gm, n):
                target = convert_module_to(target, label, self.ranks,
                                           weights=storage or self.weights)
            wrt.extend(p for p in target.parameters() if p.requires_grad)
            fn: Callable[[], Any] = lambda: target(*args, **kwargs)  # noqa: E731
        elif n.op == "call_function":
            fn = lambda: n.target(*args, **kwargs)  # noqa: E731
        else:
            self_arg, *rest = args
            fn = lambda: getattr(self_arg, n.target)(*rest, **kwargs)  # noqa: E731
        return _train_step(fn, wrt) if grad else fn

    def _input(self, m: fx.Node, label: Label, wrt: list[torch.Tensor] | None = None) -> Any:
        kind = input_kind(self.module, m)
        if kind == "param" and self.weights != CONVERTED:
            kind, label = "term", Label.CONTIGUOUS  # weights stored contiguous whatever the node's label
        value = fresh_value(self.env[m], label if kind in ("term", "param") else None,
                            self.ranks)
        if wrt is not None and (m.op != "placeholder" or _requires_grad(self.env[m])):
            # in training every activation (and parameter) needs its gradient; a model input
            # does not, unless it requires grad (a Dynamo graph's parameters are its inputs).
            # ``value`` is a fresh copy: a leaf of its own.
            for t in _iter_float_tensors(value):
                if m.op != "get_attr" or getattr(self._attr(m.target), "requires_grad", False):
                    t.requires_grad_(True)
                    wrt.append(t)
        return value

    def _attr(self, target: str) -> Any:
        value: Any = self.module
        for part in target.split("."):
            value = getattr(value, part, None)
        return value

    def _formats(self, n: fx.Node) -> tuple[list[dict[str, Any]], dict[str, Callable[[], Any]],
                                            dict[str, float]]:
        """``n`` run once in each label: a record per label (its output's label, or the
        error: the format fails), the calls that worked and their first-call seconds."""
        records: list[dict[str, Any]] = []
        calls: dict[str, Callable[[], Any]] = {}
        first: dict[str, float] = {}
        for label in LABELS:
            if label == Label.CHANNELS_LAST and n.name in self.table.faults:
                records.append({"s": None, "out": None, "error": "fault"})
                continue  # never run so (memlayout.plan.costs.faults, .attempts)
            try:
                fn = self._call(n, label)
                self.sync()
                start = self.clock()
                out = fn()
                self.sync()
                first[str(int(label))] = self.clock() - start
                records.append({"s": 0.0, "out": value_meta(out, self.ranks).label})
                calls[str(int(label))] = fn
            except Exception as exc:  # this format does not work for this op: a fact
                records.append({"s": None, "out": None, "error": f"{type(exc).__name__}"})
        if self.weights == CONTIGUOUS and module_has_layout_params(self.module, n):
            records[1]["w"] = AS_IS
        return records, calls, first

    def _measure_node(self, n: fx.Node) -> None:
        gm = self.module
        timed = self.measure and not is_agnostic(gm, n)
        contiguous = self.weights == CONTIGUOUS and module_has_layout_params(gm, n)
        records, calls, first = self._formats(n)
        per_call = f"1:{PER_CALL}"
        if (contiguous and timed and "1" in calls
                and can_convert_per_call(gm.get_submodule(n.target))):
            # the other way to run channels-last on a contiguous weight: timed alongside
            try:
                fn = self._call(n, per_call)
                self.sync()
                start = time.perf_counter()
                fn()
                self.sync()
                first[per_call] = time.perf_counter() - start
                calls[per_call] = fn
            except Exception:  # reading the weight as it is works: that one stays
                pass
        if timed and calls and self.train:
            steps = self._train_calls(n, calls, first)
            if steps is None:  # no backward runs here (in place on a leaf): forward only
                for record in records:
                    if record["s"] is not None:
                        record["note"] = "forward only: its backward could not run alone"
            else:
                calls = steps
        quality = _Quality(None, None)
        if timed and calls:
            # sized from calls once warm: a GPU's first includes cuDNN's autotuning
            repeat = repeats_for(min(self.device.settle(fn, first[label], clock=self.clock)
                                     for label, fn in calls.items()))
            # the rounds stop once the formats are apart or tied: more would not move the cut
            result, quality = self._timed(calls, repeat=repeat, stop=(
                separated("0", 0.0, self.rounds, tie=KEEP_MARGIN)
                if "0" in calls and len(calls) > 1 else steady(self.rounds)))
            for label, timing in result.modes.items():
                if label != per_call:
                    records[int(label)]["s"] = timing.min if timing.ok else None
            if per_call in result.modes and result.modes[per_call].ok:
                s = result.modes[per_call].min
                if records[1]["s"] is None or s < records[1]["s"]:
                    records[1].update(s=s, w=PER_CALL)
            # what the cost model is fitted to (memlayout.plan.costs.predict)
            analytic = analytic_pair(gm, n, train=self.train)
            kind, pair = op_kind(gm, n), pair_id(self.todo_nodes[n.name][0])
            for label, record in enumerate(records):
                if record["s"] is not None:
                    record.update(a=analytic[label], k=kind, id=pair)
            self.table.measured += 1
            self.table.fresh.add(n.name)
        elif not self.measure and calls:
            for label in [c for c in calls if c != per_call]:
                # a backward does about twice the work of the forward
                scale = 3.0 if self.train else 1.0
                records[int(label)]["s"] = scale * analytical_seconds(gm, n, int(label))
        self.table.nodes[n.name] = _node_cost(gm, n, records, self.measure, noisy=quality.noisy)
        for key, record in zip(self.todo_nodes[n.name], records, strict=True):
            self._remember(key, record, quality)

    def _train_calls(self, n: fx.Node, calls: dict[str, Callable[[], Any]],
                     first: dict[str, float]) -> dict[str, Callable[[], Any]] | None:
        """A training step of ``n`` per working label (``first`` updated with the step's
        first-call time), or ``None`` when one of them fails."""
        steps: dict[str, Callable[[], Any]] = {}
        for label in calls:
            try:
                step = self._call(n, label, grad=True)
                self.sync()
                start = self.clock()
                step()
                self.sync()
                first[label] = self.clock() - start
            except Exception:
                return None
            steps[label] = step
        return steps

    def _measure_conversion(self, n: fx.Node, value: Any) -> None:
        meta: ValueMeta = n.meta[META_KEY]
        ranks = self.ranks
        v0, v1 = fresh_value(value, 0, ranks), fresh_value(value, 1, ranks)
        calls = {"to_1": lambda: convert_value(v0, 1, ranks),
                 "to_0": lambda: convert_value(v1, 0, ranks)}
        probe = interleaved(calls, rounds=1, warmup=1, sync=self.sync, clock=self.clock)
        quick = min(t.median for t in probe.modes.values())
        repeat = repeats_for(quick)
        result, quality = self._timed(calls, repeat=repeat, stop=steady(self.rounds))
        records = [{"s": result["to_1"].min}, {"s": result["to_0"].min}]
        self.table.measured += 1
        self.table.conversions[n.name] = conversion_cost(n.name, meta, records,
                                                          noisy=quality.noisy)
        for key, record in zip(self.todo_values[n.name], records, strict=True):
            self._remember(key, record, quality)

    def _timed(self, calls: dict[str, Callable[[], Any]], *, repeat: int,
               stop: Callable[[Mapping[str, Sequence[float]]], bool]
               ) -> tuple[Comparison, _Quality]:
        """``calls`` timed interleaved for at most ``self.rounds`` rounds, fewer where ``stop``
        says the rest could not change what they are for; taken again (at most ``RETRIES``
        times) while the rounds of a call spread beyond ``machine.SPREAD_LIMIT``. Returns the
        last comparison and its quality: the widest spread, and the busier conditions of
        before and after."""
        before = self.conditions()
        for _ in range(1 + RETRIES):
            result = interleaved(calls, rounds=self.rounds, warmup=0, repeat=repeat,
                                 sync=self.sync, clock=self.clock, stop=stop)
            spread = max((t.spread for t in result.modes.values() if t.ok), default=0.0)
            if not noisy(spread):
                break
        return result, _Quality(spread, busier(before, self.conditions()))

    def _remember(self, key: str, record: dict[str, Any], quality: _Quality) -> None:
        self.memo[key] = record
        if quality.noisy:
            self.memo_noisy.add(key)
        if self.cache is not None and self.measure:
            self.cache.put(key, record, spread=quality.spread, conditions=quality.conditions)


@dataclass(frozen=True)
class _Quality:
    """How far a measurement's rounds spread and what the machine was doing meanwhile
    (``None``: not timed, nothing to judge)."""

    spread: float | None
    conditions: Conditions | None

    @property
    def noisy(self) -> bool:
        return noisy(self.spread) or (self.conditions is not None and self.conditions.busy)


def _requires_grad(value: Any) -> bool:
    return any(t.requires_grad for t in iter_tensors(value))


def _iter_float_tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in iter_tensors(value) if t.is_floating_point()]


def _train_step(forward: Callable[[], Any], wrt: list[torch.Tensor]) -> Callable[[], Any]:
    """``forward`` with gradients on, then the gradients of ``wrt`` for an output gradient of
    ones with the output's strides (what the consumer's backward hands back), computed
    outside autocast as in the AMP recipe. Nothing accumulates into ``.grad``. No kernel's
    time depends on the gradient's values (a constant has no denormals); drawing a random
    one, as the gradient of a large activation, takes longer on a CPU than many an op's step."""
    grads: dict[int, list[torch.Tensor]] = {}

    def step() -> Any:
        with torch.enable_grad():
            out = forward()
        outs = [t for t in _iter_float_tensors(out) if t.requires_grad]
        if not outs or not wrt:
            return out
        if 0 not in grads:
            grads[0] = [torch.ones_like(t) for t in outs]
        device_type = outs[0].device.type
        with torch.autocast(device_type, enabled=False):
            torch.autograd.grad(outs, wrt, grads[0], allow_unused=True)
        return out
    return step
