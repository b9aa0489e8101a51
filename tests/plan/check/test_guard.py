"""The guard: the min-cut plan timed as a whole model against all-NCHW and all-NHWC. Timings
come from an injected clock through the real ``memlayout.timing.interleaved``, so the expected
decision follows from what goes in, not from this machine's speed."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import memlayout
import memlayout.plan.check.guard as guard
import memlayout.plan.costs.measure as costs
from memlayout.plan.capture.regions import capture
from memlayout.plan.graph import Label
from memlayout.plan.report.records import RatioRange
from memlayout.plan.solve import regions as solve_regions
from memlayout.plan.solve.mincut import Solution
from memlayout.timing import KEEP_MARGIN, Race
from tests.support.machine import fake_guard_clock as _clock
from tests.support.machine import fake_load as _machine
from tests.support.models import Branchy, Features
from tests.support.models import batch as _x


def _fake_clock(monkeypatch: pytest.MonkeyPatch, seconds: dict[str, float],
                default: float = 2.0) -> None:
    """Whole-model calls of candidate ``name`` take ``seconds[name]`` (else ``default``) on a
    fake clock; everything else about the timing is the real one."""
    _clock(monkeypatch, lambda name, _call: seconds.get(name, default))


def _no_timing(*args, **kwargs):
    raise AssertionError("something was timed although everything is in the cache")


def _plan_all_contiguous(monkeypatch) -> None:
    """Make the solver label every unpinned node contiguous (so the guard has work to do)."""
    real = solve_regions.solve_min_cut
    monkeypatch.setattr(solve_regions, "solve_min_cut", lambda problem: Solution(
        {k: problem.pins.get(k, 0) for k in real(problem).labels}, 0))


@pytest.mark.parametrize("target,fmt", [("all_channels_last", "channels_last"),
                                        ("all_contiguous", "contiguous")])
def test_guard_replaces_the_plan_with_a_clearly_faster_uniform_one(db, monkeypatch, target,
                                                                   fmt) -> None:
    _fake_clock(monkeypatch, {target: 1.0})
    model, x = Branchy().eval(), _x()
    opt = memlayout.optimize(model, x, cache=db, rounds=1, guard_rounds=3)
    g = opt.plan.guard
    assert g.source == "measured"
    if target in g.skipped:  # the min-cut plan already is that labelling
        # (the fake clock times the plan like the other candidate: a tie, timed twice as long)
        assert g.kept == "planned" and g.extended and g.rounds == 6
    else:
        assert g.kept == target and not g.extended and g.rounds == 3
        assert g.candidates[target] == RatioRange(median=2.0, min=2.0, max=2.0)
    convs = [n.format for n in opt.plan.nodes if n.op == "Conv2d"]
    assert convs and set(convs) == {fmt}  # convolutions are never pinned: all follow the kept
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)
    assert opt.plan.verification.ok


def test_an_eager_candidate_keeps_output_format_and_state_dict_keys(db, monkeypatch) -> None:
    # the kept candidate is the original run in channels-last: a feature map it returns comes
    # back in the format the original returns it in, and state dicts load both ways
    _fake_clock(monkeypatch, {"all_channels_last": 1.0})
    real = solve_regions.solve_min_cut

    def all_contiguous(problem):  # a plan that is not channels-last, whatever was measured
        return Solution({k: problem.pins.get(k, 0) for k in real(problem).labels}, 0)

    monkeypatch.setattr(solve_regions, "solve_min_cut", all_contiguous)
    model, x = Features().eval(), _x()
    opt = memlayout.optimize(model, x, cache=db, rounds=1, guard_rounds=2)
    assert opt.plan.guard.skipped == ("all_contiguous",)  # that is the plan already
    assert opt.plan.guard.kept == "all_channels_last"
    assert [c.value for c in opt.plan.conversions] == ["x"]  # the input, on entry
    assert {n.format for n in opt.plan.nodes} == {"channels_last"}
    with torch.no_grad():
        want, got = model(x), opt(x)
    assert memlayout.format_of(got) == memlayout.format_of(want) == memlayout.Format.CONTIGUOUS
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert list(opt.state_dict()) == list(model.state_dict())
    opt.load_state_dict(Features().state_dict())


@pytest.mark.parametrize("target,fmt", [("all_channels_last", "channels_last"),
                                        ("all_contiguous", "contiguous")])
def test_auto_input_format_times_each_candidate_with_its_own_inputs(db, monkeypatch, target,
                                                                    fmt) -> None:
    # input_format="auto": no candidate pays an input conversion in its timed call, and when
    # an eager model wins, its format is the one the inputs should arrive in
    _fake_clock(monkeypatch, {target: 1.0})
    _plan_all_contiguous(monkeypatch)
    seen: dict[str, set] = {}
    real = guard.time_candidates

    def spy(models, inputs, dtype, **kwargs):
        own = kwargs.get("inputs_of") or {}
        for name in models:
            seen[name] = {memlayout.format_of(t) for t in own.get(name, inputs)}
        return real(models, inputs, dtype, **kwargs)

    monkeypatch.setattr(guard, "time_candidates", spy)
    model, x = Branchy().eval(), _x()
    opt = memlayout.optimize(model, x, cache=db, rounds=1, guard_rounds=2, input_format="auto")
    g = opt.plan.guard
    for name, label in guard.UNIFORM.items():
        if name in seen:
            assert seen[name] == {Label(label).format(4)}
    assert seen["planned"] == {memlayout.Format.CONTIGUOUS}  # the plan: all contiguous
    if target in g.skipped:
        assert g.kept == "planned"
    else:
        assert g.kept == target
    assert opt.plan.input_format == fmt
    assert [c.value for c in opt.plan.conversions if c.value == "x"] == []
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)


class DictOut(torch.nn.Module):
    """Segmentation models return a dict of feature maps."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Features()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": self.body(x)}


def test_an_eager_candidate_keeps_dict_outputs_in_their_format(db, monkeypatch) -> None:
    _fake_clock(monkeypatch, {"all_channels_last": 1.0})
    _plan_all_contiguous(monkeypatch)
    model, x = DictOut().eval(), _x()
    opt = memlayout.optimize(model, x, cache=db, rounds=1, guard_rounds=2)
    assert opt.plan.guard.kept == "all_channels_last"
    with torch.no_grad():
        want, got = model(x), opt(x)
    assert list(got) == ["out"]
    assert memlayout.format_of(got["out"]) == memlayout.format_of(want["out"])
    torch.testing.assert_close(got["out"], want["out"], rtol=1e-4, atol=1e-5)


def test_a_plan_uniform_end_to_end_runs_as_that_eager_model(db, monkeypatch) -> None:
    _fake_clock(monkeypatch, {"planned": 1.0})
    _plan_all_contiguous(monkeypatch)
    model, x = Features().eval(), _x()
    # padding off: on an AVX-512 CPU (16 floats a vector) the 8-channel convolutions are
    # padding candidates, and one padded where that measured faster (real timings) is steered
    opt = memlayout.optimize(model, x, cache=db, rounds=1, guard_rounds=2, padding=False)
    assert opt.plan.guard.kept == "planned" and opt.plan.guard.skipped == ("all_contiguous",)
    # the original modules, the model's own forward: only the root converts, on entry
    assert [p for p, m in opt.named_modules() if "forward" in m.__dict__] == [""]
    assert type(opt) is type(model)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)


def test_guard_keeps_the_plan_within_the_margin(db, monkeypatch) -> None:
    # every other candidate 1 % faster than the plan: inside the 2 % margin, the plan stays
    _fake_clock(monkeypatch, {"planned": 1.0}, default=0.99)
    opt = memlayout.optimize(Branchy().eval(), _x(), cache=db, rounds=1, guard_rounds=2,
                             guard_margin=0.02)
    g = opt.plan.guard
    assert g.kept == "planned" and g.candidates
    assert all(c.median == pytest.approx(1 / 0.99) for c in g.candidates.values())


@pytest.mark.parametrize("seconds", [0.99, 0.97])
def test_by_default_near_ties_keep_the_plan_and_rounds_that_agree_decide(
        db, monkeypatch, seconds: float) -> None:
    # every other candidate 1 % or 3 % faster: with the default margin (timing.KEEP_MARGIN) a
    # candidate replaces the plan only beyond it. 1 % in every round is a tie within the
    # margin (timing.tied); 3 % in every round keeps the candidate: no round has it slower
    # than the plan, so keeping it cannot lose. Neither is timed longer
    _fake_clock(monkeypatch, {"planned": 1.0}, default=seconds)
    opt = memlayout.optimize(Branchy().eval(), _x(), cache=db, rounds=1, guard_rounds=3)
    g = opt.plan.guard
    assert g.margin == KEEP_MARGIN and not g.extended and g.rounds == 3
    assert (g.kept == "planned") == (1 / seconds <= 1 + KEEP_MARGIN)
    assert g.kept in g.candidates or g.kept == "planned"
    assert "twice the rounds" not in opt.plan.summary()
    assert opt.plan.verification.ok


def test_a_clear_call_is_not_extended(db, monkeypatch) -> None:
    _fake_clock(monkeypatch, {"planned": 1.0}, default=1.5)
    opt = memlayout.optimize(Branchy().eval(), _x(), cache=db, rounds=1, guard_rounds=3)
    g = opt.plan.guard
    assert g.kept == "planned" and not g.extended and g.rounds == 3


def _spread_clock(monkeypatch: pytest.MonkeyPatch, cycle: tuple[float, ...]) -> None:
    """The plan's calls take 1 s on a fake clock; each other candidate's calls take the
    seconds of ``cycle`` in turn (a noisy machine: rounds spread around the plan's time)."""
    _clock(monkeypatch, lambda name, i: 1.0 if name == "planned" else cycle[i % len(cycle)])


def test_rounds_that_spread_across_the_threshold_are_a_close_call(db, monkeypatch) -> None:
    # per-round ratios planned / candidate 1.25, 0.83, 0.77: the median (0.83) is far from 1,
    # but the rounds lie on both sides of it; five rounds like these cannot decide
    _spread_clock(monkeypatch, (0.8, 1.2, 1.3))
    model, x = Branchy().eval(), _x()
    with monkeypatch.context() as mp:  # as a record cached before close calls were known
        mp.setattr(Race, "is_close", lambda race, margin: False)
        first = memlayout.optimize(model, x, cache=db, rounds=1, guard_rounds=3)
    assert not first.plan.guard.extended and first.plan.guard.rounds == 3
    second = memlayout.optimize(model, x, cache=db, rounds=1, guard_rounds=3)
    g = second.plan.guard
    assert g.source == "measured"  # the unsettled cached decision was not reused
    assert g.extended and g.rounds == 6 and "twice the rounds" in second.plan.summary()
    monkeypatch.setattr(guard, "interleaved", _no_timing)
    third = memlayout.optimize(model, x, cache=db, rounds=1, guard_rounds=3)
    assert third.plan.guard.source == "cache"  # timed longer: settled


def test_second_optimize_measures_nothing_not_even_the_guard(db, monkeypatch) -> None:
    _fake_clock(monkeypatch, {"all_contiguous": 1.0})
    model, x = Branchy().eval(), _x()
    first = memlayout.optimize(model, x, cache=db, rounds=1, guard_rounds=2)
    assert first.plan.measured > 0 and first.plan.guard.source == "measured"
    monkeypatch.setattr(guard, "interleaved", _no_timing)
    monkeypatch.setattr(costs, "interleaved", _no_timing)
    second = memlayout.optimize(model, x, cache=db, rounds=1, guard_rounds=2)
    assert second.plan.measured == 0 and second.plan.guard.source == "cache"
    assert second.plan.guard.kept == first.plan.guard.kept
    assert second.plan.guard.candidates == first.plan.guard.candidates
    assert [n.format for n in second.plan.nodes] == [n.format for n in first.plan.nodes]
    assert second.plan.verification.ok  # verification still runs: never from the cache


def test_a_decision_measured_on_a_busy_machine_is_measured_again_and_said(db,
                                                                        monkeypatch) -> None:
    _fake_clock(monkeypatch, {"all_contiguous": 1.0})
    _machine(monkeypatch, load=5.0)
    model, x = Branchy().eval(), _x()
    first = memlayout.optimize(model, x, cache=db, rounds=1, guard_rounds=2)
    assert first.plan.guard.conditions.busy
    assert "measured on a busy machine" in first.plan.summary()
    timed: list[int] = []
    real = guard.interleaved
    monkeypatch.setattr(guard, "interleaved", lambda *a, **k: timed.append(1) or real(*a, **k))
    _machine(monkeypatch, load=0.0)
    second = memlayout.optimize(model, x, cache=db, rounds=1, guard_rounds=2)
    assert timed and second.plan.guard.source == "measured"  # not the busy cached record
    assert not second.plan.guard.conditions.busy
    assert "busy machine" not in second.plan.summary()
    monkeypatch.setattr(guard, "interleaved", _no_timing)
    third = memlayout.optimize(model, x, cache=db, rounds=1, guard_rounds=2)
    assert third.plan.guard.source == "cache"  # a quiet machine's decision is reused


def test_no_guard_without_measurement(db, monkeypatch) -> None:
    monkeypatch.setattr(guard, "interleaved", _no_timing)
    opt = memlayout.optimize(Branchy().eval(), _x(), measure=False)
    assert opt.plan.guard is None and opt.plan.measured == 0


def test_signature_follows_shapes_and_labels() -> None:
    def sig(size: int, labels: dict[str, int]) -> str:
        gm = capture(Features().eval(), (_x(2, size),)).regions[0].gm
        return guard.signature([("", gm, labels)])

    assert sig(12, {"a": 1}) == sig(12, {"a": 1})  # fresh weights, same graph: same key
    assert sig(12, {"a": 1}) != sig(14, {"a": 1})
    assert sig(12, {"a": 1}) != sig(12, {"a": 0})


@pytest.fixture
def db(tmp_path):
    return tmp_path / "costs.sqlite"


def test_refresh_measures_everything_again_and_overwrites_the_cache(db, monkeypatch) -> None:
    _fake_clock(monkeypatch, {"all_contiguous": 1.0})
    model, x = Branchy().eval(), _x()
    first = memlayout.optimize(model, x, cache=db, rounds=1, guard_rounds=2)
    again = memlayout.optimize(model, x, cache=db, rounds=1, guard_rounds=2, refresh=True)
    assert again.plan.measured == first.plan.measured and again.plan.cached == 0
    assert again.plan.guard.source == "measured"
    # what the refresh measured is what the cache now holds: a third plan reads it back
    monkeypatch.setattr(guard, "interleaved", _no_timing)
    monkeypatch.setattr(costs, "interleaved", _no_timing)
    third = memlayout.optimize(model, x, cache=db, rounds=1, guard_rounds=2)
    assert third.plan.measured == 0 and third.plan.guard.source == "cache"
    assert third.plan.guard.candidates == again.plan.guard.candidates
    assert [n.seconds for n in third.plan.nodes] == [n.seconds for n in again.plan.nodes]


def test_a_candidate_out_of_the_running_leaves_the_race_and_its_rounds_stay_paired(
        monkeypatch) -> None:
    # "slow" takes twice the reference's time in every round: once enough rounds say so
    # (timing.behind) it is not timed again, not even when the close call between the
    # reference and "close" (about 4 % faster, slower in one round of three) is timed for as
    # many rounds again
    close = (0.95, 1.04, 1.06)  # per-round ratios reference / "close"
    seconds = {"planned": 1.0, "slow": 2.0}
    _clock(monkeypatch, lambda name, i: seconds.get(name) or 1 / close[i % len(close)])
    calls = dict.fromkeys(("planned", "slow", "close"), 0)

    def step(name: str):
        def run() -> None:
            calls[name] += 1
        return run

    race = guard.time_steps({n: step(n) for n in calls}, device=torch.device("cpu"),
                            rounds=5, margin=KEEP_MARGIN)
    assert race.extended and race.rounds == 10
    assert len(race.ratios["close"].per_round) == race.rounds
    assert 0 < len(race.ratios["slow"].per_round) < 5 and calls["slow"] < calls["close"]
    # each ratio from rounds run side by side: the fake clock's exact ratios, nothing misaligned
    assert race.ratios["slow"].per_round == pytest.approx(
        [0.5] * len(race.ratios["slow"].per_round))
    assert all(any(r == pytest.approx(c) for c in close) for r in race.ratios["close"].per_round)
    assert race.kept("planned") == "close"


#: per-round ratios reference / candidate: around 1.0 with a round beyond the threshold 1.02
#: (the reference kept, the candidate perhaps faster beyond the margin), and around 1.04 with
#: a round below 1 (the candidate kept, perhaps slower)
BELOW, ABOVE = (0.98, 1.0, 1.05), (0.95, 1.04, 1.06)


@pytest.mark.parametrize(("name", "cycle", "protect", "extended"), [
    ("eager", BELOW, ("inductor",), False),  # close, the reference's side
    ("eager", ABOVE, ("inductor",), True),  # close, the rounds would keep it
    ("inductor", BELOW, ("inductor",), True),  # close to what must not be lost
    ("eager", BELOW, None, True),  # no protect: every close call (the planner's)
])
def test_a_close_call_is_timed_longer_only_where_the_reference_could_lose_by_it(
        monkeypatch, name, cycle, protect, extended) -> None:
    # one candidate's calls take 1 / ``cycle``'s ratios in turn, the reference's 1 s: per
    # round ratios around 1.0 (below the threshold 1.02, not a tie) or around 1.04 (above it)
    _clock(monkeypatch, lambda n, i: 1.0 if n == "planned" else 1 / cycle[i % len(cycle)])
    steps = {n: (lambda: None) for n in ("planned", name)}
    race = guard.time_steps(steps, device=torch.device("cpu"), rounds=5, margin=KEEP_MARGIN,
                            protect=protect)
    ratios = race.ratios[name].per_round
    assert race.extended == extended and race.rounds == (10 if extended else 5)
    assert abs(race.median(name) - (1 + KEEP_MARGIN)) < 0.03  # a close call on these rounds
    assert not all(1 / (1 + KEEP_MARGIN) <= r <= 1 + KEEP_MARGIN for r in ratios)  # no tie
    assert race.protect == protect and race.settled(KEEP_MARGIN)  # its decision stands
    back = guard.load(json.loads(json.dumps(dataclasses.asdict(race))))
    assert back.protect == protect and back.is_close(KEEP_MARGIN) == race.is_close(KEEP_MARGIN)


@pytest.mark.parametrize("protect", [("own",), None])
def test_a_close_calls_extra_rounds_time_only_the_candidates_it_is_close_with(
        monkeypatch, protect) -> None:
    # "own" is a close call (per-round ratios around 1.0, the threshold 1.02); "eager" lies
    # clearly below the threshold (median 0.93, quartiles below it) with one round above it,
    # so it is not retired: the extra rounds time the reference and "own" only
    cycles = {"own": tuple(1 / r for r in BELOW),
              "eager": tuple(1 / r for r in (0.9, 0.93, 1.05, 0.9, 0.95))}
    _clock(monkeypatch, lambda n, i: 1.0 if n == "planned" else cycles[n][i % len(cycles[n])])
    race = guard.time_steps({n: (lambda: None) for n in ("planned", "own", "eager")},
                            device=torch.device("cpu"), rounds=5, margin=KEEP_MARGIN,
                            protect=protect)
    assert race.extended and race.rounds == 10
    assert len(race.ratios["own"].per_round) == 10 and len(race.ratios["eager"].per_round) == 5
    assert race.kept("planned") == "planned" and race.settled(KEEP_MARGIN)
