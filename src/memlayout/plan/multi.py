"""More than two formats per node: alpha-expansion over exact binary min-cuts. Pure: no torch.

With candidates beyond NCHW / NHWC (a padded layout, a blocked one) each variable takes one of
``K`` labels. The objective generalises ``memlayout.plan.solve``'s:

- per variable, a unary cost per label;
- per tensor, produced in label ``o`` (its producer's, or a constant), converted once to every
  other label some consumer runs in: ``sum(cost_to[l] for l in labels wanted by consumers if
  l != o)`` (a P^n Potts term per target label);
- pins and ties.

The exact minimum is NP-hard for ``K >= 3``. Alpha-expansion (Boykov, Veksler & Zabih 2001;
for P^n Potts terms Kohli, Kumar & Torr 2007) starts from a feasible labelling and, for each
label ``alpha`` in turn, solves exactly (one s-t min-cut, ``solve_min_cut``) the binary problem
"each variable keeps its label or switches to ``alpha``", until no move lowers the objective.
Every term of that move is one of ``solve``'s two-label Tensor terms, so each move is optimal
among all expansion moves, and the result is a local minimum no single expansion improves.
For ``K == 2`` the first move already is the full problem: exact. For larger ``K`` the tests
compare with brute force and report the gap.

>>> p = MultiProblem(
...     labels=3,
...     unary={"a": (5, 1, 9), "b": (5, 9, 1), "c": (1, 5, 5)},
...     tensors=(MultiTensor(producer=0, consumers=("a",), cost_to=(0, 1, 1)),
...              MultiTensor(producer="a", consumers=("b", "c"), cost_to=(2, 2, 2))))
>>> s = solve_expansion(p)
>>> s.objective, solve_brute_force(p).objective
(8, 8)
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

from memlayout.plan.solve import Problem, Tensor, solve_min_cut


@dataclass(frozen=True)
class MultiTensor:
    """A tensor: producer (variable or constant label), consumers, cost of converting it to
    each label (``cost_to[l]``; the entry of its own label is never paid)."""

    producer: str | int
    consumers: tuple[str, ...]
    cost_to: tuple[int, ...]


@dataclass(frozen=True)
class MultiProblem:
    labels: int
    unary: Mapping[str, tuple[int, ...]]
    tensors: tuple[MultiTensor, ...] = ()
    pins: Mapping[str, int] = field(default_factory=dict)
    ties: tuple[tuple[str, str], ...] = ()

    def check(self) -> None:
        """Raise ``ValueError`` for wrong lengths, negative costs or unknown names."""
        k = self.labels
        for name, costs in self.unary.items():
            if len(costs) != k or min(costs) < 0:
                raise ValueError(f"unary costs of {name!r} must be {k} ints >= 0, got {costs}")
        for t in self.tensors:
            if len(t.cost_to) != k or min(t.cost_to) < 0:
                raise ValueError(f"cost_to of {t} must be {k} ints >= 0")
            names = [*t.consumers, *([t.producer] if isinstance(t.producer, str) else [])]
            if isinstance(t.producer, int) and not 0 <= t.producer < k:
                raise ValueError(f"constant producer {t.producer} is not a label < {k}")
            if any(n not in self.unary for n in names):
                raise ValueError(f"tensor {t} names an unknown variable")
        for name, label in self.pins.items():
            if name not in self.unary or not 0 <= label < k:
                raise ValueError(f"pin {name!r} -> {label}: unknown variable or label")
        for a, b in self.ties:
            if a not in self.unary or b not in self.unary:
                raise ValueError(f"tie ({a!r}, {b!r}) names an unknown variable")


@dataclass(frozen=True)
class MultiSolution:
    labels: dict[str, int]
    objective: int
    moves: int = 0  # expansion moves that lowered the objective


def objective(p: MultiProblem, labels: Mapping[str, int]) -> int | None:
    """The objective of a full labelling; ``None`` when it breaks a pin or a tie."""
    if any(labels[n] != v for n, v in p.pins.items()):
        return None
    if any(labels[a] != labels[b] for a, b in p.ties):
        return None
    total = sum(costs[labels[n]] for n, costs in p.unary.items())
    for t in p.tensors:
        o = labels[t.producer] if isinstance(t.producer, str) else t.producer
        total += sum(t.cost_to[w] for w in {labels[c] for c in t.consumers} if w != o)
    return total


def solve_brute_force(p: MultiProblem) -> MultiSolution:
    """Enumerate all ``K^n`` labellings (the reference)."""
    p.check()
    names = sorted(p.unary)
    best: MultiSolution | None = None
    for combo in itertools.product(range(p.labels), repeat=len(names)):
        labels = dict(zip(names, combo, strict=True))
        value = objective(p, labels)
        if value is not None and (best is None or value < best.objective):
            best = MultiSolution(labels, value)
    if best is None:
        raise ValueError("no labelling satisfies the pins and ties")
    return best


def initial_labels(p: MultiProblem) -> dict[str, int]:
    """A feasible start: pinned variables (and their tie groups) at the pin, each other tie
    group at the label with the lowest summed unary cost."""
    parent = {n: n for n in p.unary}

    def root(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for a, b in p.ties:
        parent[root(a)] = root(b)
    groups: dict[str, list[str]] = {}
    for n in p.unary:
        groups.setdefault(root(n), []).append(n)
    labels: dict[str, int] = {}
    for members in groups.values():
        pinned = {p.pins[m] for m in members if m in p.pins}
        if len(pinned) > 1:
            raise ValueError(f"variables {members} are tied but pinned to {sorted(pinned)}")
        if pinned:
            label = pinned.pop()
        else:
            label = min(range(p.labels), key=lambda lab: sum(p.unary[m][lab] for m in members))
        labels.update(dict.fromkeys(members, label))
    return labels


def expansion_move(p: MultiProblem, current: Mapping[str, int], alpha: int) -> Problem:
    """The binary problem of one alpha-expansion: label 1 = switch to ``alpha``, 0 = keep
    (variables already in ``alpha`` are pinned to 1). Its objective equals
    ``objective(p, moved)`` up to a constant for every move (tested)."""
    unary = {n: (costs[current[n]], costs[alpha]) for n, costs in p.unary.items()}
    # a variable already in alpha is in alpha either way: pinned to "switch" (one move per
    # labelling, and ties among such variables hold); a variable pinned elsewhere keeps its label
    pins = {n: 1 for n in p.unary if current[n] == alpha}
    pins.update({n: 0 for n, label in p.pins.items() if label != alpha})
    extra: dict[str, list[int]] = {}  # constant unary terms added per variable
    constant = 0
    tensors: list[Tensor] = []
    for t in p.tensors:
        var = isinstance(t.producer, str)
        cur_p = current[t.producer] if var else t.producer
        at_alpha = [c for c in t.consumers if current[c] == alpha]
        movable = [c for c in t.consumers if current[c] != alpha]
        # converting to alpha: paid when the tensor is not produced in alpha and some consumer is
        if cur_p != alpha and t.cost_to[alpha]:
            if at_alpha:  # some consumer is in alpha whatever the move: pay unless o -> alpha
                if var:
                    extra.setdefault(t.producer, [0, 0])[0] += t.cost_to[alpha]
                else:
                    constant += t.cost_to[alpha]
            elif movable:
                tensors.append(Tensor(t.producer if var else 0, tuple(movable),
                                      cost_to_1=t.cost_to[alpha]))
        # converting to each other label l: paid when some consumer keeps l and o != l
        by_label: dict[int, list[str]] = {}
        for c in movable:
            by_label.setdefault(current[c], []).append(c)
        for label, keepers in by_label.items():
            if not t.cost_to[label]:
                continue
            if cur_p == label and var:  # o == l unless the producer moves to alpha
                tensors.append(Tensor(t.producer, tuple(keepers), cost_to_0=t.cost_to[label]))
            elif cur_p != label:  # o != l either way: paid when some keeper stays
                tensors.append(Tensor(1, tuple(keepers), cost_to_0=t.cost_to[label]))
    for n, (c0, c1) in extra.items():
        u0, u1 = unary[n]
        unary[n] = (u0 + c0, u1 + c1)
    del constant  # the same for every move: irrelevant to the choice
    ties = tuple((a, b) for a, b in p.ties)
    return Problem(unary, tuple(tensors), pins, ties)


def solve_expansion(p: MultiProblem, *, max_sweeps: int = 20,
                    start: Mapping[str, int] | None = None) -> MultiSolution:
    """Alpha-expansion from ``start`` (default :func:`initial_labels`) until a sweep over all
    labels improves nothing (or ``max_sweeps``)."""
    p.check()
    labels = dict(start) if start is not None else initial_labels(p)
    best = objective(p, labels)
    if best is None:
        raise ValueError("the start labelling breaks a pin or a tie")
    moves = 0
    for _ in range(max_sweeps):
        improved = False
        for alpha in range(p.labels):
            move = solve_min_cut(expansion_move(p, labels, alpha)).labels
            moved = {n: alpha if move[n] else labels[n] for n in labels}
            value = objective(p, moved)
            if value is not None and value < best:
                labels, best, improved = moved, value, True
                moves += 1
        if not improved:
            break
    return MultiSolution(labels, best, moves)
