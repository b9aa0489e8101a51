"""The coverage matrix against direct torch checks on this build.

Each expected verdict is computed here, by applying the op to a channels-last tensor and asking
torch (``is_contiguous(memory_format=...)``), never copied from a run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from memlayout.cli import app
from memlayout.coverage import (
    CoverageConfig,
    OpRecord,
    Values,
    Verdict,
    explain,
    lookup,
    read_json,
    run_coverage,
    save_to_cache,
    write_json,
)
from memlayout.coverage.check import _compare, check_op
from memlayout.coverage.opinfo import load_op_db
from memlayout.coverage.runner import _with_crashes
from memlayout.coverage.store import cached_report
from memlayout.errors import CoverageUnavailableError, LayoutError
from memlayout.layout import Format

CL = torch.channels_last


def _cl(*shape: int, grad: bool = False) -> torch.Tensor:
    x = torch.randn(*shape).contiguous(memory_format=CL)
    return x.requires_grad_(grad)


def _weight(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).contiguous(memory_format=CL).requires_grad_(True)


# OpInfo name -> the same op called directly on channels-last tensors (6 channels, 8x8).
DIRECT = {
    "nn.functional.relu": lambda x: F.relu(x),
    "nn.functional.conv2d": lambda x: F.conv2d(x, _weight(4, 6, 3, 3)),
    "nn.functional.pad.reflect": lambda x: F.pad(x, (1, 2, 1, 2), mode="reflect"),
    "nn.functional.pad.circular": lambda x: F.pad(x, (1, 2, 1, 2), mode="circular"),
    "nn.functional.group_norm": lambda x: F.group_norm(
        x, 3, torch.randn(6, requires_grad=True), torch.randn(6, requires_grad=True)),
    "nn.functional.interpolate.bilinear": lambda x: F.interpolate(
        x, scale_factor=2, mode="bilinear", align_corners=False),
    "nn.functional.interpolate.bicubic": lambda x: F.interpolate(
        x, scale_factor=2, mode="bicubic", align_corners=False),
    "nn.functional.max_pool2d": lambda x: F.max_pool2d(x, 2),
}


def _direct(name: str) -> tuple[Verdict, Verdict, bool]:
    """(forward verdict, backward verdict, values equal to contiguous) straight from torch.

    The backward verdict is the layout of the gradient the op's backward hands to the layer
    before (``torch.autograd.grad``), not of ``x.grad``: AccumulateGrad lays a leaf's ``.grad``
    out like the leaf whatever the kernel returned.
    """
    torch.manual_seed(0)
    x = _cl(2, 6, 8, 8, grad=True)
    torch.manual_seed(1)
    out = DIRECT[name](x)
    (grad,) = torch.autograd.grad(out, x, torch.randn_like(out))
    xc = x.detach().contiguous().requires_grad_(True)
    torch.manual_seed(1)
    ref = DIRECT[name](xc)
    same = torch.allclose(out, ref, rtol=1.3e-6, atol=1e-5)

    def verdict(t: torch.Tensor) -> Verdict:
        return Verdict.PRESERVES if t.is_contiguous(memory_format=CL) else Verdict.DROPS

    return verdict(out), verdict(grad), same


@pytest.fixture(scope="module")
def report():
    try:
        config = CoverageConfig(ops=",".join([*DIRECT, "nn.functional.dropout", "as_strided"]),
                                jobs=0, max_samples=6)
        (rep,) = run_coverage(config, command="pytest")
    except CoverageUnavailableError as exc:
        pytest.skip(f"OpInfo unavailable on this torch build: {exc}")
    return rep


def _rec(report, name: str) -> OpRecord:
    return next(r for r in report.ops if r.name == name)


@pytest.mark.parametrize("name", sorted(DIRECT))
def test_verdicts_match_direct_torch_check(report, name):
    forward, backward, same = _direct(name)
    rec = _rec(report, name)
    assert rec.forward is forward, rec
    assert rec.backward is backward, rec
    if same:
        assert rec.values is Values.AGREE, rec
        assert rec.grads is Values.AGREE, rec
    assert rec.samples > 0 and not rec.errors, rec


def test_direct_checks_see_both_verdicts():
    """The table is only a test when torch keeps the format for some ops and drops it for
    others on this build (circular padding rebuilds its output with new_empty)."""
    verdicts = {_direct(name)[0] for name in DIRECT} | {_direct(name)[1] for name in DIRECT}
    assert verdicts == {Verdict.PRESERVES, Verdict.DROPS}


def test_random_op_is_not_reported_as_disagreement(report):
    torch.manual_seed(0)
    x = _cl(2, 6, 8, 8)
    torch.manual_seed(5)
    a = F.dropout(x, 0.5, training=True)
    torch.manual_seed(5)
    b = F.dropout(x.contiguous(), 0.5, training=True)
    rec = _rec(report, "nn.functional.dropout")
    assert rec.forward is (Verdict.PRESERVES if a.is_contiguous(memory_format=CL) else Verdict.DROPS)
    # same seed, other layout: the mask is drawn in memory order, so values may differ
    assert rec.values in ((Values.AGREE, Values.RANDOM) if torch.equal(a, b) else (Values.RANDOM,))
    assert not rec.disagreements


def test_storage_reading_op_is_not_comparable_but_not_hidden(report):
    """as_strided reads storage directly: its values differ by definition between layouts."""
    x = torch.randn(2, 3, 4, 4)
    a = torch.as_strided(x.contiguous(memory_format=CL), (2, 2), (1, 2))
    b = torch.as_strided(x, (2, 2), (1, 2))
    rec = _rec(report, "as_strided")
    if torch.equal(a, b):
        pytest.skip("as_strided gave equal values here; nothing to check")
    assert rec.values is Values.NOT_COMPARABLE
    assert any("by definition" in n for n in rec.notes)


def test_crashed_samples_are_errors_in_the_record():
    rec = OpRecord("x", Verdict.NOT_APPLICABLE, Verdict.PRESERVES, Values.AGREE, Values.AGREE,
                   error_samples=1, errors=("boom",))
    out = _with_crashes(rec, ["worker process died (signal SIGSEGV) in sample 3"])
    assert out.forward is Verdict.ERROR and out.backward is Verdict.PRESERVES
    assert out.errors[0].startswith("worker process died") and out.error_samples == 2
    assert _with_crashes(rec, []) is rec


class FakeOp:
    """An OpInfo look-alike around ``fn``, one (2, 3, 4, 5) float32 sample."""

    variant_test_name = ""

    def __init__(self, name, fn, autograd=True):
        self.name, self.op, self.supports_autograd = name, fn, autograd

    def supported_dtypes(self, device_type):
        return {torch.float32, torch.float64}

    supported_backward_dtypes = supported_dtypes

    def reference_inputs(self, device, dtype, requires_grad=False):
        # torch's internal test API, as OpInfo itself: only when a sample is drawn
        from torch.testing._internal.opinfo.core import SampleInput

        yield SampleInput(torch.randn(2, 3, 4, 5, dtype=dtype, requires_grad=requires_grad))

    sample_inputs = reference_inputs


def _misread(x):
    """A layout bug: reads a channels-last tensor's memory as if it were contiguous."""
    flat = torch.as_strided(x, (x.numel(),), (1,))
    return flat.view(x.shape) * 2


def test_layout_bug_is_listed_as_disagreement():
    pytest.importorskip("expecttest")
    rec = check_op(FakeOp("misread", _misread))
    assert rec.values is Values.DISAGREE
    assert rec.disagreements and rec.disagreements[0].what == "output 0"
    assert rec.forward is Verdict.DROPS  # the view is contiguous


def test_error_only_in_channels_last_is_reported():
    pytest.importorskip("expecttest")

    def picky(x):
        if x.is_contiguous(memory_format=CL) and not x.is_contiguous():
            raise RuntimeError("no channels-last kernel")
        return x + 1

    rec = check_op(FakeOp("picky", picky))
    assert rec.forward is Verdict.ERROR
    assert "fails only in channels_last" in rec.error


def test_sample_timeout_guards_a_hanging_op():
    pytest.importorskip("expecttest")

    def slow(x):
        time.sleep(5)
        return x

    start = time.monotonic()
    rec = check_op(FakeOp("slow", slow, autograd=False), sample_timeout=0.2)
    assert time.monotonic() - start < 4
    assert rec.forward is Verdict.ERROR and "limit" in rec.error


@pytest.mark.parametrize(("a", "b"), [
    (torch.tensor([1.0, math.nan]), torch.tensor([1.0, math.nan])),
    (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 + 1e-5])),
    (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.001])),
    (torch.tensor([1.0, 2.0]).bfloat16(), torch.tensor([1.0, 2.001]).bfloat16()),
    (torch.tensor([1.0, 256.0]).bfloat16(), torch.tensor([1.0, 258.0]).bfloat16()),
    (torch.tensor([1.0, 256.0]).bfloat16(), torch.tensor([1.0, 300.0]).bfloat16()),
    (torch.tensor([1.0, math.inf]), torch.tensor([1.0, math.inf])),
    (torch.tensor([1.0, math.nan]), torch.tensor([1.0, 1.0])),
    (torch.tensor([1, 2]), torch.tensor([1, 3])),
])
def test_compare_is_assert_close_with_equal_nan(a, b):
    try:
        torch.testing.assert_close(a, b, equal_nan=True)
        expected = True
    except AssertionError:
        expected = False
    assert (_compare(a, b) is None) is expected


def test_json_round_trip_and_cache_lookup(report, tmp_path, monkeypatch):
    monkeypatch.setenv("MEMLAYOUT_CACHE_DIR", str(tmp_path / "cache"))
    write_json([report], tmp_path / "c.json")
    assert read_json(tmp_path / "c.json") == [report]
    json.loads((tmp_path / "c.json").read_text())  # plain JSON

    assert lookup("nn.functional.conv2d") is None  # nothing cached yet
    save_to_cache(report)
    forward, backward, _ = _direct("nn.functional.pad.circular")
    rec = lookup("nn.functional.pad.circular", "cpu", torch.float32)
    assert rec.forward is forward and rec.backward is backward
    assert lookup("nn.functional.pad.circular", "cpu", "bfloat16") is None
    assert lookup("no.such.op") is None

    # aten level: the channels-last runs of conv2d called aten.convolution
    conv_forward = _direct("nn.functional.conv2d")[0]
    for key in ("aten.convolution", "aten.convolution.default", torch.ops.aten.convolution.default,
                torch.ops.aten.convolution):
        assert lookup(key).verdict is conv_forward, key
    text = explain("nn.functional.pad.circular")
    assert text.startswith("nn.functional.pad.circular") and torch.__version__ in text
    assert ("drops" in text) is (forward is Verdict.DROPS)


def test_partial_runs_merge_into_the_cache(report, tmp_path, monkeypatch):
    monkeypatch.setenv("MEMLAYOUT_CACHE_DIR", str(tmp_path))
    save_to_cache(report)
    changed = dataclasses.replace(_rec(report, "nn.functional.relu"), notes=("rerun",))
    save_to_cache(dataclasses.replace(report, ops=(changed,)))
    cached = cached_report()
    assert {r.name for r in cached.ops} == {r.name for r in report.ops}
    assert lookup("nn.functional.relu").notes == ("rerun",)


def test_config_rejects_bad_format_and_dtype():
    with pytest.raises(LayoutError, match="channels_last_3d"):
        CoverageConfig(fmt=Format.CONTIGUOUS)
    with pytest.raises(LayoutError, match="known"):
        CoverageConfig(dtypes=("float33",))


def test_cli_isolated_workers_agree_with_in_process(report, tmp_path, monkeypatch):
    """The CLI path (worker process, files, cache) gives the records the in-process run gave."""
    monkeypatch.setenv("MEMLAYOUT_CACHE_DIR", str(tmp_path / "cache"))
    ops = "nn.functional.pad.circular,nn.functional.relu"
    result = CliRunner().invoke(app, ["coverage", "--ops", ops, "--max-samples", "6",
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "forward:" in result.output
    (rep,) = read_json(tmp_path / "out" / "coverage.json")
    assert "| nn.functional.pad.circular |" in (tmp_path / "out" / "coverage.md").read_text()
    for rec in rep.ops:
        mine = _rec(report, rec.name)
        assert (rec.forward, rec.backward, rec.values, rec.samples) == (
            mine.forward, mine.backward, mine.values, mine.samples)
    assert lookup("nn.functional.relu") is not None


def test_unavailable_op_db_is_said_clearly(monkeypatch, tmp_path):
    """When torch's internal test API cannot be imported, the command says so and exits 2."""
    monkeypatch.setitem(sys.modules, "torch.testing._internal.common_methods_invocations", None)
    load_op_db.cache_clear()
    try:
        with pytest.raises(CoverageUnavailableError, match="expecttest"):
            load_op_db()
        result = CliRunner().invoke(app, ["coverage", "--out", str(tmp_path)])
    finally:
        monkeypatch.undo()
        load_op_db.cache_clear()
    assert result.exit_code == 2
    assert "unavailable" in result.output and torch.__version__ in result.output
