"""Plans are a durable format: ``Plan.from_json`` refuses what is not a plan of this schema
with a ``PlanError`` naming the field, and ``memlayout.apply`` applies a saved plan to a model
without measuring, refusing a model or torch the plan was not made for."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import memlayout
from memlayout.cli import app
from memlayout.errors import PlanError
from memlayout.plan.check import guard as g
from memlayout.plan.costs import measure as costs
from memlayout.plan.pipeline import optimize
from memlayout.plan.report.plan import Plan
from memlayout.plan.report.records import (
    DTYPE_TOLERANCE,
    SCHEMA,
    Conversion,
    GuardRecord,
    NodeChoice,
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


def test_something_that_is_not_json_text_is_a_plan_error() -> None:
    with pytest.raises(PlanError, match="takes the JSON text.*got dict"):
        Plan.from_json(_data())


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


# ---------------------------------------------------------------- memlayout.apply


class Net(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.body = nn.Conv2d(width, width, 3, padding=1)
        self.head = nn.Conv2d(width, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.stem(x)))
        return self.head(y + self.body(y))


class Longer(Net):
    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Conv2d(8, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.stem(x)))
        return self.head(self.extra(y + self.body(y)))


def _x() -> torch.Tensor:
    return torch.randn(2, 3, 8, 8)


def _saved(model: nn.Module, **kwargs: Any) -> Plan:
    kwargs = {"measure": False, "cache": False, "input_format": "channels_last", **kwargs}
    return Plan.from_json(optimize(model, _x(), **kwargs).plan.to_json())


@pytest.fixture
def no_timing(monkeypatch):
    """Applying a plan times nothing: any timer call fails the test."""
    def fail(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("apply measured something")

    monkeypatch.setattr(costs, "interleaved", fail, raising=False)
    monkeypatch.setattr(g, "time_candidates", fail)


def test_a_saved_plan_applies_to_the_same_model_without_measuring(no_timing) -> None:
    torch.manual_seed(0)
    model = Net().eval()
    saved = _saved(model)
    assert saved.counts["channels_last"] > 0 and saved.model_signature
    opt = memlayout.apply(copy.deepcopy(model), saved)
    assert [(n.name, n.format) for n in opt.plan.nodes] == [(n.name, n.format) for n in saved.nodes]
    assert opt.plan.measured == 0 and opt.plan.verification.ok
    assert opt.plan.input_format == "channels_last" and not opt.training
    assert opt.stem.weight.stride() == (27, 1, 9, 3)  # converted as planned
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_plan_file_and_the_guard_s_choice_are_applied(tmp_path, no_timing) -> None:
    model = Net().eval()
    plan = _saved(model)
    path = tmp_path / "plan.json"
    kept = dataclasses.replace(plan.guard or GuardRecord("planned", 0.0, "none", 0),
                               kept="all_channels_last")
    path.write_text(dataclasses.replace(plan, guard=kept).to_json())
    opt = memlayout.apply(model, path)  # the eager NHWC model the guard kept
    assert opt.plan.guard.kept == "all_channels_last"
    assert all(p.stride() == (p.shape[1] * 9, 1, p.shape[1] * 3, p.shape[1])
               for p in opt.parameters() if p.dim() == 4 and p.shape[-1] == 3)


def test_a_training_plan_applies_in_train_mode() -> None:
    model = Net().train()
    opt = memlayout.apply(copy.deepcopy(model), _saved(model, train=True))
    assert opt.training and opt.plan.train and opt.plan.verification.train


@pytest.mark.parametrize("other, message", [
    (lambda: Longer().eval(), r"layout node 'extra' \(Conv2d\), which the plan does not"),
    (lambda: Net(width=16).eval(), r"parameter or value shapes"),
])
def test_a_plan_for_another_model_is_refused(other, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        memlayout.apply(other(), _saved(Net().eval()))


def test_a_plan_of_another_torch_or_input_shape_is_refused() -> None:
    model = Net().eval()
    plan = _saved(model)
    with pytest.raises(PlanError, match=r"made with torch 0\.1.*plan the model again"):
        memlayout.apply(model, dataclasses.replace(plan, torch_version="0.1"))
    with pytest.raises(PlanError, match=r"shapes \[\[1, 3, 8, 8\]\].*made for \[\[2, 3, 8, 8\]\]"):
        memlayout.apply(model, plan, torch.randn(1, 3, 8, 8))


def test_a_bad_plan_file_is_a_plan_error_naming_the_file(tmp_path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(_saved(Net().eval()).to_json()[:100])
    with pytest.raises(PlanError, match=f"plan file {path}: plan JSON: not valid JSON"):
        memlayout.apply(Net(), path)
    with pytest.raises(PlanError, match="cannot be read"):
        memlayout.apply(Net(), tmp_path / "missing.json")


def test_apply_refuses_a_meta_device_model() -> None:
    plan = _saved(Net().eval())
    with torch.device("meta"):
        model = Net()
    with pytest.raises(PlanError, match="meta device.*to_empty"):
        memlayout.apply(model, plan)


def test_the_optimize_command_applies_a_saved_plan(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MEMLAYOUT_CACHE_DIR", str(tmp_path / "cache"))
    factory = tmp_path / "nets.py"
    factory.write_text("import torch\nfrom torch import nn\n\n"
                       "def net():\n    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), "
                       "nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))\n")
    spec = f"{factory}:net"
    out = tmp_path / "plan.json"
    args = ["optimize", spec, "--batch", "2", "--image-size", "8", "--rounds", "0",
            "--no-measure", "--input-format", "channels_last"]
    first = CliRunner().invoke(app, [*args, "--save", str(out)])
    assert first.exit_code == 0, first.output
    again = CliRunner().invoke(app, ["optimize", spec, "--rounds", "0", "--plan", str(out)])
    assert again.exit_code == 0, again.output
    assert "verification: equal" in again.output and "applied from a saved plan" in again.output
    out.write_text("{")
    bad = CliRunner().invoke(app, ["optimize", spec, "--rounds", "0", "--plan", str(out)])
    assert bad.exit_code != 0 and "not valid JSON" in bad.output
    assert "Traceback" not in bad.output
