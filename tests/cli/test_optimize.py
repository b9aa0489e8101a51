"""`memlayout optimize` end to end on a tiny resnet18."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from memlayout.cli import app
from memlayout.plan.report.plan import Plan


def test_optimize_command_plans_verifies_and_times(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MEMLAYOUT_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["optimize", "torchvision:resnet18", "--batch", "1",
                                      "--image-size", "32", "--rounds", "1", "--no-measure",
                                      "--save", str(out)])
    assert result.exit_code == 0, result.output
    assert "verification: equal" in result.output
    assert "optimized vs eager_nchw" in result.output and "optimized vs eager_nhwc" in result.output
    plan = Plan.from_json(out.read_text())
    assert plan.verification.ok and plan.nodes and plan.measured == 0
    # what planning cost: one line, the saved plan's figures
    assert plan.price is not None and plan.price.total == plan.planning_seconds
    text = " ".join(result.output.split())  # the console wraps long lines
    assert text.count("planning took ") == 1
    assert re.search(r"planning took [^:]+: capture .*, costs .* \(analytical\), solve .*, "
                     r"verification [^,]+, other", text)


def test_optimize_command_rejects_an_unknown_dtype(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MEMLAYOUT_CACHE_DIR", str(tmp_path / "cache"))
    result = CliRunner().invoke(app, ["optimize", "torchvision:resnet18", "--dtype", "int8",
                                      "--batch", "1", "--image-size", "32"])
    assert result.exit_code == 2
    assert "dtype 'int8' is not supported" in result.output


def test_optimize_command_lets_the_plan_choose_the_input_format(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MEMLAYOUT_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "plan.json"
    args = ["optimize", "torchvision:resnet18", "--batch", "1", "--image-size", "32",
            "--rounds", "0", "--no-measure"]
    result = CliRunner().invoke(app, [*args, "--input-format", "auto", "--save", str(out)])
    assert result.exit_code == 0, result.output
    plan = Plan.from_json(out.read_text())
    assert plan.input_format in ("contiguous", "channels_last")
    assert f"inputs should arrive {plan.input_format}" in " ".join(plan.notes)
    bad = CliRunner().invoke(app, [*args, "--input-format", "nlc"])
    assert bad.exit_code == 2 and "input_format 'nlc'" in bad.output
