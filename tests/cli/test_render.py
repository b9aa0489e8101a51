"""Terminal renderers: long lists grouped and counted, noisy figures flagged."""

from __future__ import annotations

from collections import OrderedDict

import torch
from rich.console import Console
from torch import nn

from memlayout import audit
from memlayout.audit.render import render_terminal
from memlayout.audit.report import offender_patterns
from memlayout.bench import BenchRecord, Environment
from memlayout.bench.render import noise_line


def test_audit_groups_repeated_modules_and_hints_once():
    blocks = [(str(i), nn.Sequential(OrderedDict(pad=nn.ReflectionPad2d(1), conv=nn.Conv2d(4, 4, 3),
                                                   norm=nn.InstanceNorm2d(4, affine=True))))
              for i in range(7)]
    report = audit(nn.Sequential(OrderedDict(blocks)), torch.randn(2, 4, 8, 8), train=True)
    patterns = offender_patterns(report)
    # a second count, straight from the records: every dropping or converting call is in one group
    assert sum(p.drops for p in patterns) == report.summary.drops
    assert sum(p.conversions for p in patterns) == report.summary.conversions
    assert all(p.pattern is None or p.pattern.startswith("*.") for p in patterns)
    assert max(p.instances for p in patterns) == 7
    console = Console(record=True, width=200)
    render_terminal(report, console, title="t")
    text = console.export_text()
    assert text.count("memlayout coverage") <= 1
    for i in range(7):  # no line per instance
        assert f"{i}.norm (" not in text and f"{i}.pad (" not in text


def test_bench_noise_line_counts_noisy_measurements():
    env = Environment.collect("cpu", threads=1)
    records = [BenchRecord(env=env, model=f"torchvision:m{i}", dtype="fp32", task="infer",
                           mode=mode, status="ok", spread=spread)
               for i, spread in enumerate((0.05, 0.9, 2.0)) for mode in ("nchw", "nhwc")]
    line = noise_line(records)
    assert line.startswith("4 of 6 measurements spread more than 30 %") and "m1 (2), m2 (2)" in line
