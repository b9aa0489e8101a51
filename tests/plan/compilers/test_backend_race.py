"""The guard's race on a graph's own calls (``backend_race.CallRace``), on a fake clock: each
way's forward (and, in training, backward) advances it by a set number of seconds."""

from __future__ import annotations

import sqlite3

import pytest
import torch

import memlayout
from memlayout.plan.compilers import backend_race
from memlayout.plan.compilers.backend_check import GraphCheck
from memlayout.plan.compilers.backend_report import RECORDS, BackendWarning, GraphRecord
from memlayout.plan.runners import Runner
from memlayout.timing import KEEP_MARGIN, SEQUENTIAL_ROUNDS
from tests.support.machine import fake_load


@pytest.fixture
def now(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(backend_race, "clock", lambda: clock[0])
    fake_load(monkeypatch, load=0.0)
    return clock


class _Slow(torch.autograd.Function):
    """Identity whose backward advances the fake clock by ``seconds``."""

    @staticmethod
    def forward(ctx, x, clock, seconds):
        ctx.clock, ctx.seconds = clock, seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.clock[0] += ctx.seconds
        return grad, None, None


def _way(now, name, forward, backward=0.0, calls=None):
    """A way to run the graph ``2 * x``: ``forward`` seconds, and ``backward`` seconds for its
    gradient; each call's way appended to ``calls``."""
    def run(x):
        now[0] += forward
        if calls is not None:
            calls.append(name)
        return _Slow.apply(2 * x, now, backward)
    return run


def _race(now, ways, *, train, rounds=5):
    outcomes = []
    race = backend_race.CallRace(ways, reference="compiled", margin=KEEP_MARGIN, rounds=rounds,
                                 protect=("own",), train=train, device=torch.device("cpu"),
                                 decided=lambda *outcome: outcomes.append(outcome))
    return race, outcomes


def test_ways_apart_are_decided_in_the_fewest_rounds_and_the_way_kept_runs_alone(now):
    """The eager way takes half the compiled plan's time: after one untimed call each, three
    interleaved rounds decide it (the sequential rule), the race ends once, and every later
    call runs the eager way; every call returns the graph's result."""
    calls: list[str] = []
    race, outcomes = _race(now, {"compiled": _way(now, "compiled", 1.0, calls=calls),
                                 "eager": _way(now, "eager", 0.5, calls=calls)}, train=False)
    x = torch.randn(4)
    for _ in range(20):
        torch.testing.assert_close(race(x), 2 * x)
    ((result, kept, made),) = outcomes
    assert kept == race.kept == "eager" and made == 2 * (1 + SEQUENTIAL_ROUNDS)
    assert result.rounds == SEQUENTIAL_ROUNDS and result.median("eager") == pytest.approx(2.0)
    assert calls[:made].count("eager") == calls[:made].count("compiled")
    assert set(calls[made:]) == {"eager"}


def test_a_training_call_is_timed_with_its_backward(now):
    """The compiled plan's forward is faster, its backward much slower: by the whole step
    (4 s against 2.5 s) the eager way wins, as it would not by its forward alone. Every
    gradient is the graph's."""
    race, outcomes = _race(now, {"compiled": _way(now, "compiled", 1.0, backward=3.0),
                                 "eager": _way(now, "eager", 1.5, backward=1.0)}, train=True)
    for _ in range(20):
        x = torch.randn(4, requires_grad=True)
        race(x).sum().backward()
        torch.testing.assert_close(x.grad, torch.full((4,), 2.0))
    ((result, kept, _),) = outcomes
    assert kept == "eager" and result.median("eager") == pytest.approx(4.0 / 2.5)


def test_calls_whose_backward_is_never_seen_end_the_race_undecided(now):
    """A training graph called without a backward (an evaluation under grad mode): no call
    can be timed whole, so after ``ABANDON_AFTER`` such calls the race ends with the
    compiled plan kept and no race to store."""
    race, outcomes = _race(now, {"compiled": _way(now, "compiled", 1.0),
                                 "eager": _way(now, "eager", 0.1)}, train=True)
    x = torch.randn(4, requires_grad=True)
    for _ in range(backend_race.ABANDON_AFTER + 3):
        race(x)
    assert outcomes == [(None, "compiled", backend_race.ABANDON_AFTER)]


def test_a_way_that_raises_leaves_the_race_and_the_call_runs_the_compiled_plan(now):
    """Inductor's own raising at its first call: that call returns the compiled plan's
    result, the race goes on without it and says why it is missing."""
    def broken(x):
        raise RuntimeError("no kernel for this")

    race, outcomes = _race(now, {"compiled": _way(now, "compiled", 1.0), "own": broken,
                                 "eager": _way(now, "eager", 2.0)}, train=False)
    x = torch.randn(4)
    for _ in range(20):
        torch.testing.assert_close(race(x), 2 * x)
    ((result, kept, _),) = outcomes
    assert kept == "compiled" and "no kernel for this" in result.errors["own"]
    assert set(result.ratios) == {"eager"}


def test_a_close_call_is_timed_for_as_many_rounds_again(now):
    """Inductor's own (protected) alternately 5 % faster and 4 % slower: neither apart nor
    tied, so the five rounds are followed by five more of the two, and the compiled plan
    is kept."""
    seconds = iter([0.95, 1.04] * 20)

    def own(x):
        now[0] += next(seconds)
        return 2 * x

    race, outcomes = _race(now, {"compiled": _way(now, "compiled", 1.0), "own": own},
                           train=False)
    x = torch.randn(4)
    for _ in range(30):
        race(x)
    ((result, kept, made),) = outcomes
    assert kept == "compiled" and result.extended and result.rounds == 10
    assert made == 2 * (1 + 10)


def test_the_end_of_a_race_updates_the_graphs_record_and_a_cache_that_fails_only_warns(now):
    """The race's end puts the way kept, the ratio and the calls into the graph's record; a
    cost cache that cannot take the race (locked) is closed with a warning, and the call that
    ended the race still returns the graph's result."""
    closed = []

    class Locked:
        def put(self, *args, **kwargs):
            raise sqlite3.OperationalError("database is locked")

        def close(self):
            closed.append(1)

    memlayout.backend_report(clear=True)
    RECORDS.add(GraphRecord("9/0", False, "fp32", False, True, Runner.PLAN_COMPILED,
                            racing=(Runner.PLAN_COMPILED, Runner.PLAN_EAGER)))
    checks = {Runner.PLAN_COMPILED: GraphCheck(True, "the plan compiled", 0.0),
              Runner.PLAN_EAGER: GraphCheck(True, "the plan, eagerly", 1e-7)}
    race = backend_race.CallRace(
        {Runner.PLAN_COMPILED: _way(now, "compiled", 1.0), Runner.PLAN_EAGER: _way(now, "eager", 0.5)},
        reference=Runner.PLAN_COMPILED, margin=KEEP_MARGIN, rounds=5, protect=(), train=False,
        device=torch.device("cpu"), decided=backend_race.decided_here("9/0", "key", Locked, checks))
    x = torch.randn(4)
    with pytest.warns(BackendWarning, match="race not cached"):
        for _ in range(10):
            torch.testing.assert_close(race(x), 2 * x)
    (graph,) = memlayout.backend_report(clear=True).graphs
    assert graph.ran == Runner.PLAN_EAGER and not graph.racing and graph.race_calls == race.calls
    assert dict(graph.timed) == {Runner.PLAN_EAGER: pytest.approx(2.0)}
    assert graph.verification == "the plan, eagerly" and closed == [1]


@pytest.mark.parametrize(("own", "busy"), [(1.9, False), (0.2, True)])
def test_the_race_is_judged_busy_by_the_load_other_jobs_make(monkeypatch, now, own, busy):
    """The 1-minute load average reads 2.8 on 2 CPUs at the race's end. Where this process
    used 1.9 cores over the timed rounds (its own calls, the compile before them), the other
    jobs' load is 0.9: the race is not busy (and a later compile may read it). Where it used
    0.2, the rest is other jobs': busy."""
    fake_load(monkeypatch, load=2.8)
    wall = [0.0]
    monkeypatch.setattr(backend_race.time, "perf_counter", lambda: wall[0])
    monkeypatch.setattr(backend_race.time, "process_time", lambda: own * wall[0])

    def way(seconds):
        def run(x):
            now[0] += seconds
            wall[0] += 1.0
            return 2 * x
        return run
    race, outcomes = _race(now, {"compiled": way(1.0), "eager": way(0.5)}, train=False)
    x = torch.randn(4)
    for _ in range(12):
        race(x)
    ((result, kept, _),) = outcomes
    assert kept == "eager" and result.conditions.busy == busy
    assert result.conditions.load_average == pytest.approx(2.8 - own)
