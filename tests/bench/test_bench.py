"""The benchmark harness: records for every mode, outputs that parse, ratios from the rounds.

No timing assertions: expectations come from the raw per-round times in the records, from a
fake clock whose durations the test chooses, and from a FLOP count done by hand with hooks.
"""

from __future__ import annotations

import csv
import json
import shutil
import statistics
import subprocess
import sys
import textwrap

import pytest
import torch
import torchvision
from PIL import Image
from torch import nn
from typer.testing import CliRunner

import memlayout
from memlayout import malloc
from memlayout.bench import (
    CONTROL,
    DEFAULT_MODES,
    BenchConfig,
    BenchConfigError,
    run_bench,
    runner,
    zoo,
)
from memlayout.bench.modes import count_flops, prepare_mode
from memlayout.bench.report import read_json, summary_tables, write_json
from memlayout.cli import app
from memlayout.models import load_model

ALL_MODES = ("nchw", "nhwc", "planned", "compile", "planned+compile")


@pytest.fixture(autouse=True)
def _planner_cache(tmp_path, monkeypatch):
    # the planner caches measured costs; keep the user's cache out of the tests
    monkeypatch.setenv("MEMLAYOUT_CACHE_DIR", str(tmp_path / "cache"))


def _models_file(tmp_path):
    path = tmp_path / "nets.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def tiny():
            return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                 nn.Conv2d(8, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(8, 4))

        class Broken(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(3, 4, 3)
            def forward(self, x):
                raise NotImplementedError("aten::made_up_op has no kernel for this layout")

        def broken():
            return Broken()

        class NchwOnly(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(3, 4, 3)
            def forward(self, x):
                if not x.is_contiguous():
                    raise RuntimeError("this model only takes NCHW input")
                return self.conv(x)

        def nchw_only():
            return NchwOnly()

        class Hungry(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(3, 4, 3)
            def forward(self, x):
                if x.shape[0] > 2:
                    raise torch.OutOfMemoryError(f"pretend: batch {x.shape[0]} does not fit")
                return self.conv(x)

        def hungry():
            return Hungry()

        class Starved(nn.Module):  # an image model (a convolution) that never fits
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(3, 4, 3)
            def forward(self, x):
                raise torch.OutOfMemoryError("pretend: nothing fits")

        def starved():
            return Starved()

        class CpuHungry(nn.Module):
            # a real CPU allocator failure (10 TB) above batch 2, not a raised stand-in
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(3, 4, 3)
            def forward(self, x):
                if x.shape[0] > 2:
                    torch.empty(10 ** 13, dtype=torch.uint8)
                return self.conv(x)

        def cpu_hungry():
            return CpuHungry()

        class Conditioned(nn.Module):
            # an image, a timestep and a keyword input: a diffusion UNet's call, in small
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(3, 4, 3, padding=1)
                self.proj = nn.Linear(5, 4)
            def forward(self, x, t, cond=None, scale=1.0):
                y = self.conv(x) * t.view(-1, 1, 1, 1)
                return (y + self.proj(cond).mean(1)[:, :, None, None]) * scale

        def conditioned():
            return Conditioned(), (torch.randn(3, 3, 8, 8), torch.tensor([1.0, 2.0, 3.0])), \
                {"cond": torch.randn(3, 6, 5), "scale": 0.5}

        def conditioned_starved():
            return Starved(), (torch.randn(4, 3, 8, 8),)

        def dies():
            import os

            class Dies(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.conv = nn.Conv2d(3, 4, 3)  # an image model: the bench invents its input
                def forward(self, x):
                    os._exit(3)  # the process is gone: nothing after this point runs
            return Dies()
    """))
    return path


def test_quick_zoo_cli_writes_every_record_and_output(tmp_path):
    out = tmp_path / "out"
    args = ["bench", "--zoo", "quick", "--image-size", "32", "--batch", "2", "--rounds", "2",
            "--modes", ",".join(ALL_MODES), "--task", "infer", "--threads", "2",
            # dynamo's own backend keeps the compile modes' plumbing in the test without minutes
            # of Inductor C++ builds; test_inductor_compile_mode covers Inductor itself
            "--compile-backend", "eager", "--gemm-size", "256", "--plan-costs", "analytic",
            "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads((out / "results.json").read_text())
    models = [e.spec for e in zoo("quick")]
    assert {(r["model"], r["task"], r["mode"]) for r in rows} == {
        (m, "infer", mode) for m in models for mode in ALL_MODES}
    assert len(rows) == len(models) * len(ALL_MODES)
    for r in rows:
        assert r["status"] in ("ok", "error"), r
        if r["status"] != "ok":
            assert r["error"], r
            continue
        assert r["rounds"] == 2 and len(r["round_times_s"]) == 2
        assert r["input_shape"] == "2x3x32x32" and r["threads"] == 2
        assert r["median_s"] == statistics.median(r["round_times_s"])
        assert r["flops"] > 0 and r["flops_per_s"] == pytest.approx(r["flops"] / r["median_s"])
        assert r["compile_s"] is not None if "compile" in r["mode"] else r["compile_s"] is None
    nchw_rows = [r for r in rows if r["mode"] == "nchw"]
    assert all(r["status"] == "ok" for r in nchw_rows)
    for r in rows:
        if r["status"] != "ok":
            continue
        base = next(b for b in nchw_rows if (b["model"], b["task"]) == (r["model"], r["task"]))
        # ratios come from the same rounds: round i of NCHW over round i of the mode
        expected = [b / m for b, m in zip(base["round_times_s"], r["round_times_s"], strict=True)]
        assert r["round_speedups"] == pytest.approx(expected)
        assert r["speedup"] == pytest.approx(statistics.median(expected))
    nhwc = [r for r in rows if r["mode"] == "nhwc"]
    assert {r["input_format"] for r in nhwc} == {"channels_last"}
    assert {r["input_format"] for r in nchw_rows} == {"contiguous"}

    with (out / "results.csv").open() as fh:
        csv_rows = list(csv.DictReader(fh))
    assert len(csv_rows) == len(rows)
    for c, j in zip(csv_rows, rows, strict=True):
        assert (c["model"], c["mode"], c["status"]) == (j["model"], j["mode"], j["status"])
        if j["status"] == "ok":
            assert float(c["speedup"]) == pytest.approx(j["speedup"])
            assert [float(v) for v in c["round_times_s"].split()] == j["round_times_s"]

    with Image.open(out / "speedup.png") as png:
        assert png.format == "PNG" and png.width > 300 and png.height > 300

    md = (out / "summary.md").read_text()
    assert "memlayout bench --zoo quick" in md and "![speedup vs NCHW](speedup.png)" in md
    sections = md.split("\n## ")
    speedups = next(s for s in sections if s.startswith("fp32 infer\n"))
    table_lines = [line for line in speedups.splitlines() if line.startswith("| resnet18 |")]
    assert len(table_lines) == 1
    for section in sections:  # every row of a table has its header's column count
        assert len({line.count(" | ") for line in section.splitlines() if line.startswith("| ")}) <= 1
    # every mode's fraction of the fp32 GEMM peak, as the records have it
    peaks = next(s for s in sections if s.startswith("fp32 infer: % of the fp32 GEMM peak"))
    header = next(line for line in peaks.splitlines() if line.startswith("| model |"))
    r18_peaks = next(line for line in peaks.splitlines() if line.startswith("| resnet18 |"))
    cells = dict(zip(header.strip("| ").split(" | "), r18_peaks.strip("| ").split(" | "), strict=True))
    for r in rows:
        if r["model"] == "torchvision:resnet18" and r["task"] == "infer" and r["status"] == "ok":
            assert cells[r["mode"]] == f"{100 * r['peak_fraction']:.1f} %"
    assert "GEMM peak fp32:" in md and "once per run" in md
    r18 = next(r for r in rows if r["model"] == "torchvision:resnet18" and r["task"] == "infer"
               and r["mode"] == "nhwc")
    if r18["status"] == "ok":
        assert f"{r18['speedup']:.2f}x ({r18['speedup_min']:.2f}-{r18['speedup_max']:.2f})" in table_lines[0]
    assert "resnet18" in result.output and "wrote" in result.output
    chose = md.split("## What the planner chose", 1)[-1]
    for r in rows:
        if r["mode"].startswith("planned") and r["status"] == "ok":
            assert r["note"].startswith(("plan: ", "memlayout.compile")), r["note"]
            assert r["note"].replace("|", "\\|") in chose


def test_every_mode_trains_or_reports_why(tmp_path, monkeypatch):
    # train (forward + backward + SGD step) through all five modes on a tiny model; the quick
    # zoo test above covers inference on real torchvision models. bf16 reads as native here
    # (where it is emulated the compile modes are not built: tests/cli/test_bf16.py)
    from memlayout import machine

    monkeypatch.setattr(machine, "bf16_speed", lambda device="cpu": machine.Bf16Speed(2.0, "cpu"))
    path = _models_file(tmp_path)
    cfg = BenchConfig.from_strings([f"{path}:tiny"], modes=",".join(ALL_MODES), tasks="train",
                                   dtypes="fp32,bf16", batch=2, image_size=8, rounds=2,
                                   gemm_size=32, compile_backend="eager", plan_measure=False)
    records = run_bench(cfg).records
    assert [(r.dtype, r.mode) for r in records] == [(d, m) for d in ("fp32", "bf16") for m in ALL_MODES]
    for r in records:
        assert r.status == "ok", (r.mode, r.error)
    # the planned record says what the plan chose: the headline of the same plan made
    # directly (analytic costs: no timing, so the same choice)
    built = load_model(f"{path}:tiny", batch=2, image_size=8)
    for r in records:
        if r.mode == "planned":
            opt = memlayout.optimize(built.module.train(), (built.example_input,),
                                     dtype=getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[r.dtype]),
                                     measure=False, train=True, input_format="auto")
            # then how the input was made (a module alone: invented, and it says so)
            assert r.note == f"{opt.plan.headline()}; {built.note}"
            # timed with its input in the format the plan chose, converted beforehand
            assert r.input_format == opt.plan.input_format
        if r.mode == "planned+compile":
            assert r.note.startswith("plan: ") and "torch.compile" in r.note
        assert r.rounds == 2 and r.flops and r.speedup is not None


def test_train_step_updates_the_weights_of_its_own_copy():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    before = [p.detach().clone() for p in model.parameters()]
    prepared = prepare_mode("nhwc", model, torch.randn(2, 3, 8, 8), dtype="fp32", task="train")
    prepared.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    copied = list(prepared.module.parameters())
    assert not any(torch.equal(a, p) for a, p in zip(before, copied, strict=True))
    assert copied[0].is_contiguous(memory_format=torch.channels_last)
    assert prepared.input_format == "channels_last"


class _StepClock:
    """A fake clock that advances by a chosen duration per (mode, round) sample.

    ``on_event`` learns which sample is next; of the two clock reads per sample (warm-up is
    off) the second one moves time forward.
    """

    def __init__(self, durations: dict[str, list[float]]) -> None:
        self.durations = durations
        self.now = 0.0
        self.reads = 0
        self.pending = 0.0

    def on_event(self, event) -> None:
        if event.phase == "round":
            self.pending = self.durations[event.mode][event.round]

    def __call__(self) -> float:
        self.reads += 1
        if self.reads % 2 == 0:
            self.now += self.pending
        return self.now


def test_fake_clock_known_times_give_known_medians_ratios_and_peak(tmp_path):
    path = _models_file(tmp_path)
    durations = {"nchw": [4.0, 2.0, 6.0], "nhwc": [2.0, 2.0, 2.0], "gemm": [0.5, 1.0, 2.0]}
    clock = _StepClock(durations)
    cfg = BenchConfig.from_strings([f"{path}:tiny"], modes="nchw,nhwc", batch=2, image_size=8,
                                   rounds=3, warmup=0, gemm_size=32)
    result = run_bench(cfg, on_event=clock.on_event, clock=clock)
    nchw, nhwc = result.records
    assert nchw.round_times_s == (4.0, 2.0, 6.0) and nhwc.round_times_s == (2.0, 2.0, 2.0)
    assert (nchw.median_s, nhwc.median_s) == (4.0, 2.0)
    assert nhwc.round_speedups == (2.0, 1.0, 3.0)
    assert nhwc.speedup == 2.0 and (nhwc.speedup_min, nhwc.speedup_max) == (1.0, 3.0)
    assert nchw.speedup == 1.0
    assert nchw.spread == pytest.approx((6.0 - 2.0) / 4.0)
    gemm_rate = 2 * 32 ** 3 / min(durations["gemm"])  # the peak: the fastest call
    assert nhwc.gemm_flops_per_s == pytest.approx(gemm_rate)
    assert nhwc.flops_per_s == pytest.approx(nhwc.flops / 2.0)
    assert nhwc.peak_fraction == pytest.approx(nhwc.flops / 2.0 / gemm_rate)
    table = summary_tables(result.records)[0]
    assert table.rows[0][2] == "2.00x (1.00-3.00)"
    # the JSON written is the JSON read: records come back equal, environment included
    assert read_json(write_json(result.records, tmp_path / "r.json")) == list(result.records)


def _flops_by_hooks(model: nn.Module, x: torch.Tensor) -> int:
    """Multiply-adds of every Conv2d and Linear, counted from their output shapes by hand."""
    total = 0

    def hook(module, inputs, output):
        nonlocal total
        if isinstance(module, nn.Conv2d):
            k = module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
            total += 2 * output.numel() * k
        elif isinstance(module, nn.Linear):
            total += 2 * output.numel() * module.in_features

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return total


def _grouped_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2), nn.Conv2d(16, 16, 3, groups=16),
                         nn.Conv2d(16, 32, 1, groups=4), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(32, 10))


@pytest.mark.parametrize("name", ["resnet18", "grouped"])
def test_flop_count_matches_a_count_by_hand(name):
    model = _grouped_net() if name == "grouped" else getattr(torchvision.models, name)()
    model.eval()
    x = torch.randn(2, 3, 32, 32)
    expected = _flops_by_hooks(model, x)
    assert count_flops(model, x, dtype="fp32", task="infer") == expected
    assert count_flops(model, x, dtype="bf16", task="infer") == expected  # autocast: same ops
    # backward of conv / linear: gradients w.r.t. input and weight, each the forward's cost,
    # except the first layer, whose input needs no gradient
    assert count_flops(model, x, dtype="fp32", task="train") > 2 * expected


def test_erroring_models_and_modes_do_not_stop_the_run(tmp_path):
    path = _models_file(tmp_path)
    specs = [f"{path}:broken", f"{path}:nchw_only", "torchvision:not_a_model", f"{path}:tiny"]
    cfg = BenchConfig.from_strings(specs, modes="nchw,nhwc", tasks="infer,train", batch=2,
                                   image_size=8, rounds=2, gemm_size=32)
    records = run_bench(cfg).records
    status = {(r.model.split(":")[-1], r.task, r.mode): (r.status, r.error) for r in records}
    assert len(records) == len(specs) * 2 * 2
    for task in ("infer", "train"):
        for mode in ("nchw", "nhwc"):
            s, err = status[("broken", task, mode)]
            assert s == "error" and "NotImplementedError: aten::made_up_op" in err
            s, err = status[("not_a_model", task, mode)]
            assert s == "error" and "ModelSpecError" in err
            assert status[("tiny", task, mode)] == ("ok", None)
        assert status[("nchw_only", task, "nchw")] == ("ok", None)
        s, err = status[("nchw_only", task, "nhwc")]
        assert s == "error" and "only takes NCHW" in err
    partial = next(r for r in records if r.model.endswith("nchw_only") and r.mode == "nchw")
    assert partial.speedup == 1.0  # the baseline still times and compares with itself


def test_out_of_memory_retries_at_half_batch(tmp_path):
    path = _models_file(tmp_path)
    cfg = BenchConfig.from_strings([f"{path}:hungry", f"{path}:starved"], modes="nchw,nhwc",
                                   batch=8, image_size=8, rounds=2, gemm_size=32)
    records = run_bench(cfg).records
    hungry = [r for r in records if r.model.endswith("hungry")]
    assert [r.status for r in hungry] == ["ok", "ok"]
    for r in hungry:
        assert (r.batch, r.requested_batch, r.input_shape) == (2, 8, "2x3x8x8")
        assert "out of memory at batch 8" in r.note and "retried at batch 4" in r.note
        assert "retried at batch 2" in r.note
    starved = [r for r in records if r.model.endswith("starved")]
    assert [r.status for r in starved] == ["error", "error"]
    assert all("out of memory at batch 1" in (r.error or "") for r in starved)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="Inductor on CPU needs a C++ compiler")
def test_inductor_compile_mode_on_a_tiny_model(tmp_path):
    path = _models_file(tmp_path)
    cfg = BenchConfig.from_strings([f"{path}:tiny"], modes="nchw,compile", batch=2, image_size=8,
                                   rounds=2, gemm_size=32)
    nchw, compiled = run_bench(cfg).records
    assert compiled.status == "ok", compiled.error
    assert compiled.compile_s is not None and compiled.compile_s == compiled.first_call_s
    assert compiled.rounds == 2 and nchw.compile_s is None


def test_planned_mode_is_used(tmp_path):
    path = _models_file(tmp_path)
    cfg = BenchConfig.from_strings([f"{path}:tiny"], modes="nchw,planned", batch=2, image_size=8,
                                   rounds=2, gemm_size=32)
    planned = run_bench(cfg).records[1]
    assert planned.status == "ok", planned.error
    assert planned.setup_s > 0 and planned.rounds == 2
    # the note is the headline of the plan timed: the model's layout nodes, as a plan of the
    # same model made here counts them
    import importlib.util

    spec = importlib.util.spec_from_file_location("nets", path)
    nets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nets)
    plan = memlayout.optimize(nets.tiny().eval(), torch.randn(2, 3, 8, 8), measure=False,
                              cache=False).plan
    assert planned.note.startswith("plan: ") and f"/{len(plan.nodes)} layout nodes" in planned.note


def test_a_factory_with_several_and_keyword_inputs_is_benched_in_every_mode(tmp_path):
    path = _models_file(tmp_path)
    cfg = BenchConfig.from_strings([f"{path}:conditioned"], modes="nchw,nhwc,planned,openvino",
                                   batch=8, image_size=8, rounds=2, gemm_size=32)
    records = {r.mode: r for r in run_bench(cfg).records}
    for mode in ("nchw", "nhwc", "planned"):
        r = records[mode]
        assert r.status == "ok", (mode, r.error)
        # the factory's own input, at its own batch: --batch 8 did not apply, and it says so
        assert (r.batch, r.input_shape) == (3, "3x3x8x8 3 3x6x5"), mode
        assert "--batch and --image-size do not apply" in r.note
    assert records["nhwc"].input_format == "channels_last"
    assert records["openvino"].status == "unavailable"
    assert "one tensor input" in records["openvino"].error or "pip install" in records["openvino"].error
    # every mode computes what the model does with its keyword inputs
    spec = load_model(f"{path}:conditioned")
    want = spec.module(*spec.example_input, **spec.example_kwargs)
    module, args = runner.case_inputs(spec, batch=8)
    for mode in ("nchw", "nhwc", "planned"):
        got = prepare_mode(mode, module, args, dtype="fp32", task="infer").step()
        torch.testing.assert_close(got, want, msg=mode)


def test_out_of_memory_at_a_factory_input_is_an_error_not_a_retry(tmp_path):
    path = _models_file(tmp_path)
    cfg = BenchConfig.from_strings([f"{path}:conditioned_starved"], modes="nchw,nhwc", batch=8,
                                   rounds=2, gemm_size=32)
    records = run_bench(cfg).records
    assert [r.status for r in records] == ["error", "error"]
    assert all("factory's own input" in (r.error or "") and "retried" not in r.note
               for r in records)


class TwoHeads(nn.Module):
    """Outputs of every structure a training step's loss walks: dict, list, non-tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 2, 1), nn.Conv2d(3, 1, 1)

    def forward(self, x):
        return {"out": self.a(x), "aux": [self.b(x), "label"], "n": torch.ones(2, dtype=torch.int64)}


class Labels(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 1)

    def forward(self, x):
        return self.conv(x).argmax(1)


def test_training_step_loss_walks_every_output_structure():
    x = torch.randn(2, 3, 4, 4)
    prepared = prepare_mode("nchw", TwoHeads(), x, dtype="fp32", task="train")
    with torch.no_grad():
        out = prepared.module(x)  # the weights the next step's loss is computed with
    expected = 0.5 * out["out"].square().mean() + 0.5 * out["aux"][0].square().mean()
    assert prepared.step().item() == pytest.approx(expected.item())
    with pytest.raises(TypeError, match="no floating tensor"):
        prepare_mode("nchw", Labels(), x, dtype="fp32", task="train")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"modes": "nhwc,compile"}, "lacks 'nchw'"),
    ({"modes": "nchw,fast"}, "unknown mode 'fast'"),
    ({"dtypes": "fp64"}, "unknown dtype 'fp64'"),
    ({"tasks": "serve"}, "unknown task 'serve'"),
    ({"batch": 0}, "--batch must be >= 1, got 0"),
    ({"image_size": 0}, "--image-size must be >= 1"),
    ({"device": "tpu"}, "unknown device 'tpu'"),
])
def test_bad_config_names_what_was_given(kwargs, match):
    with pytest.raises(BenchConfigError, match=match):
        BenchConfig.from_strings(["torchvision:resnet18"], **kwargs)


def test_cli_errors_are_clean():
    cli = CliRunner()
    result = cli.invoke(app, ["bench", "--zoo", "huge"])
    assert result.exit_code == 2 and "unknown zoo 'huge'" in result.output
    result = cli.invoke(app, ["bench"])
    assert result.exit_code == 2 and "no models given" in result.output
    result = cli.invoke(app, ["bench", "--help"])
    assert result.exit_code == 0 and "Default: 8." in result.output


def test_zoos_are_buildable_specs():
    known = set(torchvision.models.list_models())
    for name in ("quick", "classification", "all"):
        for entry in zoo(name):
            source, _, model = entry.spec.partition(":")
            assert source in ("torchvision", "timm")
            if source == "torchvision":
                assert model in known, entry.spec


def test_cpu_allocator_failure_is_out_of_memory_and_retried(tmp_path):
    path = _models_file(tmp_path)
    cfg = BenchConfig.from_strings([f"{path}:cpu_hungry"], modes="nchw,nhwc", batch=8,
                                   image_size=8, rounds=2, gemm_size=32)
    records = run_bench(cfg).records
    assert [r.status for r in records] == ["ok", "ok"]
    assert all(r.batch == 2 and "out of memory at batch 8" in r.note for r in records)


def _bench_args(path, out, models, *extra):
    return ["bench", *[f"{path}:{m}" for m in models], "--modes", "nchw,nhwc", "--batch", "2",
            "--image-size", "8", "--rounds", "2", "--gemm-size", "32", "--out", str(out), *extra]


def test_resume_keeps_measured_cases_and_runs_only_the_missing_ones(tmp_path):
    path, out = _models_file(tmp_path), tmp_path / "out"
    first = CliRunner().invoke(app, _bench_args(path, out, ["tiny"]))
    assert first.exit_code == 0, first.output
    before = json.loads((out / "results.json").read_text())
    assert {(r["model"].split(":")[-1], r["dtype"]) for r in before} == {("tiny", "fp32")}

    events = []
    real = runner._run_case

    def counting(config, env, spec, dtype, task, *rest):
        events.append((spec.spec.split(":")[-1], dtype, task))
        return real(config, env, spec, dtype, task, *rest)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "_run_case", counting)
        second = CliRunner().invoke(app, _bench_args(path, out, ["tiny", "nchw_only"],
                                                     "--dtype", "fp32,bf16", "--resume"))
    assert second.exit_code == 0, second.output
    # only the three cases not in the first run were measured
    assert sorted(events) == [("nchw_only", "bf16", "infer"), ("nchw_only", "fp32", "infer"),
                              ("tiny", "bf16", "infer")]
    after = json.loads((out / "results.json").read_text())
    assert after[:len(before)] == before  # the first run's records, untouched
    assert len(after) == 4 * 2
    assert "resumed: records from 2 runs" in (out / "summary.md").read_text()

    args = _bench_args(path, out, ["tiny"], "--resume")
    args[args.index("--rounds") + 1] = "3"
    mismatch = CliRunner().invoke(app, args)
    assert mismatch.exit_code != 0
    assert "rounds: 2 then, 3 now" in " ".join(mismatch.output.split())


def test_steady_heap_is_applied_recorded_and_part_of_the_resume_check(tmp_path, monkeypatch):
    calls = []

    def fake_steady_heap() -> bool:  # the real one changes this process for good
        calls.append(1)
        monkeypatch.setitem(malloc._state, "steady", True)
        return True

    monkeypatch.setattr(malloc, "steady_heap", fake_steady_heap)
    path, out = _models_file(tmp_path), tmp_path / "out"
    result = CliRunner().invoke(app, _bench_args(path, out, ["tiny"], "--steady-heap"))
    assert result.exit_code == 0, result.output
    assert calls == [1]
    rows = json.loads((out / "results.json").read_text())
    assert {r["malloc"] for r in rows} == {malloc.describe()}
    summary = (out / "summary.md").read_text()
    assert f"allocator: {malloc.describe()}" in summary and "--steady-heap" in summary
    mismatch = CliRunner().invoke(app, _bench_args(path, out, ["tiny"], "--resume"))
    assert mismatch.exit_code != 0
    assert "steady_heap: True then, False now" in " ".join(mismatch.output.split())
    # a config.json from before the field existed had the default (off): it resumes
    config = json.loads((out / "config.json").read_text())
    del config["steady_heap"]
    (out / "config.json").write_text(json.dumps(config))
    resumed = CliRunner().invoke(app, _bench_args(path, out, ["tiny"], "--resume"))
    assert resumed.exit_code == 0, resumed.output


def test_a_run_killed_mid_way_keeps_every_finished_case(tmp_path):
    path, out = _models_file(tmp_path), tmp_path / "out"
    script = ("import sys; from memlayout.cli import app; sys.argv = ['memlayout', *sys.argv[1:]];"
              " app()")
    proc = subprocess.run([sys.executable, "-c", script,
                           *_bench_args(path, out, ["tiny", "dies"])],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    rows = json.loads((out / "results.json").read_text())
    assert {(r["model"].split(":")[-1], r["mode"], r["status"]) for r in rows} == {
        ("tiny", "nchw", "ok"), ("tiny", "nhwc", "ok")}
    assert not list(out.glob(".*.tmp"))


def test_the_control_mode_is_a_second_nhwc_copy_and_not_a_default(tmp_path):
    assert CONTROL not in DEFAULT_MODES and CONTROL not in BenchConfig(models=("m",)).modes
    path = _models_file(tmp_path)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["bench", f"{path}:tiny", "--modes", f"nchw,nhwc,{CONTROL}",
                                      "--batch", "2", "--image-size", "8", "--rounds", "3",
                                      "--gemm-size", "32", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "A/A control" in result.output
    nchw, nhwc, again = read_json(out / "results.json")
    # summary.md states the noise floor: the median of the per-round ratios nhwc / its copy
    ratio = statistics.median(a / b for a, b in zip(nhwc.round_times_s, again.round_times_s,
                                                    strict=True))
    md = (out / "summary.md").read_text()
    assert "## Noise floor (A/A control)" in md and f"{ratio:.3f}-{ratio:.3f} over 1 cases" in md
    assert again.mode == CONTROL and again.status == "ok" and again.rounds == 3
    assert again.input_format == nhwc.input_format == "channels_last"
    # its own copy: training one does not touch the other's weights
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    a, b = (prepare_mode(m, model, torch.randn(2, 3, 8, 8), dtype="fp32", task="train")
            for m in ("nhwc", CONTROL))
    a.step()
    assert all(p.is_contiguous(memory_format=torch.channels_last)
               for p in b.module.parameters() if p.dim() == 4)
    assert not any(torch.equal(p, q) for p, q in zip(a.module.parameters(),
                                                     b.module.parameters(), strict=True))


def test_a_modes_peak_memory_is_its_own_model_and_step(monkeypatch):
    """On a GPU (the seam's fake here) a mode's peak is its own model's state plus what its
    step allocates beyond what was there before: other modes' models still on the device are
    not counted."""
    from tests.support.fake_cuda import fake_gpu

    gpu = fake_gpu(monkeypatch)
    gpu.allocated = 10 ** 9  # the other modes' models, already on the device
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())

    def step_allocates(*_):
        gpu.peak = gpu.allocated + 4096
    model.register_forward_hook(step_allocates)
    prepared = prepare_mode("nchw", model, torch.randn(2, 3, 8, 8), dtype="fp32", task="infer")
    own = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert prepared.peak_mem_bytes == own + 4096
