"""``docs/bench/gpu.sh`` and its helper ``gpu_compare.py``: the GPU comparison, run here on the
CPU on a tiny model (``--smoke``), so a session with a GPU runs a script known to work."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "docs" / "bench"


def _helper():
    spec = importlib.util.spec_from_file_location("gpu_compare", BENCH / "gpu_compare.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_compare"] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module


def test_the_smoke_run_times_every_mode_and_says_why_tensorrt_is_missing(tmp_path):
    helper = _helper()
    # dynamo's eager backend: the compile modes' plumbing without minutes of C++ builds
    out = helper.main(["--device", "cpu", "--smoke", "--dtypes", "fp32",
                       "--compile-backend", "eager", "--out", str(tmp_path / "gpu")])
    records = json.loads((out / "results.json").read_text())
    by_mode = {r["mode"]: r for r in records}
    assert list(by_mode) == list(helper.MODES)
    for mode in ("nchw", "nhwc", "planned", "compile", "memlayout.compile"):
        r = by_mode[mode]
        assert r["status"] == "ok", r
        assert r["rounds"] == 2 and r["vs_nchw"] is not None and r["max_error"] < 1e-3
    assert by_mode["tensorrt"]["status"] == "unavailable"
    assert "CUDA" in by_mode["tensorrt"]["error"] or "torch_tensorrt" in by_mode["tensorrt"]["error"]
    assert by_mode["memlayout.compile"]["note"].startswith("kept ")
    summary = (out / "summary.md").read_text()
    assert "best peer / memlayout.compile" in summary and "unavailable" in summary
    assert json.loads((out / "environment.json").read_text())["device"] == "cpu"


def test_no_cuda_is_a_clear_refusal_not_a_traceback(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    with pytest.raises(SystemExit):
        _helper().main(["--device", "cuda", "--out", str(tmp_path)])
    assert "--device cpu --smoke" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_shell_script_parses():
    subprocess.run(["bash", "-n", str(BENCH / "gpu.sh")], check=True)


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_backend_step_of_the_smoke_run_trains_and_infers_through_the_backend(tmp_path):
    import os

    out = tmp_path / "gpu"
    env = {**os.environ, "OUT": str(out), "STEPS": "backend", "PYTHON": sys.executable}
    subprocess.run(["bash", str(BENCH / "gpu.sh"), "--device", "cpu", "--smoke"], check=True,
                   env=env, capture_output=True)
    records = json.loads((out / "backend" / "results.json").read_text())
    ours = {r["task"]: r for r in records if r["mode"] == "compile-memlayout"}
    assert set(ours) == {"train", "infer"}
    for r in ours.values():
        assert r["status"] == "ok", r
        assert r["note"].startswith("torch.compile(backend=memlayout.backend(inner='eager'))")
    assert {r["mode"] for r in records} >= {"nhwc-again", "compile"}
    assert not (out / "compare").exists()  # STEPS=backend: that step only
