"""Measurements you can trust on a busy machine: rounds made 30x slower (an injected clock) are
detected, taken again and never cached as quiet costs; a plan made under load (an injected
load reading) is not reused silently on a quiet machine; a cost table that predicts far more
than the guard measures is measured once more, and said to be suspect if it still does."""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import warnings

import pytest

import memlayout
import memlayout.plan.costs.measure as costs
from memlayout.machine import Conditions
from memlayout.plan.capture.regions import capture
from memlayout.plan.check import guard
from memlayout.plan.costs.cache import CostCache
from memlayout.plan.costs.measure import RETRIES, measure_costs
from tests.support.models import Branchy, Features
from tests.support.models import batch as _x

QUIET = Conditions(0.5, 2, 2, "PASSIVE", "2026-12-01T10:00:00+00:00")


class SampleClock:
    """A clock read in pairs (start, end of one timed sample): sample ``i`` lasts 1 ms, or
    30 ms where ``slow(i)``."""

    def __init__(self, slow) -> None:
        self.slow, self.now, self.reads, self.samples = slow, 0.0, 0, 0

    def __call__(self) -> float:
        if self.reads % 2:
            self.now += 1e-3 * (30.0 if self.slow(self.samples) else 1.0)
            self.samples += 1
        self.reads += 1
        return self.now


@pytest.fixture
def db(tmp_path):
    return tmp_path / "costs.sqlite"


def _timing_runs(monkeypatch) -> list[int]:
    """Records the rounds of every interleaved timing the cost step runs."""
    seen: list[int] = []
    real = costs.interleaved

    def counting(fns, **kwargs):
        seen.append(kwargs["rounds"])
        return real(fns, **kwargs)

    monkeypatch.setattr(costs, "interleaved", counting)
    return seen


def _measure(db, clock, **kwargs):
    gm = capture(Features().eval(), (_x(),)).regions[0].gm
    store = CostCache(db, conditions=lambda: QUIET)
    try:
        return measure_costs(gm, (_x(),), cache=store, rounds=5, clock=clock,
                             conditions=lambda: QUIET, **kwargs)
    finally:
        store.close()


def _noisy_entries(db) -> tuple[int, int]:
    """(noisy, all) cached timings of ops and conversions (an agnostic op's record, 0 s, is
    not a timing)."""
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT noisy FROM entries WHERE kind IN ('node', 'convert') "
                           "AND json_extract(value, '$.s') > 0").fetchall()
    con.close()
    return sum(n for (n,) in rows), len(rows)


def test_rounds_made_30x_slower_are_taken_again_then_kept_and_reused_as_noisy(db,
                                                                            monkeypatch) -> None:
    runs = _timing_runs(monkeypatch)
    # every fifth sample 30x: in each measurement some rounds are, the median is not
    table = _measure(db, SampleClock(lambda i: i % 5 == 0))
    assert table.timed_costs > 0 and table.noisy_costs == table.timed_costs
    assert runs.count(5) == (1 + RETRIES) * table.measured  # each taken again, bounded
    noisy, total = _noisy_entries(db)
    assert total > 0 and noisy == total  # cached, but never as quiet costs
    # taken on a quiet machine, the spread is the ops' own: reused and counted noisy, not
    # measured again (which would move the plan by noise alone)
    again = _measure(db, SampleClock(lambda i: False))
    assert again.measured == 0 and again.noisy_costs == table.noisy_costs
    assert _noisy_entries(db) == (noisy, total)


def test_a_burst_of_slow_rounds_is_measured_again_and_cached_quiet(db, monkeypatch) -> None:
    runs = _timing_runs(monkeypatch)
    # the first node's first-call timings are samples 0 and 1; its rounds start at 2
    table = _measure(db, SampleClock(lambda i: 2 <= i < 5))
    assert runs.count(5) == table.measured + 1  # one measurement taken again
    assert table.noisy_costs == 0 and _noisy_entries(db)[0] == 0
    seconds = {s for n in table.nodes.values() if n.timed for s in n.seconds}
    assert len(seconds) == 1  # the 30x rounds left no trace: every op its quiet time


def test_a_plan_made_under_load_is_not_reused_silently_when_quiet(db, monkeypatch) -> None:
    model = Branchy().eval()
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))  # 9 jobs on 2 cores
    loaded = memlayout.optimize(model, _x(), cache=db, rounds=1, guard_rounds=2).plan
    assert loaded.costs_timed > 0 and loaded.costs_noisy == loaded.costs_timed
    assert f"{loaded.costs_noisy} of {loaded.costs_timed} costs noisy" in loaded.summary()
    assert loaded.guard.conditions.busy and "busy machine" in loaded.summary()
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    quiet = memlayout.optimize(model, _x(), cache=db, rounds=1, guard_rounds=2).plan
    assert quiet.cached == 0 and quiet.measured == loaded.measured  # all measured again
    assert quiet.costs_noisy == 0 and "noisy" not in quiet.summary()
    assert quiet.guard.source == "measured"
    cached = memlayout.optimize(model, _x(), cache=db, rounds=1, guard_rounds=2).plan
    assert cached.measured == 0 and cached.costs_noisy == 0  # quiet numbers are reused


def _inflate_cached_costs(db, factor: float) -> None:
    """Costs as a loaded machine leaves them in a cache that took them for quiet ones."""
    with sqlite3.connect(db) as con:
        con.execute("UPDATE entries SET value = json_set(value, '$.s', "
                    "json_extract(value, '$.s') * ?) WHERE kind IN ('node', 'convert') "
                    "AND json_extract(value, '$.s') IS NOT NULL", (factor,))
    con.close()


def test_costs_far_above_the_measured_model_are_measured_once_more(db) -> None:
    model = Branchy().eval()
    first = memlayout.optimize(model, _x(), cache=db, rounds=1, guard_rounds=2).plan
    _inflate_cached_costs(db, 1000.0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        again = memlayout.optimize(model, _x(), cache=db, rounds=1, guard_rounds=2,
                                   reuse=False).plan  # from the cached costs, not the plan
    assert again.measured == first.measured  # the suspect table was measured again
    assert guard.suspect(again.predicted["planned"], again.guard.planned_seconds) is None
    assert not any("suspect" in str(w.message) for w in seen)
    assert not any("suspect" in note for note in again.notes)


def test_a_plan_still_disagreeing_after_measuring_again_says_so(db, monkeypatch) -> None:
    real = guard.time_candidates

    def far_faster(*args, **kwargs):  # the whole model measures 10000x under the prediction
        race = real(*args, **kwargs)
        return dataclasses.replace(race, reference_seconds=race.reference_seconds * 1e-4)

    monkeypatch.setattr(guard, "time_candidates", far_faster)
    calls = _timing_runs(monkeypatch)
    with pytest.warns(UserWarning, match="suspect costs"):
        plan = memlayout.optimize(Branchy().eval(), _x(), cache=db, rounds=1,
                                  guard_rounds=2).plan
    assert any(note.startswith("the plan rests on suspect costs") for note in plan.notes)
    assert "suspect costs" in plan.summary()
    assert calls.count(1) >= 2 * plan.measured  # the costs were measured twice
