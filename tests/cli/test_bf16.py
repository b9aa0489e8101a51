"""Where bf16 is emulated (measured: its matmul slower than fp32's), ``optimize``, ``bench``
and ``train`` say so before any work, and keep the work bounded: ``optimize --compile`` is
refused, the padding candidates are off unless asked for, bench's compile modes are not
built. Tests inject the measured fact; the measurement itself is checked once."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from typer.testing import CliRunner

from memlayout import machine
from memlayout.bench.config import ModeUnavailable
from memlayout.bench.modes import prepare_mode
from memlayout.cli import app
from memlayout.errors import MemlayoutError
from memlayout.machine import Bf16Speed
from memlayout.train import make_synthetic
from tests.support.faults import write_models
from tests.support.train import write_models as write_train_models

pytestmark = pytest.mark.faults

EMULATED = Bf16Speed(0.25, "cpu")
NATIVE = Bf16Speed(2.5, "cpu")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_models(tmp_path_factory.mktemp("bf16"))


@pytest.fixture
def speed(monkeypatch):
    def inject(value: Bf16Speed) -> None:
        monkeypatch.setattr(machine, "bf16_speed", lambda device="cpu": value)
    return inject


def test_the_bf16_speed_is_measured_once_per_process():
    first = machine.bf16_speed()
    assert machine.bf16_speed() is first  # cached: measured once
    assert math.isfinite(first.relative) and first.relative > 0
    assert first.emulated == (first.relative < machine.EMULATED_BELOW)


def test_optimize_refuses_compile_in_emulated_bf16_before_any_work(models, speed):
    speed(EMULATED)
    res = CliRunner().invoke(app, ["optimize", f"{models}:own_input", "--dtype", "bf16",
                                   "--compile"])
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert text.startswith("error:") and "emulated" in text and "0.25x the fp32 rate" in text
    assert "--dtype fp32" in text


@pytest.mark.parametrize(("fact", "flags", "padded"), [
    (EMULATED, [], False), (EMULATED, ["--padding"], True), (NATIVE, [], True)])
def test_optimize_says_so_up_front_and_plans_without_padding(models, speed, monkeypatch, fact,
                                                             flags, padded):
    speed(fact)
    asked: dict = {}

    def planner(module, example, *, options=None, **kwargs):  # what the command hands it
        asked.update({f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
                     if options is not None else {}, **kwargs)
        raise MemlayoutError("stopped by the test")

    monkeypatch.setattr("memlayout.plan.pipeline.optimize", planner)
    res = CliRunner().invoke(app, ["optimize", f"{models}:own_input", "--dtype", "bf16",
                                   *flags])
    assert res.exit_code == 2 and "stopped by the test" in res.output, res.output
    assert asked["padding"] is padded and asked["dtype"] == "bf16"
    out = res.output
    if fact.emulated:
        assert out.startswith("note: bf16 is emulated") and "0.25x the fp32 rate" in out
        assert ("padding candidates are off" in " ".join(out.split())) is not padded
    else:
        assert "emulated" not in out


def test_bench_does_not_build_the_compile_modes_in_emulated_bf16(models, speed, tmp_path):
    speed(EMULATED)
    with pytest.raises(ModeUnavailable, match="emulated"):
        prepare_mode("planned+compile", torch.nn.Conv2d(3, 4, 3), torch.randn(1, 3, 8, 8),
                     dtype="bf16", task="infer")
    res = CliRunner().invoke(app, ["bench", f"{models}:own_input", "--modes", "nchw,compile",
                                   "--dtype", "bf16", "--rounds", "1", "--warmup", "0",
                                   "--gemm-size", "32", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "note: bf16 is emulated" in text and "not built in bf16" in text
    records = json.loads((tmp_path / "results.json").read_text())
    status = {r["mode"]: (r["status"], r.get("error") or "") for r in records}
    assert status["nchw"][0] == "ok" and status["compile"][0] == "unavailable"
    assert "emulated" in status["compile"][1]


def test_train_says_so_up_front(tmp_path, speed):
    speed(EMULATED)
    models = write_train_models(tmp_path)
    make_synthetic(tmp_path / "data", 8, classes=4, size=12)
    res = CliRunner().invoke(app, ["train", f"{models}:plain", "--data", str(tmp_path / "data"),
                                   "--image-size", "12", "--batch", "4", "--dtype", "bf16",
                                   "--max-steps", "1"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "note: bf16 is emulated" in text and text.index("note: bf16") < text.index("Epoch")
