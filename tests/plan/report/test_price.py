"""What planning cost (``plan.price``): every step's seconds within the total, the costs timed
or read from the cache counted, the optional steps present only where they ran, a JSON round
trip, plans written without it still read, and one summary line."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import memlayout
from memlayout.plan.report.plan import Plan
from memlayout.plan.report.records import Price
from memlayout.plan.reuse import REUSED
from tests.support.models import Branchy, Features


def _x() -> torch.Tensor:
    return torch.randn(1, 3, 10, 10)


def _check(price: Price, plan: Plan) -> None:
    """The price's structure: every step's seconds non-negative and within the total, which
    is the plan's own; the counts the plan's."""
    assert price.total == plan.planning_seconds
    assert all(s >= 0 for s in price.steps.values()) and price.other >= 0
    assert sum(price.steps.values()) <= price.total
    assert (price.measured, price.cached) == (plan.measured, plan.cached)
    assert list(price.steps)[:4] == ["capture", "costs", "solve", "guard"]
    assert list(price.steps)[-1] == "verify"


def test_a_warm_cache_measures_nothing_and_says_so(tmp_path) -> None:
    model, db = Branchy().eval(), tmp_path / "costs.sqlite"
    first = memlayout.optimize(model, _x(), cache=db, rounds=1, guard=False, padding=False)
    again = memlayout.optimize(model, _x(), cache=db, rounds=1, guard=False, padding=False,
                               reuse=False)  # planned again from the cached costs
    reused = memlayout.optimize(model, _x(), cache=db, rounds=1, guard=False, padding=False)
    for opt in (first, again, reused):
        _check(opt.plan.price, opt.plan)
    assert first.plan.price.measured > 0
    assert again.plan.price.measured == 0
    assert again.plan.price.cached >= first.plan.price.measured  # identical ops timed once
    # the stored plan rebuilt: nothing measured, read or solved; only verification runs again
    assert REUSED in reused.plan.notes and (reused.plan.price.measured,
                                             reused.plan.price.cached) == (0, 0)
    assert reused.plan.price.verify > 0 and reused.plan.price.costs < again.plan.price.costs
    # the optional steps: memory on, padding off, no mkldnn report
    assert again.plan.price.memory is not None
    assert again.plan.price.padding is None and again.plan.price.blocked is None
    line = [s for s in again.plan.summary().splitlines() if s.startswith("planning took")]
    assert len(line) == 1 and "(0 measured, " in line[0] and "padding" not in line[0]
    assert "memory check" in line[0] and "verification" in line[0]


def test_analytical_costs_report_no_measuring_and_only_the_steps_that_ran() -> None:
    opt = memlayout.optimize(Features().eval(), _x(), measure=False, memory=False)
    price = opt.plan.price
    _check(price, opt.plan)
    assert (price.measured, price.cached) == (0, 0)
    assert price.padding is None and price.memory is None and price.blocked is None
    assert set(price.steps) == {"capture", "costs", "solve", "guard", "verify"}
    assert "costs" in opt.plan.summary() and "(analytical)" in opt.plan.summary()


def _price() -> Price:
    return Price(total=3.0, capture=0.5, costs=2.0, measured=10, cached=4, solve=0.1,
                 guard=0.2, verify=0.1, memory=0.05)


def _plan(price: Price | None) -> Plan:
    return Plan(model="m", device="cpu", torch_version="2", dtype=None,
                input_format="contiguous", output_format="keep", nodes=[], conversions=[],
                predicted={"planned": 1e-3}, measured=10, cached=4,
                planning_seconds=3.0 if price is None else price.total, price=price)


def test_the_price_survives_the_json_round_trip() -> None:
    plan = _plan(_price())
    again = Plan.from_json(plan.to_json())
    assert again == plan and isinstance(again.price, Price)
    assert json.loads(plan.to_json())["price"]["measured"] == 10


def test_a_plan_written_without_a_price_loads_and_reads_as_before() -> None:
    data = json.loads(_plan(_price()).to_json())
    del data["price"]
    plan = Plan.from_json(json.dumps(data))
    assert plan.price is None
    assert "measured 10, from cache 4, planning took 3.0 s" in plan.summary()
    assert "planning took 3.0 s:" not in plan.summary()


@pytest.mark.parametrize("applied, heads", [
    (False, ["planning took 3.0 s: "]),
    # a saved plan applied: this run's own figures, then what making the plan cost
    (True, ["measured 0, from cache 0, planning took 0.5 s", "the saved plan's planning took"]),
])
def test_one_summary_line_says_where_the_time_went(applied: bool, heads: list[str]) -> None:
    plan = _plan(_price())
    if applied:
        plan = dataclasses.replace(plan, measured=0, cached=0, planning_seconds=0.5)
    lines = plan.summary().splitlines()
    found = [line for line in lines if any(line.startswith(h) for h in heads)]
    assert len(found) == len(heads)
    price_line = found[-1]
    for part in ("capture 0.5 s", "costs 2.0 s (10 measured, 4 from the cache)", "solve 0.1 s",
                 "build and guard 0.2 s", "memory check 50 ms", "verification 0.1 s"):
        assert part in price_line
    assert "padding" not in price_line and "mkldnn" not in price_line
