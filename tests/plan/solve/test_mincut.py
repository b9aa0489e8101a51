"""The min-cut solver against brute-force enumeration: identical optimal objective, every time."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memlayout.plan.solve.mincut import Problem, Solution, Tensor, objective, solve_min_cut

cost = st.integers(min_value=0, max_value=50)


def solve_brute_force(problem: Problem) -> Solution:
    """Enumerate every labelling (2^n): the reference the min cut is held to."""
    problem.check()
    names = sorted(problem.unary)
    best: Solution | None = None
    for combo in itertools.product((0, 1), repeat=len(names)):
        labels = dict(zip(names, combo, strict=True))
        value = objective(problem, labels)
        if value is not None and (best is None or value < best.objective):
            best = Solution(labels, value)
    if best is None:
        raise ValueError("no labelling satisfies the pins and ties")
    return best


@st.composite
def problems(draw) -> Problem:
    n = draw(st.integers(min_value=1, max_value=8))
    names = [f"v{i}" for i in range(n)]
    unary = {name: (draw(cost), draw(cost)) for name in names}
    tensors = []
    for _ in range(draw(st.integers(min_value=0, max_value=8))):
        producer = draw(st.one_of(st.sampled_from(names), st.sampled_from([0, 1])))
        pool = [v for v in names if v != producer]
        if not pool:
            continue
        consumers = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4, unique=True))
        tensors.append(Tensor(producer, tuple(consumers), draw(cost), draw(cost)))
    pins = draw(st.dictionaries(st.sampled_from(names), st.sampled_from([0, 1]), max_size=2))
    ties = draw(st.lists(st.tuples(st.sampled_from(names), st.sampled_from(names)), max_size=2))
    return Problem(unary, tuple(tensors), pins, tuple(ties))


@settings(max_examples=200, deadline=None)
@given(problems())
def test_min_cut_objective_equals_brute_force(problem: Problem) -> None:
    try:
        expected = solve_brute_force(problem)
    except ValueError:  # pins and ties contradict: the min cut must say so too
        with pytest.raises(ValueError):
            solve_min_cut(problem)
        return
    got = solve_min_cut(problem)
    assert got.objective == expected.objective
    assert objective(problem, got.labels) == got.objective


def test_converting_once_serves_every_consumer() -> None:
    # Two consumers prefer channels-last by 3 each; one conversion (cost 5) serves both,
    # so both switch; with one consumer alone the conversion would not pay.
    both = Problem({"a": (3, 0), "b": (3, 0)}, (Tensor(0, ("a", "b"), cost_to_1=5),))
    assert solve_min_cut(both).labels == {"a": 1, "b": 1}
    one = Problem({"a": (3, 0)}, (Tensor(0, ("a",), cost_to_1=5),))
    assert solve_min_cut(one).labels == {"a": 0}


def test_pins_and_ties_hold() -> None:
    p = Problem({"a": (0, 9), "b": (9, 0)}, pins={"a": 1}, ties=(("a", "b"),))
    assert solve_min_cut(p).labels == {"a": 1, "b": 1}


def test_bad_problem_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown variables"):
        solve_min_cut(Problem({"a": (0, 0)}, (Tensor("x", ("a",)),)))
    with pytest.raises(ValueError, match="contradict"):
        solve_min_cut(Problem({"a": (0, 0), "b": (0, 0)}, pins={"a": 1, "b": 0},
                              ties=(("a", "b"),)))


def test_solver_does_not_import_torch() -> None:
    import subprocess
    import sys

    # Load the file on its own (the memlayout package itself imports torch).
    import memlayout.plan.solve.mincut as solve

    code = ("import importlib.util, sys; "
            f"s = importlib.util.spec_from_file_location('solve', {solve.__file__!r}); "
            "m = importlib.util.module_from_spec(s); sys.modules['solve'] = m; "
            "s.loader.exec_module(m); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
