"""From a captured graph and its cost table to the solver's pure problem, and back.

Labels: 0 contiguous, 1 channels-last. Variables are layout nodes (and one pinned variable per
graph output whose format is kept). A layout node receives every decided input in its label's
format; its output then comes back in the label its measurement saw: the same as its input
(convolution, elementwise: identity), always one (GroupNorm, a pad dropping channels-last:
constant), or anything else (a permute: pinned to the label whose output is in a definite
format, carried as a constant).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import fx

from memlayout.plan.costs.table import CostTable, input_kind, is_layout_node
from memlayout.plan.graph import KEEP_KEY, LABELS, META_KEY, Label, Request, ValueMeta
from memlayout.plan.solve.mincut import Problem, Tensor

OUTPUT_PREFIX = "output:"


@dataclass
class Formulation:
    """The float problem (seconds), its integer twin for the solver, and the facts the
    rewrite needs: each value's producer (a node name: its label; or a constant label) and
    consumers."""

    seconds: Problem
    integer: Problem
    producers: dict[str, str | int] = field(default_factory=dict)  # value -> producer
    consumers: dict[str, tuple[str, ...]] = field(default_factory=dict)  # value -> consumers
    unit: float = 1.0
    # the module-call boundaries values cross (memlayout.plan.solve.boundaries); empty for the
    # problem with a conversion possible on any edge
    crossings: tuple[Any, ...] = ()
    tensor_values: tuple[str, ...] = ()  # the value each tensor term converts, in order


@dataclass
class NodeTerms:
    """What the layout nodes of a graph bring to either formulation: each node's costs in both
    labels, the pins (a label that fails, an output in one definite format), the ties (one
    module's or one tensor's users), and each value's producer (a node whose label is its
    format, or a constant label)."""

    unary: dict[str, tuple[float, float]]
    pins: dict[str, Label]
    ties: list[tuple[str, str]]
    producers: dict[str, str | int]


def node_terms(gm: fx.GraphModule, table: CostTable, *,
               input_label: Label | Request | None) -> NodeTerms:
    """``input_label``: the format graph inputs arrive in (``None``: as captured; ``Request.AUTO``:
    chosen, each input in a definite format a variable at no cost of its own, all of them
    tied to one format)."""
    unary: dict[str, tuple[float, float]] = {}
    pins: dict[str, Label] = {}
    ties: list[tuple[str, str]] = []
    producers: dict[str, str | int] = {}
    for n in gm.graph.nodes:
        if n.name not in table.nodes:
            continue
        cost = table.nodes[n.name]
        s0, s1 = cost.seconds
        ok = [label for label in LABELS if cost.seconds[label] is not None]
        if not ok:
            ok = [Label.CONTIGUOUS]
        if len(ok) == 1:
            pins[n.name] = ok[0]
            both = cost.seconds[ok[0]] or 0.0
            unary[n.name] = (both, both)
        else:
            unary[n.name] = (float(s0), float(s1))  # type: ignore[arg-type]
        o0, o1 = cost.out
        if len(ok) == 1:
            out = cost.out[ok[0]]
            if out in LABELS:
                producers[n.name] = out  # type: ignore[assignment]
        elif o0 in (Label.EITHER, None) and o1 in (Label.EITHER, None):
            pass  # no output in a definite format (a flatten, a pooled 1x1): nothing to carry
        elif o0 in (Label.CONTIGUOUS, Label.EITHER) and o1 in (Label.CHANNELS_LAST, Label.EITHER):
            producers[n.name] = n.name
        elif o0 in LABELS and o1 in (o0, Label.EITHER):
            producers[n.name] = o0  # type: ignore[assignment]
        elif o1 in LABELS and o0 is Label.EITHER:
            producers[n.name] = o1  # type: ignore[assignment]
        else:
            # Output in no format for one label (a permute: NCHW in gives a strided NHWC-shaped
            # view, channels-last in gives a contiguous one), or swapped: run the node in the
            # first label whose output is definite, and carry that output as a constant.
            pin = next((label for label in LABELS if cost.out[label] in LABELS),
                       Label.CONTIGUOUS)
            pins[n.name] = pin
            if cost.out[pin] in LABELS:
                producers[n.name] = cost.out[pin]  # type: ignore[assignment]
        kept: ValueMeta | None = n.meta.get(META_KEY)
        if n.meta.get(KEEP_KEY) and kept is not None and kept.label in LABELS \
                and n.name not in pins:
            # layout-reading code sees it: run it in the label whose output is the format
            # the original gives it (its own label first)
            runs = [label for label in (kept.label, *LABELS) if cost.seconds[label] is not None
                    and cost.out[label] in (kept.label, Label.EITHER)]
            if runs:
                pins[n.name] = runs[0]
    # values in a definite format that no layout node decides: inputs, rank-2 -> rank-4 views
    free_inputs: list[str] = []
    for n in gm.graph.nodes:
        meta: ValueMeta | None = n.meta.get(META_KEY)
        if n.name in table.nodes or n.op in ("get_attr", "output") or meta is None:
            continue
        if meta.label in LABELS:
            if n.op == "placeholder" and input_label == Request.AUTO:
                unary[n.name] = (0.0, 0.0)
                producers[n.name] = n.name
                free_inputs.append(n.name)
                continue
            label = meta.label
            if n.op == "placeholder" and input_label is not None:
                label = input_label
            producers[n.name] = label  # type: ignore[assignment]
    ties.extend((free_inputs[0], other) for other in free_inputs[1:])
    ties.extend(_shared_owner_ties(gm, table))
    return NodeTerms(unary, pins, ties, producers)


def _shared_owner_ties(gm: fx.GraphModule, table: CostTable) -> list[tuple[str, str]]:
    """Ties of the layout nodes that share what their format decides: one module (its
    weights), or one parameter, serves every node that uses it."""
    ties: list[tuple[str, str]] = []
    by_owner: dict[str, list[str]] = {}
    for n in gm.graph.nodes:
        if n.name not in table.nodes:
            continue
        if n.op == "call_module":
            by_owner.setdefault("module:" + n.target, []).append(n.name)
            # a tensor several modules share (tied weights) is one tensor in one format
            for t in gm.get_submodule(n.target).parameters(recurse=False):
                if t.dim() >= 3:
                    by_owner.setdefault(f"tensor:{id(t)}", []).append(n.name)
        for m in n.all_input_nodes:
            if input_kind(gm, m) == "param":
                by_owner.setdefault("attr:" + m.target, []).append(n.name)
                shared = _attr(gm, str(m.target))
                if shared is not None:
                    by_owner.setdefault(f"tensor:{id(shared)}", []).append(n.name)
    for names in by_owner.values():
        ties.extend((names[0], other) for other in names[1:])
    return ties


def formulate(gm: fx.GraphModule, table: CostTable, *, input_label: Label | Request | None,
              output_label: Label | Request | None) -> Formulation:
    """The problem with a conversion possible on any edge of the graph (what a graph rewrite
    realizes: ``memlayout.plan.steer.rewrite``): each value converted once per target format,
    serving every consumer that wants it (a P^n Potts term). ``input_label``: see
    :func:`node_terms`; ``output_label``: ``Request.KEEP`` (as the original returns them), a label, or
    ``None`` (free)."""
    terms = node_terms(gm, table, input_label=input_label)
    unary, pins, ties, producers = terms.unary, terms.pins, terms.ties, terms.producers
    # consumers, the Potts terms, and output pins
    consumers: dict[str, tuple[str, ...]] = {}
    tensors: list[Tensor] = []
    output = next(n for n in gm.graph.nodes if n.op == "output")
    conv = {**table.conversions}
    nodes = {n.name: n for n in gm.graph.nodes}
    for value, producer in producers.items():
        node = nodes[value]
        if input_kind(gm, node) != "term":
            continue
        users = [u.name for u in node.users if u.name in table.nodes and is_layout_node(gm, u)]
        if output in node.users and output_label is not None:
            pin = node.meta[META_KEY].label if output_label == Request.KEEP else output_label
            name = OUTPUT_PREFIX + value
            unary[name] = (0.0, 0.0)
            pins[name] = Label(pin)
            users.append(name)
        if not users or value not in conv:
            continue
        consumers[value] = tuple(users)
        c = conv[value]
        tensors.append(Tensor(producer, tuple(users), c.to_1, c.to_0))  # type: ignore[arg-type]
    seconds = Problem(unary, tuple(tensors), pins, tuple(ties))
    integer, unit = _integer(seconds)
    return Formulation(seconds, integer, producers, consumers, unit,
                       tensor_values=tuple(consumers))


def _attr(gm: fx.GraphModule, target: str) -> object | None:
    """The object ``gm`` holds at the dotted ``target`` (``None`` when absent)."""
    value: object | None = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def _integer(p: Problem) -> tuple[Problem, float]:
    """The same problem in integer units small enough for scipy's int32 max-flow."""
    total = sum(sum(c) for c in p.unary.values())
    total += sum(t.cost_to_0 + t.cost_to_1 for t in p.tensors)
    unit = total / 1e8 if total > 0 else 1.0

    def q(x: float) -> int:
        return round(x / unit)

    unary = {k: (q(a), q(b)) for k, (a, b) in p.unary.items()}
    tensors = tuple(Tensor(t.producer, t.consumers, q(t.cost_to_1), q(t.cost_to_0))
                    for t in p.tensors)
    return Problem(unary, tensors, dict(p.pins), p.ties), unit


def baseline_labels(p: Problem, label: int) -> dict[str, int]:
    """Every variable in ``label``, except pinned ones (a failing format, a kept output)."""
    return {name: p.pins.get(name, label) for name in p.unary}
