"""``benchmarks/gpu.sh`` and its helper ``gpu_compare.py``: the GPU comparison, run here as
``--dry-run`` (the same code on the CPU, a tiny model), so a session with a GPU runs a script
known to work, with the interpreter and the files that machine has."""

from __future__ import annotations

import doctest
import importlib.util
import itertools
import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / "benchmarks"
#: what comes back from a lent GPU machine's $OUT
MAX_FILES = 8


def _helper():
    spec = importlib.util.spec_from_file_location("gpu_compare", BENCH / "gpu_compare.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_compare"] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module


def _shims(folder: Path) -> Path:
    """A ``python3`` that is this interpreter without site processing (so this checkout's
    editable install is not on its path; torch is, by PYTHONPATH) and logs the PYTHONPATH it
    was given, beside a ``python`` that fails: the GPU machine has only ``python3``."""
    folder.mkdir()
    site = sysconfig.get_paths()["purelib"]
    scripts = {
        "python3": f'#!/bin/sh\necho "$PYTHONPATH" >> "{folder}/calls"\n'
                   f'PYTHONPATH="$PYTHONPATH:{site}" exec "{sys.executable}" -S "$@"\n',
        "python": "#!/bin/sh\necho 'gpu.sh called python; that machine has python3' >&2\nexit 3\n",
    }
    for name, text in scripts.items():
        (folder / name).write_text(text)
        (folder / name).chmod((folder / name).stat().st_mode | stat.S_IXUSR)
    return folder


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_dry_run_writes_the_table_first_with_every_mode_checked_and_timed(tmp_path):
    helper = _helper()
    shims = _shims(tmp_path / "bin")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "PYTHONPATH")}
    env.update(OUT=str(out), PATH=f"{shims}{os.pathsep}{env['PATH']}")
    run = subprocess.run(["bash", str(BENCH / "gpu.sh"), "--dry-run"], env=env, cwd=tmp_path,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    calls = (shims / "calls").read_text().split()
    assert calls and all(c.split(os.pathsep)[0] == str(REPO / "src") for c in calls)

    files = sorted(p.name for p in out.iterdir())
    assert all((out / f).is_file() for f in files) and len(files) <= MAX_FILES
    assert files[0] == helper.TABLE
    records = json.loads((out / helper.RESULTS).read_text())
    cases = {("tiny", "bf16", "train"), ("tiny", "fp32", "infer")}
    assert {(r["model"], r["dtype"], r["task"]) for r in records} == cases
    assert [r["mode"] for r in records] == list(helper.MODES) * len(cases)
    for r in records:
        assert r["status"] == "ok", r
        assert len(r["round_times_s"]) == 2 and r["vs_nchw"] is not None
        assert r["max_error"] is not None and r["first_call_s"] is not None
    rows = [line.split(" | ") for line in (out / helper.TABLE).read_text().splitlines()[2:]]
    assert {(row[1], row[2], row[4], row[5]) for row in rows} == {
        (dtype, task, mode, "ok") for (_, dtype, task), mode in
        itertools.product(cases, helper.MODES)}
    assert "compile-memlayout" in (out / "06-bars.txt").read_text()


def test_a_run_past_its_budget_records_each_case_it_skips(tmp_path):
    helper = _helper()
    out = helper.main(["--dry-run", "--budget", "0", "--out", str(tmp_path)])
    records = json.loads((out / helper.RESULTS).read_text())
    assert [(r["mode"], r["status"]) for r in records] == [("all", "skipped")] * 2
    assert all(r["error"].startswith("budget: ") for r in records)
    assert (out / helper.TABLE).read_text().count("| skipped |") == 2


def test_resnet50_in_bf16_and_fp32_comes_first_and_every_case_once():
    helper = _helper()
    todo = [(c.model.name, c.dtype, c.task) for c in
            helper.cases(list(helper.MODELS), helper.DTYPES, helper.TASKS)]
    assert todo[:4] == [("resnet50", d, t) for d in ("bf16", "fp32") for t in ("train", "infer")]
    assert sorted(todo) == sorted(itertools.product(helper.MODELS, helper.DTYPES, helper.TASKS))


def _factory_file(tmp_path: Path) -> Path:
    path = tmp_path / "models.py"
    path.write_text("from torch import nn\n\n\n"
                    "def dropout():\n"
                    "    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Dropout(0.5),"
                    " nn.Linear(8 * 6 * 6, 4))\n")
    return path


def _options(helper):
    return helper.Options("cpu", rounds=2, repeat=1, warmup=0, compile_backend="eager",
                          measure=False, budget_s=60.0)


def test_a_mode_that_computes_something_else_is_an_error_not_a_timing(monkeypatch):
    helper = _helper()
    prepare = helper.prepare

    def nhwc_off_by_one(mode, *args):
        prepared = prepare(mode, *args)
        if mode != "nhwc":
            return prepared
        return helper.Prepared(lambda: prepared.step() + 1.0)

    monkeypatch.setattr(helper, "MODES", ("nchw", "nhwc", "nhwc-again"))
    monkeypatch.setattr(helper, "prepare", nhwc_off_by_one)
    case = helper.Case(helper.DRY_RUN_MODEL, "fp32", "infer")
    by_mode = {r.mode: r for r in helper.run_case(case, _options(helper), deadline=float("inf"))}
    assert by_mode["nhwc"].status == "error" and not by_mode["nhwc"].round_times_s
    assert "differs from eager NCHW" in by_mode["nhwc"].error
    assert by_mode["nhwc-again"].status == "ok" and by_mode["nhwc-again"].max_error < 1e-3


def test_training_that_draws_random_numbers_is_timed_without_comparing_losses(tmp_path,
                                                                             monkeypatch):
    helper = _helper()
    monkeypatch.setattr(helper, "MODES", ("nchw", "nhwc"))
    model = helper.Model("dropout", f"{_factory_file(tmp_path)}:dropout", 2, 2, 8)
    records = helper.run_case(helper.Case(model, "fp32", "train"), _options(helper),
                              deadline=float("inf"))
    assert [r.status for r in records] == ["ok", "ok"]
    assert all(r.max_error is None and "not compared" in r.note for r in records)


def test_the_examples_in_gpu_compare_hold():
    assert doctest.testmod(_helper()).failed == 0


def test_no_cuda_is_a_clear_refusal_not_a_traceback(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    with pytest.raises(SystemExit):
        _helper().main(["--out", str(tmp_path)])
    assert "--dry-run" in capsys.readouterr().err
