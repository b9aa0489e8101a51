"""Renderers of the audit and the ``memlayout audit`` command."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from html.parser import HTMLParser

import pytest
import torch
from PIL import Image
from rich.console import Console
from torch import nn
from typer.testing import CliRunner

from memlayout import AuditReport, audit
from memlayout.audit.render import render_html, render_terminal
from memlayout.audit.report import OUTSIDE, PHASES
from memlayout.cli import app


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


# -- the page in a real browser (Debian's chromium; `.ci/run` installs it) -----------------
_VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta",
                   "source", "track", "wbr"})


@dataclass
class Element:
    """One element of the DOM Chromium serialized: enough tree to ask where each chip ended up."""

    tag: str
    attrs: dict[str, str]
    children: list[Element] = field(default_factory=list)
    text: str = ""

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def all(self, tag: str, cls: str | None = None) -> list[Element]:
        """Every descendant ``<tag>`` (with class ``cls``), in document order."""
        found = []
        for c in self.children:
            if c.tag == tag and (cls is None or cls in c.classes):
                found.append(c)
            found += c.all(tag, cls)
        return found

    def content(self) -> str:
        return self.text + "".join(c.content() for c in self.children)


class _TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(element)
        if tag not in _VOID:
            self.stack.append(element)

    def handle_endtag(self, tag: str) -> None:
        if tag not in _VOID:
            assert self.stack.pop().tag == tag  # Chromium's serializer closes every element

    def handle_data(self, data: str) -> None:
        self.stack[-1].text += data


@pytest.fixture
def chromium(tmp_path) -> Callable[..., subprocess.CompletedProcess[bytes]]:
    """Run headless Chromium with a fresh profile; skipped without it, except in CI (``CI`` set),
    where a missing browser fails the test: CI installs it (``.ci/run``)."""
    exe = shutil.which("chromium")
    if exe is None:
        message = "headless Chromium (Debian package chromium) is not installed"
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"{message}; CI must install it (apt-get install -y chromium)")
        pytest.skip(message)

    def run(*args: str) -> subprocess.CompletedProcess[bytes]:
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync",
               f"--user-data-dir={tmp_path / 'profile'}", *args]
        return subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    return run


def test_html_dom_in_headless_chromium(chromium, tmp_path):
    report = _report()
    page = tmp_path / "audit.html"
    page.write_text(render_html(report, title="memlayout audit test"), encoding="utf-8")
    builder = _TreeBuilder()
    builder.feed(chromium("--dump-dom", page.as_uri()).stdout.decode("utf-8"))
    dom = builder.root

    assert [t.content() for t in dom.all("title")] == ["memlayout audit test"]
    cards = {c.all("div", "l")[0].content(): c.all("div", "v")[0].content()
             for c in dom.all("div", "card")}
    assert cards["drops of channels_last"] == str(report.summary.drops)
    assert cards["layout conversions"] == str(report.summary.conversions)

    # one bar per op in each phase's strip
    strips = dom.all("div", "strip")
    by_phase = [[r for r in report.records if r.phase == p] for p in PHASES]
    assert [len(s.all("i")) for s in strips] == [len(rs) for rs in by_phase if rs]
    assert [len(s.all("i", "drop")) for s in strips] == [sum(r.dropped for r in rs)
                                                         for rs in by_phase if rs]

    # the module table as the browser built it: one row per module call in execution order,
    # each holding the chips of its own forward and backward ops (markup the parser had to
    # repair would move them out of their cells)
    table = next(t for t in dom.all("table")
                 if "module, in execution order" in [th.content() for th in t.all("th")])
    rows = table.all("tbody")[0].all("tr")
    calls = sorted(report.calls, key=lambda c: c.index)
    expected = [(c.module or "(model)", c.index) for c in calls]
    if any(r.call < 0 for r in report.records):
        expected.append((OUTSIDE, -1))
    assert [r.all("td", "mod")[0].content() for r in rows] == [m for m, _ in expected]
    for row, (module, index) in zip(rows, expected, strict=True):
        mine = [r for r in report.records if r.call == index]
        fw = [r for r in mine if r.phase == "forward"]
        bw = [r for r in mine if r.phase != "forward"]
        assert len(row.all("td", "fw")[0].all("span", "chip")) == len(fw), module
        assert len(row.all("td", "bw")[0].all("span", "chip")) == len(bw), module
        assert len(row.all("span", "drop")) == sum(r.dropped for r in mine), module
        assert ("hasdrop" in row.classes) == any(r.dropped for r in mine), module
    assert sum(len(r.all("span", "drop")) for r in rows) == report.summary.drops > 0


def test_html_screenshot_in_headless_chromium(chromium, tmp_path):
    page = tmp_path / "audit.html"
    page.write_text(render_html(_report(), title="memlayout audit test"), encoding="utf-8")
    png = tmp_path / "shot.png"
    chromium(f"--screenshot={png}", "--window-size=1280,1400", page.as_uri())
    image = Image.open(png).convert("RGB")
    assert image.size == (1280, 1400)
    colours = image.getcolors(maxcolors=1 << 20) or []
    counts = {rgb: n for n, rgb in colours}

    def near(target: tuple[int, int, int]) -> int:
        return sum(n for rgb, n in counts.items() if max(abs(a - b) for a, b in zip(rgb, target, strict=True)) < 12)

    # the styled page, not a blank or an unstyled one: dark header, green and amber chips,
    # the red of drop outlines and badges
    assert near((0x1D, 0x23, 0x30)) > 1280 * 40
    assert near((0x2E, 0x9E, 0x5B)) > 200
    assert near((0xE0, 0xA5, 0x26)) > 50
    assert near((0xC8, 0x36, 0x2D)) > 50


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
