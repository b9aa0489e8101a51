"""The plan's records: a JSON round trip of every record type, and what they say on screen
(which verification check passed, grouped drop notes, noisy comparisons)."""

from __future__ import annotations

import json

import pytest

from memlayout.errors import PlanError
from memlayout.machine import Conditions
from memlayout.plan.check.speed import ModelComparison
from memlayout.plan.graph import Label
from memlayout.plan.report.describe import drop_lines, guard_summary, memory_summary
from memlayout.plan.report.plan import Plan
from memlayout.plan.report.records import (
    DTYPE_TOLERANCE,
    FLOAT64_RECHECK,
    BlockedChain,
    BlockedReport,
    CompiledRecord,
    GuardRecord,
    MemoryCandidate,
    MemoryReport,
    NodeChoice,
    PadChoice,
    RatioRange,
    Verification,
    decode,
)
from memlayout.plan.steer.boundary import Leaf, Returned
from memlayout.timing import interleaved

BUSY = Conditions(5.0, 2, 2, "", "2026-01-01T00:00:00+00:00")
QUIET = Conditions(0.5, 2, 2, "PASSIVE", "2026-01-01T00:00:00+00:00")


def _plan() -> Plan:
    return Plan(
        model="m", device="cpu", torch_version="2", dtype="bfloat16", input_format="channels_last",
        output_format="keep",
        nodes=[NodeChoice("", "conv", "Conv2d", "channels_last",
                          {"contiguous": 2e-3, "channels_last": 1e-3}, True)],
        conversions=[], predicted={"planned": 1e-3},
        verification=Verification(True, FLOAT64_RECHECK, 0.15, 1e-3, 12, train=True,
                                  float64_error=1e-13, seconds=0.5),
        guard=GuardRecord("planned", 0.0, "measured", 5,
                          candidates={"all_contiguous": RatioRange(0.9, 0.8, 1.1)},
                          skipped=("all_channels_last",), seconds=1.0, conditions=BUSY),
        padding=(PadChoice("c", 3, 5, [1, 3, 8, 8], "channels_last",
                           {"unpadded": 2e-6, "both8": 1e-6}, "both8", "measured",
                           ratios={"both8": 2.0}, whole_model=1.1),),
        memory=MemoryReport("tensor_lifetime", 10, 12, 1, 1, 100, 100, 20, "planned",
                            candidates={"planned": MemoryCandidate(12, 1e-3)}),
        blocked=BlockedReport(True, "1 of 1 chains faster", (
            BlockedChain("", ["0", "1"], [1, 3, 8, 8], ["Conv2d", "ReLU"], "measured",
                         {"planned": 2.0, "mkldnn": 1.0}, 2.0, 0.0),)),
        compiled=CompiledRecord("inductor", "planned", "measured",
                                settings={"planned": {"layout_optimization": False}},
                                candidates={"inductor": RatioRange(0.9, 0.8, 1.0)},
                                compile_seconds={"planned": 3.0}, rounds=5),
        train=True, input_shapes=[[1, 3, 8, 8]])


def test_every_record_survives_the_json_round_trip_with_its_types() -> None:
    plan = _plan()
    text = plan.to_json()
    assert json.loads(text)["schema"] == 1
    again = Plan.from_json(text)
    assert again == plan
    assert isinstance(again.guard.conditions, Conditions) and again.guard.conditions.busy
    assert isinstance(again.padding[0], PadChoice) and isinstance(again.blocked.chains[0], BlockedChain)
    assert again.guard.skipped == ("all_channels_last",)  # tuples come back as tuples


def test_named_tuples_and_enums_come_back_as_their_types_or_are_named() -> None:
    written = (Leaf(2, Label.CHANNELS_LAST, 4), Returned(0, None, 4))
    data = json.loads(json.dumps(written))  # as the cost cache holds it: lists and ints
    again = decode(tuple[Leaf, Returned], data)
    assert again == written
    assert type(again[0]) is Leaf and type(again[0].label) is Label and again[1].label is None
    with pytest.raises(PlanError, match=r"\[0\]\.label: expected Label, got 7"):
        decode(tuple[Leaf, Returned], [[2, 7, 4], [0, None, 4]], "s")
    with pytest.raises(PlanError, match=r"label: expected Label, got True"):
        decode(Leaf, [2, True, 4], "leaf")
    with pytest.raises(PlanError, match=r"leaf: expected Leaf, got \[2, 1\]"):
        decode(Leaf, [2, 1], "leaf")


def test_a_plan_json_of_another_schema_is_refused() -> None:
    data = json.loads(_plan().to_json())
    data["schema"] = 2
    with pytest.raises(ValueError, match="schema 2"):
        Plan.from_json(json.dumps(data))
    del data["schema"]  # a plan JSON written without the schema's records
    with pytest.raises(ValueError, match="schema None"):
        Plan.from_json(json.dumps(data))


def test_verification_says_which_check_passed() -> None:
    tolerance = Verification(True, DTYPE_TOLERANCE, 2e-5, 1e-3, 4).describe()
    assert "within the dtype tolerance" in tolerance and "float64" not in tolerance
    recheck = _plan().verification.describe()
    assert "float64 re-check" in recheck and "within the dtype tolerance" not in recheck
    assert "above the tolerance 0.001" in recheck  # 0.15 is never shown as within it


def test_summary_says_a_training_plans_memory_is_not_a_training_step() -> None:
    plan = _plan()
    assert "one inference forward" not in memory_summary(plan.memory, train=True)
    assert "one inference forward" in memory_summary(plan.memory, train=False)
    assert "not the training step" in plan.summary()


def test_a_busy_guard_measurement_is_flagged() -> None:
    g = _plan().guard
    assert "busy machine" in guard_summary(g)
    quiet = GuardRecord(**{**g.__dict__, "conditions": QUIET})
    assert "busy machine" not in guard_summary(quiet)


def test_drop_notes_are_grouped_by_op_and_reason() -> None:
    nodes = [NodeChoice("", f"gn{i}", "GroupNorm", "contiguous", {}, True, ["why a"])
             for i in range(30)]
    nodes += [NodeChoice("", "pad", "pad", "contiguous", {}, True, ["why b"])]
    lines = drop_lines(nodes)
    assert lines == ["drops channels-last: 30 GroupNorm nodes (gn0, gn1, gn2, ...): why a",
                     "drops channels-last: pad (pad): why b"]


def _comparison(times: dict[str, list[float]]) -> ModelComparison:
    ticks: list[float] = []
    now = 0.0
    for i in range(len(next(iter(times.values())))):
        for name in times:  # rotate=False: the order is the dict's
            ticks += [now, now + times[name][i]]
            now += times[name][i]
    it = iter(ticks)
    c = interleaved({name: (lambda: None) for name in times}, rounds=len(ticks) // 2 // len(times),
                    warmup=0, clock=lambda: next(it), rotate=False)
    return ModelComparison.of(c, "optimized", tuple(n for n in times if n != "optimized"), QUIET)


def test_ratios_shown_agree_with_the_medians_shown_and_noise_is_said() -> None:
    quiet = _comparison({"optimized": [1.0, 1.0, 1.0], "eager": [1.1, 1.2, 1.1]})
    lines = quiet.lines("batch")
    assert "optimized vs eager: 1.100x faster (eager / optimized median time" in lines[-1]
    assert not any(line.startswith("warning") for line in lines)
    noisy = _comparison({"optimized": [1.0, 3.0, 1.1], "eager": [1.0, 1.2, 9.0]})
    r = noisy.ratios["eager"]
    assert r.of_medians == pytest.approx(1.2 / 1.1) and r.median != pytest.approx(r.of_medians)
    assert noisy.lines("batch")[-1].startswith("warning: these figures are noisy")
