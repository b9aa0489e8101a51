"""An op whose channels-last run takes the planning process down (a fault of torch's no rule
knows yet): the process really dies, and the next plan on that cache never runs the op
channels-last, keeps it contiguous and says why; a process still running it is left alone
until it has hung, and another host's record tells nothing."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import memlayout
from memlayout.plan.costs import attempts
from memlayout.plan.costs.attempts import HUNG_AFTER, attempt_key, crashed
from memlayout.plan.costs.cache import CostCache

#: a model whose second convolution (8 input channels) kills its process when it runs
#: channels-last, as a kernel's fault does: the model built the same way in both processes
MODEL = """
import os, signal, torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)).eval()
x = torch.randn(2, 3, 16, 16)
real = nn.Conv2d._conv_forward

def crashing(self, input, weight, bias):
    if self.in_channels == 8 and not input.is_contiguous():
        os.kill(os.getpid(), signal.SIGSEGV)
    return real(self, input, weight, bias)
"""


def _plan(cache) -> memlayout.Optimized:
    return memlayout.optimize(_model(), torch.randn(2, 3, 16, 16), cache=cache, rounds=1,
                              guard=False, padding=False)


def _model() -> nn.Module:
    namespace: dict = {}
    exec(MODEL, namespace)
    return namespace["model"]


@pytest.mark.faults
def test_an_op_that_crashed_a_planning_process_is_never_run_channels_last_again(
        tmp_path, monkeypatch) -> None:
    cache = tmp_path / "costs.sqlite"
    # the same machine fingerprint as this process: its thread count too
    child = MODEL + textwrap.dedent(f"""
        import memlayout
        torch.set_num_threads({torch.get_num_threads()})
        nn.Conv2d._conv_forward = crashing
        memlayout.optimize(model, x, cache={str(cache)!r}, rounds=1, guard=False, padding=False)
        """)
    died = subprocess.run([sys.executable, "-c", child], capture_output=True, timeout=300)
    assert died.returncode == -signal.SIGSEGV, died.stderr.decode()[-2000:]

    seen: list[tuple[int, bool]] = []  # (in channels, channels-last) of every convolution run
    real = nn.Conv2d._conv_forward

    def watching(self, input, weight, bias):
        seen.append((self.in_channels, not input.is_contiguous()))
        return real(self, input, weight, bias)

    monkeypatch.setattr(nn.Conv2d, "_conv_forward", watching)
    model = _model()
    planned = _plan(cache)
    assert (8, False) in seen and (8, True) not in seen  # the op that crashed: never in nhwc
    plan = planned.plan
    first, second = [n for n in plan.nodes if "Conv2d" in n.op]
    # the other one: measured in both formats (before the crash, or now)
    assert all(s is not None for s in first.seconds.values())
    assert second.format == "contiguous" and second.seconds.get("channels_last") is None
    assert any("took the planning process" in note for note in plan.notes), plan.notes
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(planned(x), model(x))


def _record(tmp_path, pid: int, host: str, taken_at: str,
            start: str | None = None) -> tuple[CostCache, str]:
    store = CostCache(tmp_path / "costs.sqlite")
    key = json.dumps(["node", "conv"])
    start = attempts._start_time(pid) if start is None else start
    store.put(attempt_key(key), {"pid": pid, "start": start, "host": host}, is_noisy=False)
    with store._db:  # noqa: SLF001 - the record's start, as an older process wrote it
        store._db.execute("UPDATE entries SET taken_at = ? WHERE key = ?",
                          (taken_at, attempt_key(key)))
    return store, key


@pytest.mark.faults
def test_a_process_still_running_the_op_is_left_alone_until_it_has_hung(tmp_path) -> None:
    import socket

    start = datetime.datetime(2026, 12, 1, 10, 0, tzinfo=datetime.timezone.utc)
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as running:
        try:
            store, key = _record(tmp_path, running.pid, socket.gethostname(), start.isoformat())
            soon = start + datetime.timedelta(seconds=HUNG_AFTER / 2)
            later = start + datetime.timedelta(seconds=HUNG_AFTER + 1)
            assert crashed(store, key, now=soon) is None  # measuring it now
            assert "without returning" in crashed(store, key, now=later)
        finally:
            running.kill()
    running.wait()
    assert "took the planning process" in crashed(store, key, now=soon)  # gone now
    other, key = _record(tmp_path / "other", running.pid, "another-host", start.isoformat())
    assert crashed(other, key, now=later) is None  # no way to tell from here


@pytest.mark.faults
@pytest.mark.skipif(attempts._start_time(os.getpid()) is None, reason="no /proc here")
def test_a_record_of_this_process_id_from_an_earlier_process_is_a_crash(tmp_path) -> None:
    """In a container the planning process often has the same id every run: a record with
    this id but another start time was left by a process that is gone."""
    import socket

    start = datetime.datetime.now(datetime.timezone.utc).isoformat()
    store, key = _record(tmp_path, os.getpid(), socket.gethostname(), start, start="1")
    assert "took the planning process" in crashed(store, key)
    ours, key = _record(tmp_path / "ours", os.getpid(), socket.gethostname(), start)
    assert crashed(ours, key) is None  # this very process, measuring it now
