"""The problem a steered model can realize (analysis): conversions only where a value crosses a
module call's boundary.

A planned model runs the user's own ``forward``, so the only places its layouts can change are
(a) each parameter's format and (b) a module call's inputs and outputs, where a steered module
converts a value (``memlayout.plan.steer``). Inside a module's own code eager propagation
decides: a value keeps the format it was produced in. So each value that leaves its producer
is a chain of *segments*, one per module-call scope it passes through on its way to each
consumer (up through the exits of the calls it was made in, down through the entries of the
calls it is used in); a segment's label is the value's format there. Two segments on either
side of a boundary may differ only where a steered model can convert there, at the cost of
one conversion of the value; everywhere else they are tied. A consumer runs in the label of
the segment it reads, its producer makes the first one.

A boundary converts only where all of this holds: the module is called once per forward (a
shared module's steering would apply at every call), the value is found among the call's
arguments or results (:func:`memlayout.plan.capture.calls.positions`), and no in-place op
can tell the copy from the original (a value, or a view of it, changed in place while
another use of it is alive; an input changed in place; an output that is a view of an input).
The objective is exact for what the steered model does: one conversion per crossing that
converts, paid at that crossing.

Scopes are tuples of module call keys, outermost first: ``("", "layer1.0", "layer1.0.relu@1")``
(``"@N"``: the module's N+1-th call in this forward); a graph's inputs and outputs are
outside every call, at ``()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import fx

from memlayout.plan.capture.calls import RUN_KEY, ModuleCall, RunFacts, positions
from memlayout.plan.costs.table import CostTable, input_kind, is_layout_node
from memlayout.plan.graph import META_KEY, Label, Request
from memlayout.plan.solve.formulate import Formulation, NodeTerms, _integer, node_terms
from memlayout.plan.solve.mincut import Problem, Tensor

IN, OUT = "in", "out"


@dataclass(frozen=True)
class Crossing:
    """A value crossing one module call's boundary: ``side`` ``"in"`` (an argument of the call)
    or ``"out"`` (a result); ``outer`` / ``inner`` the segment variables on either side;
    ``leaves`` the value's leaves among the call's flattened arguments or results (position
    and rank), empty where the boundary cannot convert it (``why`` says why)."""

    value: str
    call: str
    side: str
    outer: str
    inner: str
    leaves: tuple[tuple[int, int], ...]
    why: str = ""

    @property
    def module(self) -> str:
        """The module's path (the call key without its call number)."""
        return self.call.split("@")[0]

    @property
    def convertible(self) -> bool:
        return bool(self.leaves)


def scope(n: fx.Node, root: str = "") -> tuple[str, ...]:
    """The module calls node ``n`` ran in, outermost first, from its ``nn_module_stack`` (fx
    and torch.export both record it); ``root``: the path of the module the graph was
    captured from. Inputs, outputs and attributes are outside every call: ``()``."""
    if n.op in ("placeholder", "output", "get_attr"):
        return ()
    keys = [root]
    for key, value in (n.meta.get("nn_module_stack") or {}).items():
        path = value[0] if isinstance(value, tuple) else str(value)
        if not path:
            continue  # torch.export names the root too
        number = key.rsplit("@", 1)[1] if "@" in key else "0"
        full = f"{root}.{path}" if root else path
        keys.append(full if number in ("", "0") else f"{full}@{number}")
    return tuple(keys)


def formulate_boundaries(gm: fx.GraphModule, table: CostTable, *,
                         input_label: Label | Request | None, output_label: Label | Request | None,
                         calls: Mapping[str, ModuleCall], root: str = "",
                         fixed: frozenset[str] = frozenset()) -> Formulation:
    """The boundary problem of graph ``gm`` (captured from the module at ``root``; ``calls``:
    the eager run's module calls, by path). ``input_label`` and ``output_label`` as for
    :func:`~memlayout.plan.solve.formulate.formulate`. ``fixed``: module paths whose
    boundaries never convert (a wrapper the planner added around the user's model)."""
    terms = node_terms(gm, table, input_label=input_label)
    problem = _Segments(gm, table, calls, root, fixed, terms)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for value, producer in terms.producers.items():
        node = problem.nodes[value]
        if input_kind(gm, node) != "term":
            continue
        made = scope(node, root)
        users = [u for u in node.users if u.name in table.nodes and is_layout_node(gm, u)]
        kept = output in node.users and output_label is not None
        if not users and not kept:
            continue
        first = problem.segment(value, made)
        if isinstance(producer, str):
            problem.ties.append((producer, first))
        else:
            problem.pins[first] = Label(producer)
        for u in users:
            problem.ties.append((u.name, problem.route(value, made, scope(u, root))))
        if kept:
            last = problem.route(value, made, ())
            problem.pins[last] = Label(node.meta[META_KEY].label if output_label == Request.KEEP
                                       else output_label)
    seconds = Problem(problem.unary, tuple(problem.tensors), problem.pins,
                      tuple(dict.fromkeys(problem.ties)))
    integer, unit = _integer(seconds)
    return Formulation(seconds, integer, dict(terms.producers), {}, unit,
                       tuple(problem.crossings.values()), tuple(problem.converted))


class _Segments:
    """The boundary problem as it is built: a value is one variable per module scope it
    passes through (a *segment*), and each module boundary it crosses is a conversion term
    (where it can convert) or a tie (where it cannot: ``Crossing.why``)."""

    def __init__(self, gm: fx.GraphModule, table: CostTable, calls: Mapping[str, ModuleCall],
                 root: str, fixed: frozenset[str], terms: NodeTerms) -> None:
        self.table, self.calls, self.root, self.fixed = table, calls, root, fixed
        self.unary, self.pins, self.ties = dict(terms.unary), dict(terms.pins), list(terms.ties)
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.unsafe = unsafe_values(gm)
        self.tensors: list[Tensor] = []
        self.converted: list[str] = []  # the value of each tensor term
        self.crossings: dict[tuple[str, str, str], Crossing] = {}

    def segment(self, value: str, at: tuple[str, ...]) -> str:
        name = f"{value}|{'/'.join(at)}"
        if name not in self.unary:
            self.unary[name] = (0.0, 0.0)
        return name

    def cross(self, value: str, outer: tuple[str, ...], inner: tuple[str, ...], side: str) -> None:
        call = inner[-1]
        key = (value, call, side)
        if key in self.crossings:
            return
        a, b = self.segment(value, outer), self.segment(value, inner)
        where, why = self._where(value, call, side)
        self.crossings[key] = Crossing(value, call, side, a, b, where, why)
        if not where:
            self.ties.append((a, b))
            return
        cost = self.table.conversions[value]
        first, second = (a, b) if side == IN else (b, a)  # the way the value flows
        self.tensors.append(Tensor(first, (second,), cost.to_1, cost.to_0))
        self.converted.append(value)

    def _where(self, value: str, call: str, side: str) -> tuple[tuple[tuple[int, int], ...], str]:
        """Where ``value`` sits among the call's arguments or results (position, rank), or
        why it cannot be converted at this boundary."""
        nodes = self.nodes
        why = _why_not(value, call, side, nodes, self.calls, self.unsafe, self.fixed, self.table)
        if why:
            return (), why
        record = self.calls[call]
        seen = record.inputs if side == IN else record.outputs
        found = positions(seen, nodes[value].meta[RUN_KEY].leaves)
        where = tuple((p, len(seen[p].shape)) for p in found)  # type: ignore[union-attr]
        if not where:
            return (), f"not among the call's {'arguments' if side == IN else 'results'}"
        if side == IN and set(found) & set(record.mutated) and (
                call == self.root or nodes[value].op == "placeholder"
                or len(nodes[value].users) > 1):
            # changed in place inside the call (a copy would take the change) while the
            # caller, or another use, needs it
            return (), f"changed in place by {call or 'the model'}"
        return where, ""

    def route(self, value: str, start: tuple[str, ...], end: tuple[str, ...]) -> str:
        common = 0
        while common < min(len(start), len(end)) and start[common] == end[common]:
            common += 1
        for depth in range(len(start), common, -1):  # up through the exits
            self.cross(value, start[:depth - 1], start[:depth], OUT)
        for depth in range(common + 1, len(end) + 1):  # down through the entries
            self.cross(value, end[:depth - 1], end[:depth], IN)
        return self.segment(value, end)


def _why_not(value: str, call: str, side: str, nodes: Mapping[str, fx.Node],
             calls: Mapping[str, ModuleCall], unsafe: Mapping[str, str],
             fixed: frozenset[str], table: CostTable) -> str:
    """Why the boundary of ``call`` cannot convert ``value`` (``""``: it can, if the value is
    found there)."""
    path, _, number = call.partition("@")
    if path in fixed:
        return "not the user's module"
    record = calls.get(path)
    if number or record is None or record.count != 1:
        return f"{path or 'the model'} is called {record.count if record else 0} times per forward"
    if value in unsafe:
        return unsafe[value]
    if value not in table.conversions:
        return "no conversion measured"
    if RUN_KEY not in nodes[value].meta:
        return "its value was not recorded"
    return ""


def unsafe_values(gm: fx.GraphModule) -> dict[str, str]:
    """Values a copy would split from the original: a value whose memory (shared with its
    views) is changed in place after it was made while another use of it remains, and an
    input changed in place or returned as a view (the caller's tensor must see the change,
    or be the result). A chain of in-place activations, each value used once, stays
    convertible."""
    group: dict[str, str] = {}

    def find(a: str) -> str:
        while group.get(a, a) != a:
            a = group[a]
        return a

    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    facts: dict[str, RunFacts] = {n.name: n.meta[RUN_KEY] for n in gm.graph.nodes
                                  if RUN_KEY in n.meta}
    for name, f in facts.items():
        for other in f.aliases:
            group[find(name)] = find(other)
    members: dict[str, list[str]] = {}
    for n in gm.graph.nodes:
        members.setdefault(find(n.name), []).append(n.name)
    mutations: dict[str, list[str]] = {}  # group -> the nodes changing it in place
    for name, f in facts.items():
        for m in f.mutates:
            mutations.setdefault(find(m), []).append(name)
    nodes = {n.name: n for n in gm.graph.nodes}
    outputs = {m.name for n in gm.graph.nodes if n.op == "output" for m in n.all_input_nodes}
    unsafe: dict[str, str] = {}
    for root, names in members.items():
        inputs = [m for m in names if nodes[m].op == "placeholder"]
        changed = mutations.get(root, [])
        if inputs and changed:
            unsafe.update(dict.fromkeys(names, f"the forward changes input {inputs[0]} in place"))
            continue
        if inputs and outputs & set(names):
            unsafe.update(dict.fromkeys(names, f"an output is a view of input {inputs[0]}"))
            continue
        for m in names:
            later = [c for c in changed if order[c] > order[m]]
            if later and any(u.name not in later for u in nodes[m].users):
                unsafe[m] = f"changed in place by {later[0]} while another use of it remains"
    return unsafe
