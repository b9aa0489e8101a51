"""Renderers of the audit and the ``memlayout audit`` command."""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn
from typer.testing import CliRunner

from memlayout import AuditReport, audit
from memlayout.audit.render import render_html, render_terminal
from memlayout.cli import app

CHROMIUM = "/usr/bin/chromium"


class CatMixed(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.ones(x.shape, dtype=x.dtype)], dim=1)


def _report() -> AuditReport:
    """A run with drops and conversions whatever the build: flatten of channels-last copies."""
    model = nn.Sequential(OrderedDict(
        stem=nn.Conv2d(3, 8, 3), norm=nn.InstanceNorm2d(8, affine=True), mix=CatMixed(),
        head=nn.Sequential(nn.Conv2d(16, 8, 1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))))
    return audit(model, torch.randn(2, 3, 8, 8), train=True)


def test_terminal_lists_every_group():
    from rich.console import Console

    report = _report()
    console = Console(record=True, width=200)
    render_terminal(report, console, title="t", top=100)
    text = console.export_text()
    assert f"drops of channels_last: {report.summary.drops}" in text
    for g in report.summary.groups:
        assert g.op in text


def test_html_is_self_contained_and_marks_every_drop():
    report = _report()
    page = render_html(report, title="audit <test>")
    assert "audit &lt;test&gt;" in page and "<script" not in page
    body = page.split("<body>")[1]
    assert "http://" not in body and "https://" not in body and "url(" not in page
    chips = page.count('class="chip ')
    assert chips == len(report.records)  # one chip per op, none truncated at this size
    assert page.count(" drop") >= report.summary.drops
    for c in report.calls:
        assert f">{c.module or '(model)'}<" in page


@pytest.mark.skipif(not Path(CHROMIUM).exists() or shutil.which("chromium") is None,
                    reason="headless Chromium (Debian package chromium) not installed")
def test_html_renders_in_headless_chromium(tmp_path):
    page = tmp_path / "audit.html"
    page.write_text(render_html(_report(), title="memlayout audit test"), encoding="utf-8")
    png = tmp_path / "shot.png"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}",
           "--window-size=1280,1400", page.as_uri()]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    image = Image.open(png).convert("RGB")
    assert image.size == (1280, 1400)
    colours = image.getcolors(maxcolors=1 << 20) or []
    counts = {rgb: n for n, rgb in colours}

    def near(target: tuple[int, int, int]) -> int:
        return sum(n for rgb, n in counts.items() if max(abs(a - b) for a, b in zip(rgb, target, strict=True)) < 12)

    # the styled page, not a blank or an unstyled one: dark header, green and amber chips
    assert near((0x1D, 0x23, 0x30)) > 1280 * 40
    assert near((0x2E, 0x9E, 0x5B)) > 200
    assert near((0xE0, 0xA5, 0x26)) > 50


def test_cli_audit_writes_json_and_html(tmp_path):
    spec = tmp_path / "net.py"
    spec.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def make():
            return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 14 * 14, 2))
    """))
    out_json, out_html = tmp_path / "a.json", tmp_path / "a.html"
    result = CliRunner().invoke(app, ["audit", f"{spec}:make", "--batch", "2", "--image-size", "16",
                                      "--train", "--json", str(out_json), "--html", str(out_html)])
    assert result.exit_code == 0, result.output
    data = json.loads(out_json.read_text())
    assert set(data) == {"schema", "format", "meta", "summary", "calls", "records"}
    assert set(data["summary"]) == {"ops", "drops", "drops_by_phase", "conversions",
                                    "conversion_bytes", "activation_bytes",
                                    "activation_bytes_in_format", "activation_share", "groups",
                                    "top_offenders"}
    assert set(data["records"][0]) == {"index", "phase", "module", "module_type", "call", "op",
                                       "inputs", "outputs", "dropped", "conversion", "view", "bytes"}
    report = AuditReport.from_dict(data)
    assert data["meta"]["train"] is True and report.summary.ops["backward"] > 0
    assert f"drops of channels_last: {report.summary.drops}" in result.output
    assert out_html.read_text().startswith("<!DOCTYPE html>")


def test_cli_audit_bad_spec_is_a_clean_error():
    result = CliRunner().invoke(app, ["audit", "torchvision:resnet81"])
    assert result.exit_code == 2 and "resnet18" in result.output
