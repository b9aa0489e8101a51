"""Measure only what can change the cut (analysis): solve with predicted costs, measure the
nodes whose prediction could move the optimum, solve again, until none could.

A predicted node's cost difference ``c1 - c0`` (all the cut reads of it) is known to within
``width`` (``memlayout.plan.costs.predict``). Two tests, pure, on a problem in seconds:

- per node, its *margin*: the minimum cut with that node forced to its other label, less the
  optimum. A node whose width reaches its margin is measured: its error alone could flip it.
- jointly, the *worst regret*: an adversary moves every predicted ``c1 - c0`` to the end of
  its interval that hurts the chosen labels ``x``, so a labelling ``y`` gains the width of
  every predicted node it labels otherwise. The worst loss of ``x`` is then
  ``max_y F(x) - F(y) + sum(width[i] for i where y[i] != x[i])``, one more minimum cut (the
  width added to each predicted node's cost in its chosen label). Where it is above zero,
  the predicted nodes its ``y`` flips are measured.

Refinement stops when both find nothing: then no choice of true costs inside the intervals
makes another labelling better, and the plan equals the one of the measured costs.

>>> from memlayout.plan.solve.mincut import Problem, Tensor, solve_min_cut
>>> p = Problem({"a": (10, 4), "b": (5, 6), "c": (5, 5)},
...             (Tensor("a", ("b",), 3, 3), Tensor("b", ("c",), 2, 2)))
>>> labels = solve_min_cut(p).labels
>>> labels, margin(p, labels, "b")
({'a': 1, 'b': 1, 'c': 1}, 2.0)
>>> sorted(to_measure(p, labels, {"b": 1.0, "c": 0.5}))
[]
>>> sorted(to_measure(p, labels, {"b": 2.5, "c": 0.5}))  # b's error alone could flip it
['b']
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager

from memlayout.plan.capture.regions import Captured
from memlayout.plan.costs.cache import CostCache
from memlayout.plan.costs.drops import drop_notes
from memlayout.plan.costs.measure import measure_costs, node_context
from memlayout.plan.costs.predict import CostModel, samples_of
from memlayout.plan.costs.regions import Costs
from memlayout.plan.costs.table import CostTable
from memlayout.plan.options import RunOptions
from memlayout.plan.report.records import CostPrediction
from memlayout.plan.solve.formulate import _integer
from memlayout.plan.solve.mincut import Problem, objective, solve_min_cut
from memlayout.plan.solve.regions import Solution, region_problem, solve_labels, solve_regions

#: a worst regret at most this fraction of the objective is rounding (the integer problem)
TOLERANCE = 1e-6

__all__ = ["margin", "refined_solution", "to_measure", "worst_regret"]


def _solve(problem: Problem) -> dict[str, int] | None:
    """The optimum of a problem in seconds (solved in integer units), ``None`` when its pins
    and ties admit no labelling."""
    try:
        return solve_min_cut(_integer(problem)[0]).labels
    except ValueError:
        return None


def _value(problem: Problem, labels: Mapping[str, int]) -> float:
    value = objective(problem, labels)
    return math.inf if value is None else float(value)


def margin(problem: Problem, labels: Mapping[str, int], name: str) -> float:
    """How much the optimum of ``problem`` rises when ``name`` takes the other label than in
    ``labels`` (the optimum); ``inf`` where pins and ties forbid it."""
    if name in problem.pins:
        return math.inf
    forced = dataclasses.replace(problem, pins={**problem.pins, name: 1 - labels[name]})
    other = _solve(forced)
    if other is None:
        return math.inf
    return max(0.0, _value(problem, other) - _value(problem, labels))


def worst_regret(problem: Problem, labels: Mapping[str, int],
                 widths: Mapping[str, float]) -> tuple[float, frozenset[str]]:
    """The most ``labels`` can lose against the optimum when each ``c1 - c0`` of the nodes in
    ``widths`` may be off by up to its width, and the predicted nodes the adversary's best
    labelling flips (module docstring)."""
    unary = dict(problem.unary)
    for name, width in widths.items():
        costs = list(unary[name])
        costs[labels[name]] += width
        unary[name] = (costs[0], costs[1])
    worst = _solve(dataclasses.replace(problem, unary=unary))
    if worst is None:
        return 0.0, frozenset()
    flipped = frozenset(n for n in widths if worst[n] != labels[n])
    regret = (_value(problem, labels) - _value(problem, worst)
              + sum(widths[n] for n in flipped))
    return max(0.0, regret), flipped


def to_measure(problem: Problem, labels: Mapping[str, int],
               widths: Mapping[str, float]) -> frozenset[str]:
    """The predicted nodes (``widths``: each one's uncertainty on ``c1 - c0``) to measure
    before ``labels``, the optimum of ``problem`` with the predicted costs, can be trusted:
    those whose width reaches their margin; where there are none, those the worst regret's
    labelling flips, if that regret is above rounding; else none."""
    open_ = {n: w for n, w in widths.items() if w > 0 and n in problem.unary
             and n not in problem.pins}
    alone = frozenset(n for n, w in open_.items() if w >= margin(problem, labels, n))
    if alone:
        return alone
    regret, flipped = worst_regret(problem, labels, open_)
    if regret > TOLERANCE * max(_value(problem, labels), 1e-12):
        return flipped
    return frozenset()


def _solved_problem(problem: Problem, labels: Mapping[str, int]) -> Problem:
    """The problem ``labels`` solve: without its ties where they contradicted its pins and
    the solver dropped them (``solve_labels``)."""
    if objective(problem, labels) is None:
        return Problem(problem.unary, problem.tensors, problem.pins)
    return problem


Clock = Callable[[str], AbstractContextManager[None]]


def refined_solution(captured: Captured, options: RunOptions, store: CostCache | None,
                     clock: Clock) -> Solution:
    """The min-cut solution of every region where only the nodes whose costs could change
    the cut are measured, the others predicted from this machine's cached timings; the
    solution's ``prediction`` says how many of each, and the bounds of what predicting can
    lose. ``clock(step)`` times the ``"costs"`` and ``"solve"`` steps."""
    context = node_context(options.device, options.dtype, train=options.train,
                           weights=options.weights)

    def fitted() -> CostModel:
        records = store.records("node") if store is not None else []
        return CostModel.fit(samples_of(records, context))

    tables: list[CostTable] = []
    measured = cached = passes = 0
    regret = 0.0
    for region in captured.regions:
        table: CostTable | None = None
        timed: frozenset[str] = frozenset()
        model = fitted()
        for done in range(1, 2 * len(region.gm.graph.nodes) + 3):
            with clock("costs"):
                table = measure_costs(
                    region.gm, region.inputs, dtype=options.dtype, measure=True, cache=store,
                    rounds=options.rounds, progress=options.progress, train=options.train,
                    device=options.device, weights=options.weights, model=model,
                    timed=timed, previous=table)
            measured += table.measured
            cached += table.cached
            with clock("solve"):
                form = region_problem(captured, region, table, options)
                labels = solve_labels(form.integer)
                problem = _solved_problem(form.seconds, labels)
                timed = to_measure(problem, labels, table.predicted)
                if not timed:
                    regret += worst_regret(problem, labels, {
                        n: w for n, w in table.predicted.items()
                        if n in problem.unary and n not in problem.pins})[0]
            passes = max(passes, done)
            if timed:
                model = fitted()
                continue
            # the decision stands only on a fit that saw every timing taken: then a plan of
            # the same model on this cache predicts the same nodes the same way
            refit = fitted()
            if refit == model:
                break
            model = refit
        assert table is not None
        with clock("costs"):
            drop_notes(region.gm, region.inputs, table, dtype=options.dtype,  # into node.meta
                       device=options.device)
        tables.append(table)
    with clock("solve"):
        solution = solve_regions(captured, Costs(tuple(tables), measured, cached), options)
    record = CostPrediction(
        measured=sum(c.timed for t in tables for c in t.nodes.values()),
        predicted=sum(len(t.predicted) for t in tables), regret=regret,
        widths=sum(w for t in tables for w in t.predicted.values()), passes=passes)
    return dataclasses.replace(solution, prediction=record)
