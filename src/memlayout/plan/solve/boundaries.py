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
from memlayout.plan.solve.formulate import Formulation, _integer, node_terms
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
    unary, pins, ties = dict(terms.unary), dict(terms.pins), list(terms.ties)
    nodes = {n.name: n for n in gm.graph.nodes}
    unsafe = unsafe_values(gm)
    tensors: list[Tensor] = []
    converted: list[str] = []  # the value of each tensor term
    crossings: dict[tuple[str, str, str], Crossing] = {}
    output = next(n for n in gm.graph.nodes if n.op == "output")

    def segment(value: str, at: tuple[str, ...]) -> str:
        name = f"{value}|{'/'.join(at)}"
        if name not in unary:
            unary[name] = (0.0, 0.0)
        return name

    def cross(value: str, outer: tuple[str, ...], inner: tuple[str, ...], side: str) -> None:
        call = inner[-1]
        key = (value, call, side)
        if key in crossings:
            return
        a, b = segment(value, outer), segment(value, inner)
        why = _why_not(value, call, side, nodes, calls, unsafe, fixed, table)
        where: tuple[tuple[int, int], ...] = ()
        if not why:
            record = calls[call]
            seen = record.inputs if side == IN else record.outputs
            found = positions(seen, nodes[value].meta[RUN_KEY].leaves)
            where = tuple((p, len(seen[p].shape)) for p in found)  # type: ignore[union-attr]
            why = "" if where else f"not among the call's {'arguments' if side == IN else 'results'}"
            if side == IN and set(found) & set(record.mutated) and (
                    call == root or nodes[value].op == "placeholder"
                    or len(nodes[value].users) > 1):
                # changed in place inside the call (a copy would take the change) while the
                # caller, or another use, needs it
                where, why = (), f"changed in place by {call or 'the model'}"
        crossings[key] = Crossing(value, call, side, a, b, where, why)
        if not where:
            ties.append((a, b))
            return
        cost = table.conversions[value]
        first, second = (a, b) if side == IN else (b, a)  # the way the value flows
        tensors.append(Tensor(first, (second,), cost.to_1, cost.to_0))
        converted.append(value)

    def route(value: str, start: tuple[str, ...], end: tuple[str, ...]) -> str:
        common = 0
        while common < min(len(start), len(end)) and start[common] == end[common]:
            common += 1
        for depth in range(len(start), common, -1):  # up through the exits
            cross(value, start[:depth - 1], start[:depth], OUT)
        for depth in range(common + 1, len(end) + 1):  # down through the entries
            cross(value, end[:depth - 1], end[:depth], IN)
        return segment(value, end)

    for value, producer in terms.producers.items():
        node = nodes[value]
        if input_kind(gm, node) != "term":
            continue
        made = scope(node, root)
        users = [u for u in node.users if u.name in table.nodes and is_layout_node(gm, u)]
        kept = output in node.users and output_label is not None
        if not users and not kept:
            continue
        first = segment(value, made)
        if isinstance(producer, str):
            ties.append((producer, first))
        else:
            pins[first] = int(producer)
        for u in users:
            ties.append((u.name, route(value, made, scope(u, root))))
        if kept:
            last = route(value, made, ())
            pins[last] = int(node.meta[META_KEY].label if output_label == Request.KEEP else output_label)
    seconds = Problem(unary, tuple(tensors), pins, tuple(dict.fromkeys(ties)))
    integer, unit = _integer(seconds)
    return Formulation(seconds, integer, dict(terms.producers), {}, unit,
                       tuple(crossings.values()), tuple(converted))


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
