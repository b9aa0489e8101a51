"""The cost model fitted to this machine's cached timings (memlayout.plan.costs.predict), and
planning with it: only what could change the cut is timed."""

from __future__ import annotations

import itertools
import json
import math
import sqlite3
import statistics

import pytest
import torch
from torch import nn

from memlayout.plan.capture.regions import capture
from memlayout.plan.costs.cache import CostCache
from memlayout.plan.costs.measure import measure_costs, node_context
from memlayout.plan.costs.predict import (
    MIN_SAMPLES,
    PRIOR_SIGMA,
    CostModel,
    Sample,
    Z,
    samples_of,
)
from memlayout.plan.pipeline import optimize

#: (m0 / a0, (m1 / m0) / (a1 / a0)) of the samples of one op kind
FACTORS = [(2.0, 0.8), (2.2, 0.85), (1.8, 0.75), (2.1, 0.8), (1.9, 0.9), (2.0, 0.7)]


def _samples(kind: str = "Conv2d:dense:3x3/1x1") -> list[Sample]:
    out = []
    for i, (r0, q) in enumerate(FACTORS):
        a0, a1 = 1e-4 * (i + 1), 0.85e-4 * (i + 1)
        m0 = a0 * r0
        out.append(Sample(kind, m0, a0, m0 * (a1 / a0) * q, a1, f"p{i}"))
    return out


def test_the_fit_centres_on_the_median_ratios_and_predicts_from_them():
    model = CostModel.fit(_samples())
    fit = model.kinds["Conv2d:dense:3x3/1x1"]
    assert fit.r0 == pytest.approx(statistics.median(r for r, _ in FACTORS))
    assert fit.q == pytest.approx(statistics.median(q for _, q in FACTORS), rel=1e-2)
    assert fit.samples == len(FACTORS)
    guess = model.predict("Conv2d:dense:3x3/1x1", (1e-3, 0.5e-3))
    assert guess.seconds[0] == pytest.approx(1e-3 * fit.r0)
    assert guess.seconds[1] == pytest.approx(0.5e-3 * fit.r0 * fit.q)


def test_the_width_is_the_widest_change_of_the_difference_over_the_box():
    """Checked on a grid over both factors' intervals (a second method: the corners claim)."""
    model = CostModel.fit(_samples())
    fit = model.kinds["Conv2d:dense:3x3/1x1"]
    a0, a1 = 1e-3, 0.7e-3
    guess = model.predict("Conv2d:dense:3x3/1x1", (a0, a1))
    delta = guess.seconds[1] - guess.seconds[0]
    grid = [i / 10 for i in range(-10, 11)]
    widest = 0.0
    for u, v in itertools.product(grid, grid):
        c0 = a0 * fit.r0 * math.exp(u * Z * fit.sigma0)
        c1 = c0 * (a1 / a0) * fit.q * math.exp(v * Z * fit.sigma_q)
        widest = max(widest, abs((c1 - c0) - delta))
    assert guess.width == pytest.approx(widest, rel=1e-9)


def test_an_op_kind_without_enough_samples_gets_the_wide_prior():
    few = CostModel.fit(_samples()[:MIN_SAMPLES - 1])
    assert few.kinds["Conv2d:dense:3x3/1x1"].sigma0 == PRIOR_SIGMA
    unseen = CostModel.fit(_samples()).predict("BatchNorm2d", (1e-4, 1e-4))
    assert unseen.width >= 1e-4 * unseen.seconds[0] / 1e-4 * (math.exp(Z * PRIOR_SIGMA) - 1)
    assert CostModel.fit([]).predict("BatchNorm2d", (1e-4, None)).width == 0.0  # pinned


def test_a_timing_far_off_does_not_set_the_fit():
    quiet = CostModel.fit(_samples()).kinds["Conv2d:dense:3x3/1x1"]
    busy = _samples()
    busy[0] = Sample(busy[0].kind, busy[0].m0 * 300, busy[0].a0, busy[0].m1 * 300, busy[0].a1,
                     "p0")
    fit = CostModel.fit(busy).kinds["Conv2d:dense:3x3/1x1"]
    assert fit.r0 == pytest.approx(quiet.r0, rel=0.1) and fit.sigma0 < 0.5


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8), nn.ReLU()).eval()


def test_every_timed_node_stores_what_the_fit_reads(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(1, 3, 12, 12)
    region = capture(_net(), (x,)).regions[0]
    store = CostCache(tmp_path / "costs.sqlite")
    table = measure_costs(region.gm, region.inputs, cache=store, rounds=1)
    timed = [c for c in table.nodes.values() if c.timed]
    context = node_context(torch.device("cpu"), None, train=False, weights="converted")
    samples = samples_of(store.records("node"), context)
    assert len(timed) == 4  # two convolutions, two batch norms (one op: timed once)
    assert sorted(s.kind for s in samples) == ["BatchNorm2d", "Conv2d:dense:1x1/1x1",
                                               "Conv2d:dense:3x3/1x1"]
    assert samples_of(store.records("node"), [*context, "train"]) == []  # another context


def _warm_cache(path, model: nn.Module, x: torch.Tensor, conversion: float) -> None:
    """A cache whose fit is exact (every op kind of ``model`` measured as the analytical model
    says, under keys of no real op) and whose conversions of ``model``'s values cost
    ``conversion`` seconds each; none of ``model``'s own node costs."""
    region = capture(model, (x,)).regions[0]
    store = CostCache(path)
    measure_costs(region.gm, region.inputs, cache=store, rounds=1)
    records = store.records("node")
    for key, record in records:
        if "a" not in record:
            continue
        parts = json.loads(key)
        for i in range(MIN_SAMPLES + 1):
            scaled = {**record, "s": record["a"] * (i + 1), "a": record["a"] * (i + 1),
                      "id": f"{record['id']}-{i}"}
            store.put(json.dumps([*parts[:-2], f"{parts[-2]}#fit{i}", parts[-1]]), scaled)
    for key, record in store.records("convert"):
        store.put(key, {**record, "s": conversion})
    store.close()
    with sqlite3.connect(path) as db:  # the model's own node timings: not in the cache
        db.execute("DELETE FROM entries WHERE kind = 'node' AND key NOT LIKE '%#fit%'")


def test_with_a_fitted_cache_only_what_could_change_the_cut_is_timed(tmp_path):
    """Conversions of a second each: no node's cost can move the cut, so nothing is timed with
    prediction on; with it off every layout-sensitive node is, and the labels agree."""
    torch.manual_seed(0)
    model, x = _net(), torch.randn(1, 3, 12, 12)
    path = tmp_path / "costs.sqlite"
    _warm_cache(path, model, x, conversion=1.0)
    options = dict(cache=path, guard=False, rounds=1, memory=False, padding=False)
    on = optimize(model, x, predict=True, **options)
    off = optimize(model, x, predict=False, **options)
    assert on.plan.prediction is not None and off.plan.prediction is None
    assert (on.plan.prediction.measured, on.plan.prediction.predicted) == (0, 4)
    assert on.plan.prediction.regret == 0.0 and on.plan.price.predicted == 4
    assert sum(n.timed for n in off.plan.nodes) == 4
    assert [n.format for n in on.plan.nodes] == [n.format for n in off.plan.nodes]
    assert "4 predicted" in on.plan.summary()
