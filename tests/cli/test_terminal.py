"""What reaches the terminal is for a person: nothing torch prints or logs while capture tries
a model, one short line per reason a part is not captured (torch's whole text in the plan's
JSON and under ``--debug``), and headers that agree with the notes beside them."""

from __future__ import annotations

import contextlib
import io
import json
import runpy

import pytest
import torch
from typer.testing import CliRunner

from memlayout.cli import app
from memlayout.plan.report.plan import Plan
from tests.support.faults import write_models

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_models(tmp_path_factory.mktemp("terminal"))


def _export_failure(models) -> tuple[BaseException, str]:
    """What torch.export itself raises on the gate, and what it writes to stderr meanwhile."""
    gate = runpy.run_path(str(models))["Gate"]()
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed), pytest.raises(Exception) as info:
        torch.export.export(gate, (torch.randn(2, 8, 16, 16),), strict=False)
    return info.value, printed.getvalue()


def _optimize(models, tmp_path, *flags: str):
    return CliRunner().invoke(app, ["optimize", f"{models}:gated", "--no-measure", "--rounds",
                                    "0", "--no-cache", "--save", str(tmp_path / "plan.json"),
                                    *flags])


def test_capture_prints_nothing_of_torch_and_one_short_line_per_reason(models, tmp_path):
    failure, printed = _export_failure(models)
    whole = str(failure).strip()
    detail = whole.splitlines()[1:]
    assert "def forward" in printed and detail  # torch prints the graph; its message runs on
    res = _optimize(models, tmp_path)
    assert res.exit_code == 0, res.output
    out = res.output
    assert "def forward" not in out and printed.strip().splitlines()[-1] not in out
    text = " ".join(out.split())
    # the whole model and its gate fail for the same reason: one line for both
    assert text.count("not captured whole:") == 1
    assert "not captured whole: (whole model), gate: torch.fx: TraceError:" in text
    assert f"torch.export: {type(failure).__name__}:" in text
    assert not any(line.strip() and " ".join(line.split()) in text for line in detail)
    # torch's whole text is kept in the plan
    plan = Plan.from_json((tmp_path / "plan.json").read_text())
    reasons = dict(map(tuple, plan.uncaptured))
    assert f"{type(failure).__name__}: {whole}" in reasons["gate"]


def test_debug_shows_torchs_whole_text_and_what_it_printed(models, tmp_path):
    failure, _ = _export_failure(models)
    res = _optimize(models, tmp_path, "--debug")
    assert res.exit_code == 0, res.output
    assert "torch.export printed while exporting Gate" in res.output and "def forward" in res.output
    text = " ".join(res.output.split())
    detail = [" ".join(line.split()) for line in str(failure).strip().splitlines()[1:]]
    assert all(line in text for line in detail if line)
    assert json.loads((tmp_path / "plan.json").read_text())["uncaptured"]


def test_the_audit_header_gives_the_batch_that_ran(models):
    given = runpy.run_path(str(models))["own_input"]()[1]
    res = CliRunner().invoke(app, ["audit", f"{models}:own_input", "--batch", "8"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "--batch and --image-size do not apply" in text
    assert f"(inference, batch {given.shape[0]})" in text and "batch 8" not in text
