"""The one timer (``memlayout.timing``), driven by a fake clock: known times in, known out.

Every callable advances a fake clock by a duration the test chose, so the expected medians,
spreads and per-round ratios are computed here from those durations (with ``statistics``),
independently of the code under test.
"""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest
import scipy.stats

from memlayout.machine import Conditions
from memlayout.plan.check import guard
from memlayout.timing import (
    KEEP_MARGIN,
    SEQUENTIAL_ROUNDS,
    Race,
    Ratio,
    geomean,
    interleaved,
    separated,
)


class FakeClock:
    """A clock that only moves when a timed callable says how long it took."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls: list[str] = []

    def __call__(self) -> float:
        return self.now

    def work(self, name: str, durations: list[float]):
        it = iter(durations)

        def fn() -> None:
            self.calls.append(name)
            self.now += next(it)

        return fn


# Per-round durations chosen so that the median of per-round ratios (1.0) differs from the
# ratio of the medians (3 / 2.5 = 1.2): the timer must pair rounds, not medians.
BASE = [2.0, 4.0, 3.0, 1.0, 5.0]
FAST = [1.0, 4.0, 3.0, 1.0, 2.5]


def test_medians_spread_and_per_round_ratios_from_known_times():
    clock = FakeClock()
    c = interleaved({"base": clock.work("base", BASE), "fast": clock.work("fast", FAST)},
                    rounds=5, warmup=0, clock=clock)
    assert c["base"].times == tuple(BASE) and c["fast"].times == tuple(FAST)
    assert c["base"].median == statistics.median(BASE)
    assert c["fast"].median == statistics.median(FAST)
    assert (c["fast"].min, c["fast"].max) == (min(FAST), max(FAST))
    q = statistics.quantiles(FAST, n=4, method="inclusive")
    assert c["fast"].iqr == (q[0], q[2])
    assert c["fast"].spread == pytest.approx((max(FAST) - min(FAST)) / statistics.median(FAST))
    expected = [b / f for b, f in zip(BASE, FAST, strict=True)]
    assert c.ratios("fast") == pytest.approx(expected)
    assert c.speedup("fast") == pytest.approx(statistics.median(expected))
    assert c.speedup("fast") != pytest.approx(c["base"].median / c["fast"].median)
    assert c.speedup_range("fast") == pytest.approx((min(expected), max(expected)))
    assert c.speedup("base") == 1.0


def test_a_ratio_gives_the_ratio_of_the_medians_beside_the_per_round_ones():
    clock = FakeClock()
    c = interleaved({"base": clock.work("base", BASE), "fast": clock.work("fast", FAST)},
                    rounds=5, warmup=0, clock=clock)
    r = c.ratio("base", "fast")  # base time / fast time: > 1, fast is faster
    assert r.of_medians == pytest.approx(statistics.median(BASE) / statistics.median(FAST))
    assert r.per_round == pytest.approx(c.ratios("fast"))
    assert r.median == pytest.approx(c.speedup("fast")) and r.median != pytest.approx(r.of_medians)
    assert (r.min, r.max) == pytest.approx(c.speedup_range("fast"))
    assert c.per_round("fast", "base") == pytest.approx([f / b for b, f in zip(BASE, FAST, strict=True)])


def test_repeat_records_seconds_per_call_and_warmup_is_untimed():
    clock = FakeClock()
    # warm-up call takes 100 s (compile); then 2 rounds x 3 calls of 1 s, 2 s, 3 s / 4 s, 5 s, 6 s
    c = interleaved({"a": clock.work("a", [100.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0])},
                    rounds=2, warmup=1, repeat=3, clock=clock)
    assert c["a"].times == (2.0, 5.0)
    assert clock.calls == ["a"] * 7
    assert (c.rounds, c.repeat, c.warmup) == (2, 3, 1)


@pytest.mark.parametrize("rotate", [True, False])
def test_rotation_order_is_logged_and_followed(rotate):
    clock = FakeClock()
    names = ["a", "b", "c"]
    c = interleaved({n: clock.work(n, [1.0] * 10) for n in names}, rounds=4, warmup=1,
                    clock=clock, rotate=rotate)
    rotations = [names[r % 3:] + names[:r % 3] for r in range(3)]
    expected = [*rotations, rotations[0][::-1]] if rotate else [names] * 4
    assert [list(o) for o in c.order] == expected
    timed_calls = clock.calls[len(names):]  # after one warm-up call each, in name order
    assert clock.calls[:len(names)] == names
    assert timed_calls == [n for order in expected for n in order]


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_rounds_vary_each_modes_position_and_predecessor(n):
    names = [f"m{i}" for i in range(n)]
    clock = FakeClock()
    c = interleaved({m: clock.work(m, [1.0] * 4 * n) for m in names}, rounds=2 * n, warmup=0,
                    clock=clock)
    sequence = [m for order in c.order for m in order]
    for m in names:
        assert sorted(order.index(m) for order in c.order) == sorted(list(range(n)) * 2)
        before = {sequence[i - 1] for i in range(1, len(sequence)) if sequence[i] == m}
        assert len(before) >= min(2, n - 1), (m, before)  # not always after the same mode


def test_on_step_sees_every_timed_sample_before_it_runs():
    clock = FakeClock()
    seen: list[tuple[int, str, int]] = []
    c = interleaved({n: clock.work(n, [1.0] * 5) for n in "ab"}, rounds=2, warmup=0,
                    clock=clock, on_step=lambda r, n: seen.append((r, n, len(clock.calls))))
    assert [(r, n) for r, n, _ in seen] == [(r, n) for r, order in enumerate(c.order) for n in order]
    assert [k for _, _, k in seen] == list(range(4))  # called before the sample, not after


def test_sync_runs_before_every_clock_read():
    log: list[str] = []
    now = [0.0]

    def clock() -> float:
        log.append("clock")
        now[0] += 1.0
        return now[0]

    interleaved({"a": lambda: log.append("a"), "b": lambda: log.append("b")}, rounds=2,
                warmup=1, clock=clock, sync=lambda: log.append("sync"))
    reads = [i for i, e in enumerate(log) if e == "clock"]
    assert reads and all(log[i - 1] == "sync" for i in reads)
    assert log.count("a") == log.count("b") == 3


def test_failing_mode_is_recorded_and_the_others_go_on():
    clock = FakeClock()
    good = clock.work("good", [9.0, 1.0, 2.0, 3.0, 4.0])
    calls = {"n": 0}

    def flaky() -> None:
        calls["n"] += 1
        if calls["n"] == 3:  # warm-up and round 0 work; round 1 fails
            raise MemoryError("out of memory at batch 8")
        clock.now += 0.5

    c = interleaved({"good": good, "flaky": flaky}, rounds=4, warmup=1, clock=clock)
    assert c["good"].ok and c["good"].times == (1.0, 2.0, 3.0, 4.0)
    assert not c["flaky"].ok and c["flaky"].error == "MemoryError: out of memory at batch 8"
    assert c["flaky"].error_type is MemoryError
    assert c["flaky"].times == (0.5,)  # round 0 only; dropped after the failure
    assert calls["n"] == 3
    assert all("flaky" not in order for order in c.order[2:])
    assert c.ratios("flaky") == (2.0,)  # the rounds both ran: round 0
    assert c["good"].error is None and c["good"].error_type is None


def test_failing_warmup_and_failing_baseline():
    clock = FakeClock()

    def broken() -> None:
        raise RuntimeError("unsupported op")

    c = interleaved({"base": broken, "other": clock.work("other", [1.0, 1.0, 1.0])},
                    rounds=2, warmup=1, clock=clock)
    assert c["base"].times == () and c["base"].error_type is RuntimeError
    assert c["other"].times == (1.0, 1.0)
    assert c.speedup("other") is None and c.speedup_range("other") is None

    all_broken = interleaved({"x": broken}, rounds=3, warmup=0, clock=clock)
    assert all_broken["x"].error and all_broken.order == (("x",),)  # tried once, then dropped


def test_bad_arguments_raise_value_errors():
    with pytest.raises(ValueError, match="at least one"):
        interleaved({})
    with pytest.raises(ValueError, match="rounds >= 1"):
        interleaved({"a": lambda: None}, rounds=0)
    with pytest.raises(ValueError, match="baseline 'z'"):
        interleaved({"a": lambda: None}, baseline="z")


def test_geomean_agrees_with_scipy():
    values = [1.25, 0.8, 2.0, 1.1]
    assert geomean(values) == pytest.approx(float(scipy.stats.gmean(values)))
    with pytest.raises(ValueError):
        geomean([])


# --- Race: what an interleaved race decided -----------------------------------------------

def _race(reference: str = "ref", **per_round: tuple[float, ...]) -> Race:
    return Race(reference, {n: Ratio(reference, n, statistics.median(r), r)
                            for n, r in per_round.items()}, rounds=3)


@pytest.mark.parametrize("margin", [0.0, 0.02, 0.1])
def test_a_race_keeps_the_default_unless_the_fastest_median_beats_it_by_the_margin(margin):
    rounds = {"a": (1.04, 1.06, 1.05), "b": (0.9, 1.2, 1.08), "c": (0.7, 0.8, 0.75)}
    race = _race(**rounds)
    medians = {"ref": 1.0, **{n: statistics.median(r) for n, r in rounds.items()}}
    best = max(medians, key=medians.__getitem__)
    for default in ("ref", "a", "c", "failed"):
        base = medians.get(default, 1.0)  # a default that did not run: the reference
        want = best if medians[best] > base * (1 + margin) else (
            default if default in medians else "ref")
        assert race.kept(default, margin) == want, (default, margin)
    assert race.kept() == race.kept("ref", KEEP_MARGIN)
    assert (race.median("b"), race.min("b"), race.max("b")) == (
        statistics.median(rounds["b"]), min(rounds["b"]), max(rounds["b"]))


@pytest.mark.parametrize("margin", [0.0, 0.02])
def test_a_close_call_is_a_decision_the_rounds_leave_able_to_cost_more_than_the_margin(margin):
    threshold = 1 + margin
    near = tuple(threshold + d for d in (-0.01, 0.0, 0.01))  # the reference kept, one round beyond
    far = tuple(threshold + d for d in (0.2, 0.3, 0.25))
    wide = tuple(threshold + d for d in (-0.5, -0.2, 0.4, 0.6, 0.3))  # median 0.3 above it
    assert _race(x=near).is_close(margin)
    assert not _race(x=far).is_close(margin)
    assert _race(x=wide).is_close(margin)  # kept on a median, slower than the reference in two
    assert not _race().is_close(margin)  # nothing but the reference ran
    # rounds that agree, however near the threshold: a candidate faster than the reference in
    # every round keeps it, and one never faster beyond the margin leaves the reference
    above = tuple(threshold + d for d in (0.01, 0.02, 0.015))
    below = tuple(threshold - d for d in (0.01, 0.02, 0.015))
    assert _race(x=above).kept("ref", margin) == "x" and not _race(x=above).is_close(margin)
    assert _race(x=below).kept("ref", margin) == "ref" and not _race(x=below).is_close(margin)
    # every round within the margin of the reference: a tie, whichever is kept (no margin:
    # every round equal to the reference's, which is kept and cannot lose)
    tie = tuple(1 + d * margin for d in (0.5, -0.5, 0.0))
    assert not _race(x=tie).is_close(margin)
    assert _race(x=near).settled(margin) is False
    assert dataclasses.replace(_race(x=near), extended=True).settled(margin)


def test_a_race_goes_through_json_and_the_records_codec_unchanged():
    busy = Conditions(load_average=9.0, cpu_count=2, threads=2, omp_wait_policy="")
    race = dataclasses.replace(_race("planned", nhwc=(1.1, 1.3, 1.2)), errors={"x": "boom"},
                               extended=True, conditions=busy, reference_seconds=0.5,
                               spread=0.1)
    back = guard.load(json.loads(json.dumps(dataclasses.asdict(race))))
    assert back == race and back.busy
    assert not guard.is_race({"ratios": {"nhwc": [1.1]}, "rounds": 1})  # no reference


@pytest.mark.parametrize(("seconds", "margin", "stops"), [
    ({"ref": 1.0, "fast": 0.5}, 0.02, True),  # twice as fast every round: decided at once
    ({"ref": 1.0, "slow": 2.0}, 0.02, True),  # as clearly slower
    ({"ref": 1.0, "close": 0.975}, 0.02, False),  # within the close band: all rounds
    ({"ref": 1.0, "tie": 0.99}, 0.02, True),  # every round within the margin: a tie
    ({"ref": 1.0, "fast": 0.5, "faster": 0.49}, 0.02, False),  # the two winners too close
    ({"ref": 1.0, "fast": 0.5, "faster": 0.25}, 0.02, True),
])
def test_a_sequential_race_stops_once_more_rounds_cannot_change_the_decision(
        seconds: dict[str, float], margin: float, stops: bool) -> None:
    now = [0.0]

    def step(name: str):
        def run() -> None:
            now[0] += seconds[name]  # a clock the steps advance: no real time measured
        return run

    rounds = 9
    c = interleaved({n: step(n) for n in seconds}, rounds=rounds, baseline="ref",
                           clock=lambda: now[0], stop=separated("ref", margin, rounds))
    ran = len(c["ref"].times)
    # decided once more than half the rounds agree: the rest cannot move the medians across
    assert ran == (max(SEQUENTIAL_ROUNDS, rounds // 2 + 1) if stops else rounds)
    race = Race("ref", {n: Ratio.of_times("ref", n, c["ref"].times, c[n].times)
                               for n in seconds if n != "ref"}, rounds=ran)
    # what it keeps is what the full race keeps: the fastest beyond the margin, else ref
    best = min(seconds, key=seconds.__getitem__)
    want = best if seconds["ref"] / seconds[best] > 1 + margin else "ref"
    assert race.kept("ref", margin) == want
