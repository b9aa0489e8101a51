"""The exact optimum of a two-format layout problem, as an s-t minimum cut. Pure: no torch.

Each variable is a node's label: 0 (contiguous) or 1 (channels-last). The objective is

- per variable, a unary cost for each label;
- per tensor, a conversion cost: the tensor leaves its producer in format ``o`` (the producer's
  label, or a constant) and is converted once, serving every consumer whose label differs:
  ``cost_to_1 * [o == 0 and some consumer is 1] + cost_to_0 * [o == 1 and some consumer is 0]``
  (a P^n Potts term, asymmetric in its two directions);
- pins (a variable fixed to a label) and ties (two variables forced equal).

Each Potts term becomes two auxiliary nodes ("some consumer is 1", "some consumer is 0") with
infinite edges to the consumers: every term is then pairwise and submodular, so a minimum s-t
cut (label 0 on the source side) is an exact global optimum. Capacities are integers and
scipy's max-flow solves it.

>>> p = Problem(
...     unary={"a": (9, 3), "b": (9, 3), "c": (1, 9)},
...     tensors=(Tensor(producer=0, consumers=("a",), cost_to_1=2),      # input arrives as 0
...              Tensor(producer="a", consumers=("b", "c"), cost_to_1=4, cost_to_0=4)))
>>> s = solve_min_cut(p)
>>> s.labels, s.objective, objective(p, s.labels)
({'a': 1, 'b': 1, 'c': 0}, 13, 13)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_flow

Label = int  # 0: contiguous, 1: channels-last
_CAP_LIMIT = 2**31 - 1  # scipy's max-flow works on int32 capacities


@dataclass(frozen=True)
class Tensor:
    """One tensor: its producer (a variable name whose label is its format, or a constant
    label), the variables consuming it, and the cost of converting it to 1 / to 0."""

    producer: str | Label
    consumers: tuple[str, ...]
    cost_to_1: int = 0
    cost_to_0: int = 0


@dataclass(frozen=True)
class Problem:
    """Unary costs ``(cost if 0, cost if 1)`` per variable, tensors (Potts terms), pins, ties."""

    unary: Mapping[str, tuple[int, int]]
    tensors: tuple[Tensor, ...] = ()
    pins: Mapping[str, Label] = field(default_factory=dict)
    ties: tuple[tuple[str, str], ...] = ()

    def check(self) -> None:
        """Raise ``ValueError`` for unknown variables, negative costs or labels not 0/1."""
        known = set(self.unary)
        for name, costs in self.unary.items():
            if len(costs) != 2 or min(costs) < 0:
                raise ValueError(f"unary costs of {name!r} must be two ints >= 0, got {costs}")
        for t in self.tensors:
            names = [*t.consumers, *([t.producer] if isinstance(t.producer, str) else [])]
            if isinstance(t.producer, int) and t.producer not in (0, 1):
                raise ValueError(f"constant producer label must be 0 or 1, got {t.producer}")
            if min(t.cost_to_0, t.cost_to_1) < 0:
                raise ValueError(f"conversion costs must be >= 0, got {t}")
            unknown = [n for n in names if n not in known]
            if unknown:
                raise ValueError(f"tensor {t} names unknown variables {unknown}")
        for name, label in self.pins.items():
            if name not in known or label not in (0, 1):
                raise ValueError(f"pin {name!r} -> {label!r}: unknown variable or label not 0/1")
        for a, b in self.ties:
            if a not in known or b not in known:
                raise ValueError(f"tie ({a!r}, {b!r}) names an unknown variable")


@dataclass(frozen=True)
class Solution:
    labels: dict[str, Label]
    objective: int


def objective(problem: Problem, labels: Mapping[str, Label]) -> int | None:
    """The objective of a full labelling; ``None`` when it breaks a pin or a tie."""
    if any(labels[n] != v for n, v in problem.pins.items()):
        return None
    if any(labels[a] != labels[b] for a, b in problem.ties):
        return None
    total = sum(costs[labels[n]] for n, costs in problem.unary.items())
    for t in problem.tensors:
        o = labels[t.producer] if isinstance(t.producer, str) else t.producer
        wanted = {labels[c] for c in t.consumers}
        if o == 0 and 1 in wanted:
            total += t.cost_to_1
        if o == 1 and 0 in wanted:
            total += t.cost_to_0
    return total


def solve_min_cut(problem: Problem) -> Solution:
    """The exact minimum of ``objective`` via one s-t minimum cut (label 0 = source side)."""
    problem.check()
    names = sorted(problem.unary)
    index = {n: i + 2 for i, n in enumerate(names)}  # 0: source, 1: sink
    source, sink = 0, 1
    edges: dict[tuple[int, int], int] = {}

    def add(u: int, v: int, cap: int) -> None:
        if cap > 0 and u != v:
            edges[(u, v)] = edges.get((u, v), 0) + cap

    def unary(node: int, cost0: int, cost1: int) -> None:
        add(source, node, cost1)  # cut when node is on the sink side (label 1)
        add(node, sink, cost0)

    finite = sum(sum(c) for c in problem.unary.values())
    finite += sum(t.cost_to_0 + t.cost_to_1 for t in problem.tensors)
    inf = finite + 1
    for name, (c0, c1) in problem.unary.items():
        unary(index[name], c0, c1)
    for name, label in problem.pins.items():
        unary(index[name], inf if label == 1 else 0, inf if label == 0 else 0)
    for a, b in problem.ties:
        add(index[a], index[b], inf)
        add(index[b], index[a], inf)
    next_node = len(names) + 2
    for t in problem.tensors:
        consumers = [index[c] for c in t.consumers]
        if not consumers:
            continue
        if t.cost_to_1 > 0 and t.producer != 1:
            z = next_node  # z = 1 iff some consumer is 1 (forced by the infinite edges)
            next_node += 1
            for c in consumers:
                add(z, c, inf)  # cut when z = 0 and c = 1: forbidden
            if t.producer == 0:
                add(source, z, t.cost_to_1)
            else:
                add(index[t.producer], z, t.cost_to_1)  # paid when producer 0, z 1
        if t.cost_to_0 > 0 and t.producer != 0:
            y = next_node  # y = 0 iff some consumer is 0
            next_node += 1
            for c in consumers:
                add(c, y, inf)
            if t.producer == 1:
                add(y, sink, t.cost_to_0)
            else:
                add(y, index[t.producer], t.cost_to_0)  # paid when y 0, producer 1
    if inf + finite > _CAP_LIMIT:
        raise ValueError(
            f"costs sum to {finite}; scipy's max-flow needs them below {_CAP_LIMIT // 2}: "
            "use a coarser cost unit"
        )
    labels = _min_cut_labels(next_node, source, sink, edges)
    result = {n: labels[index[n]] for n in names}
    value = objective(problem, result)
    if value is None:
        raise ValueError("the pins and ties contradict each other; no labelling satisfies them")
    return Solution(result, value)


def _min_cut_labels(n: int, source: int, sink: int,
                    edges: dict[tuple[int, int], int]) -> list[Label]:
    if not edges:
        return [0] * n
    rows = np.array([u for u, _ in edges], dtype=np.int32)
    cols = np.array([v for _, v in edges], dtype=np.int32)
    caps = np.array(list(edges.values()), dtype=np.int32)
    graph = csr_matrix((caps, (rows, cols)), shape=(n, n))
    flow = maximum_flow(graph, source, sink).flow.tocsr()
    flows = np.asarray(flow[rows, cols]).ravel()  # one lookup for all edges, in their order
    residual: dict[int, list[int]] = {}
    for (u, v), cap, f in zip(edges, caps.tolist(), flows.tolist(), strict=True):
        if cap - f > 0:
            residual.setdefault(u, []).append(v)
        if f > 0:
            residual.setdefault(v, []).append(u)
    # scipy's flow is antisymmetric (net): residual u->v is cap - flow[u, v], v->u gains flow
    reached = {source}
    todo = deque([source])
    while todo:
        u = todo.popleft()
        for v in residual.get(u, ()):
            if v not in reached:
                reached.add(v)
                todo.append(v)
    return [0 if i in reached else 1 for i in range(n)]
