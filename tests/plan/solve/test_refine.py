"""Which predicted costs could change the cut (memlayout.plan.solve.refine), checked against
brute force over every labelling and every corner of the prediction intervals."""

from __future__ import annotations

import itertools
import random

import pytest

from memlayout.plan.solve.formulate import _integer
from memlayout.plan.solve.mincut import Problem, Tensor, objective, solve_min_cut
from memlayout.plan.solve.refine import margin, to_measure, worst_regret

SEEDS = range(40)


def _problem(rng: random.Random, n: int = 5) -> Problem:
    """A small random problem in seconds: a chain with a branch, conversions on its edges, and
    now and then a pin or a tie."""
    names = [f"v{i}" for i in range(n)]
    unary = {v: (rng.uniform(0, 10), rng.uniform(0, 10)) for v in names}
    tensors = [Tensor(rng.choice((0, 1)), (names[0],), rng.uniform(0, 4), rng.uniform(0, 4))]
    for i in range(1, n):
        producer = names[rng.randrange(i)]
        tensors.append(Tensor(producer, (names[i],), rng.uniform(0, 4), rng.uniform(0, 4)))
    pins = {names[-1]: rng.choice((0, 1))} if rng.random() < 0.3 else {}
    ties = ((names[1], names[2]),) if rng.random() < 0.3 else ()
    return Problem(unary, tuple(tensors), pins, ties)


def _optimum(p: Problem) -> dict[str, int]:
    """The min cut of a problem in seconds (solved in integer units, as the planner does)."""
    return solve_min_cut(_integer(p)[0]).labels


def _labelings(p: Problem) -> list[dict[str, int]]:
    names = sorted(p.unary)
    out = []
    for bits in itertools.product((0, 1), repeat=len(names)):
        labels = dict(zip(names, bits, strict=True))
        if objective(p, labels) is not None:
            out.append(labels)
    return out


def _shifted(p: Problem, shifts: dict[str, float]) -> Problem:
    """``p`` with ``c1 - c0`` of each named node moved by its shift (on ``c1``, or off ``c0``
    where ``c1`` would go negative: only the difference matters to the cut)."""
    unary = dict(p.unary)
    for name, d in shifts.items():
        c0, c1 = unary[name]
        unary[name] = (c0, c1 + d) if c1 + d >= 0 else (c0 - d, c1)
    return Problem(unary, p.tensors, p.pins, p.ties)


def _brute_best(p: Problem) -> float:
    return min(objective(p, y) for y in _labelings(p))  # type: ignore[type-var]


def _widths(rng: random.Random, p: Problem) -> dict[str, float]:
    return {n: rng.uniform(0, 3) for n in sorted(p.unary) if rng.random() < 0.7}


@pytest.mark.parametrize("seed", SEEDS)
def test_a_node_left_predicted_cannot_move_the_optimum_anywhere_in_its_interval(seed: int):
    rng = random.Random(seed)
    p = _problem(rng)
    labels = _optimum(p)
    widths = _widths(rng, p)
    measure = to_measure(p, labels, widths)
    for name, width in widths.items():
        if name in measure:
            continue
        for shift in (-width, -width / 2, 0.0, width / 2, width):
            moved = _shifted(p, {name: shift})
            assert objective(moved, labels) <= _brute_best(moved) + 1e-6


@pytest.mark.parametrize("seed", SEEDS)
def test_the_margin_is_the_best_labelling_with_the_node_flipped(seed: int):
    rng = random.Random(seed)
    p = _problem(rng)
    labels = _optimum(p)
    best = objective(p, labels)
    for name in p.unary:
        flipped = [objective(p, y) for y in _labelings(p) if y[name] != labels[name]]
        want = min(flipped) - best if flipped and name not in p.pins else float("inf")
        assert margin(p, labels, name) == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_worst_regret_is_the_worst_corner_of_the_intervals(seed: int):
    rng = random.Random(seed)
    p = _problem(rng)
    labels = _optimum(p)
    widths = {n: w for n, w in _widths(rng, p).items() if n not in p.pins}
    names = sorted(widths)
    worst = 0.0
    for signs in itertools.product((-1, 1), repeat=len(names)):
        moved = _shifted(p, {n: s * widths[n] for n, s in zip(names, signs, strict=True)})
        worst = max(worst, objective(moved, labels) - _brute_best(moved))
    assert worst_regret(p, labels, widths)[0] == pytest.approx(worst, abs=1e-5)


@pytest.mark.parametrize("seed", SEEDS)
def test_refining_until_nothing_is_left_gives_the_plan_of_the_true_costs(seed: int):
    """Predicted ``c1 - c0`` off by less than the width; measuring what ``to_measure`` names
    (the true cost replaces the prediction) until it names nothing ends at an optimum of the
    true costs, and the worst regret stated bounds the loss of every step's labels."""
    rng = random.Random(seed)
    truth = _problem(rng)
    widths = {n: rng.uniform(0, 3) for n in sorted(truth.unary)}
    errors = {n: rng.uniform(-w, w) for n, w in widths.items()}
    predicted = dict(widths)
    for _ in range(len(widths) + 1):
        guess = _shifted(truth, {n: errors[n] for n in predicted})
        labels = _optimum(guess)
        regret = worst_regret(guess, labels, {n: w for n, w in predicted.items()
                                              if n not in guess.pins})[0]
        assert objective(truth, labels) - _brute_best(truth) <= regret + 1e-6
        measure = to_measure(guess, labels, predicted)
        if not measure:
            break
        predicted = {n: w for n, w in predicted.items() if n not in measure}
    assert not measure
    assert objective(truth, labels) == pytest.approx(_brute_best(truth), abs=1e-6)


def test_two_nodes_that_flip_together_are_measured_though_each_alone_could_not_flip():
    """Each node's width is below its margin, yet their errors together flip the pair: the
    joint test (the worst regret) names them."""
    p = Problem({"a": (0.0, 5.0), "b": (0.0, 5.0)},
                (Tensor("a", ("b",), 100.0, 100.0),))
    labels = _optimum(p)
    assert labels == {"a": 0, "b": 0}
    assert margin(p, labels, "a") == margin(p, labels, "b") == 10.0
    widths = {"a": 9.0, "b": 9.0}
    assert worst_regret(p, labels, widths) == (8.0, frozenset({"a", "b"}))
    assert to_measure(p, labels, widths) == frozenset({"a", "b"})
    assert to_measure(p, labels, {"a": 4.0, "b": 4.0}) == frozenset()
