"""Plans are a durable format: ``Plan.from_json`` refuses what is not a plan of this schema
with a ``PlanError`` naming the field, and ``memlayout.apply`` applies a saved plan to a model
without measuring, refusing a model or torch the plan was not made for."""

from __future__ import annotations

import json
from typing import Any

import pytest

from memlayout.errors import PlanError
from memlayout.plan.result import (
    DTYPE_TOLERANCE,
    SCHEMA,
    Conversion,
    NodeChoice,
    Plan,
    Verification,
)


def _plan() -> Plan:
    return Plan(model="m", device="cpu", torch_version="2", dtype="bfloat16",
                input_format="contiguous", output_format="keep",
                nodes=[NodeChoice("", "conv", "Conv2d", "channels_last",
                                  {"contiguous": 2.0, "channels_last": 1.0}, True)],
                conversions=[Conversion("", "x", "channels_last", [[1, 3, 8, 8]], 768, 0.1,
                                        ["conv"])],
                predicted={"planned": 1.0},
                verification=Verification(True, DTYPE_TOLERANCE, 0.0, 1e-3, 1))


def _data() -> dict[str, Any]:
    return json.loads(_plan().to_json())


def test_a_plan_round_trips() -> None:
    assert Plan.from_json(_plan().to_json()) == _plan()


@pytest.mark.parametrize("text, message", [
    ("", "not valid JSON"),
    (_plan().to_json()[:200], "not valid JSON.*truncated or corrupt"),
    ("\x00\x01garbage", "not valid JSON"),
    ("[1, 2]", "expected an object.*got list"),
    ("null", "expected an object.*got NoneType"),
])
def test_corrupt_or_truncated_json_is_a_plan_error(text: str, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        Plan.from_json(text)


@pytest.mark.parametrize("schema, message", [
    (None, "no \"schema\".*plan the model again"),
    (0, "older memlayout.*plan the model again"),
    (SCHEMA + 1, "newer memlayout.*upgrade memlayout"),
    ("1", "expected an int"),
])
def test_another_schema_says_what_to_do(schema: Any, message: str) -> None:
    data = _data()
    if schema is None:
        del data["schema"]
    else:
        data["schema"] = schema
    with pytest.raises(PlanError, match=message):
        Plan.from_json(json.dumps(data))


def _edited(path: list[Any], value: Any) -> str:
    data = _data()
    target = data
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return json.dumps(data)


_DELETE: Any = object()

#: (field path, new value, the field and expectation the error names)
BAD_FIELDS = [
    (["nodes"], _DELETE, r"plan: missing field 'nodes'"),
    (["nodes"], None, r"plan\.nodes: expected list\[NodeChoice\], got None"),
    (["nodes"], {"a": 1}, r"plan\.nodes: expected list\[NodeChoice\]"),
    (["nodes", 0, "format"], "bogus", r"plan\.nodes\[0\]\.format: expected one of 'contiguous', "
                                      r"'channels_last', got 'bogus'"),
    (["nodes", 0, "format"], 1, r"plan\.nodes\[0\]\.format: expected str, got 1 \(int\)"),
    (["nodes", 0, "seconds"], {"nhwc": 1.0}, r"plan\.nodes\[0\]\.seconds: .*got 'nhwc'"),
    (["nodes", 0, "seconds", "contiguous"], "fast", r"seconds\['contiguous'\]: expected float"),
    (["nodes", 0, "name"], _DELETE, r"plan\.nodes\[0\]: missing field 'name'"),
    (["conversions", 0, "to"], "channels_first", r"plan\.conversions\[0\]\.to: .*'channels_first'"),
    (["conversions", 0, "nbytes"], "768", r"plan\.conversions\[0\]\.nbytes: expected int"),
    (["conversions", 0, "nbytes"], True, r"plan\.conversions\[0\]\.nbytes: expected int, got True"),
    (["input_format"], "nhwc", r"plan\.input_format: expected one of None, 'contiguous'"),
    (["output_format"], "sideways", r"plan\.output_format: .*'keep'.*got 'sideways'"),
    (["dtype"], "float8", r"plan\.dtype: .*got 'float8'"),
    (["verification", "ok"], "yes", r"plan\.verification\.ok: expected bool"),
    (["verification"], [1], r"plan\.verification: expected Verification"),
    (["measured"], 1.5, r"plan\.measured: expected int, got 1\.5"),
    (["regions"], "", r"plan\.regions: expected list\[str\]"),
]


@pytest.mark.parametrize("path, value, message", BAD_FIELDS,
                         ids=[".".join(map(str, p)) + f"={v!r}"[:20] for p, v, _ in BAD_FIELDS])
def test_a_bad_field_is_a_plan_error_naming_it(path: list[Any], value: Any, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        Plan.from_json(_edited(path, value))


def test_a_field_appended_later_loads_with_its_default() -> None:
    data = _data()
    del data["weight_formats_kept"], data["notes"]
    plan = Plan.from_json(json.dumps(data))
    assert plan.weight_formats_kept is False and plan.notes == []


def test_a_plan_error_is_a_value_error_for_callers_that_catch_those() -> None:
    with pytest.raises(ValueError, match="schema"):
        Plan.from_json(_edited(["schema"], 99))
