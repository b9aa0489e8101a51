"""Peer runtimes (OpenVINO, ONNX Runtime) as adapters and as bench modes, and the GEMM peak.

Runtime outputs are checked against torch's own on the same weights and input; a runtime that
is missing is simulated by making its import fail (``sys.modules[name] = None``). No timings.
"""

from __future__ import annotations

import dataclasses
import sys
import textwrap

import pytest
import torch
from torch import nn

from memlayout import runtimes
from memlayout.bench import BenchConfig, run_bench
from memlayout.bench.runner import GEMM, PEAK_EVENT_MODEL
from memlayout.plan.compare import compare
from memlayout.runtimes import INSTALL, RuntimeOptions, RuntimeUnavailable, build_runtime
from tests.support.machine import openvino_has_bf16

# Peer runtimes (OpenVINO, ONNX Runtime, mkldnn) are built in this process: `make test` runs
# these tests in a pytest process of their own (see the Makefile).
pytestmark = pytest.mark.runtimes

HAVE = {name: runtimes.available(name) is None for name in runtimes.RUNTIMES}
needs = {name: pytest.mark.skipif(not ok, reason=f"{name} not installed ({INSTALL})")
         for name, ok in HAVE.items()}

NETS = """
import torch
from torch import nn


def convs():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 16, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 5))
"""


def _convs() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
                          nn.Conv2d(16, 16, 1))
    with torch.no_grad():  # running statistics that are not the identity: BN folding is tested
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    return model.eval()


def _nets_file(tmp_path):
    path = tmp_path / "rt_nets.py"
    path.write_text(textwrap.dedent(NETS))
    return path


@pytest.mark.parametrize("runtime", [pytest.param(r, marks=needs[r]) for r in runtimes.RUNTIMES])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_runtime_fp32_output_equals_torch(runtime, layout):
    model, x = _convs(), torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = model(x)
    rt = build_runtime(model, x, RuntimeOptions(runtime, input_layout=layout))
    # an HWC pipeline hands over channels-last memory; the NHWC export reads it as it is
    feed = x.contiguous(memory_format=torch.channels_last) if layout == "nhwc" else x
    got = rt(feed)
    assert isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == torch.float32
    ok, worst, _ = compare(want, got, None)
    assert ok, worst
    assert rt.convert_s > 0 and rt.compile_s > 0 and "fp32" in rt.precision
    assert rt(x + 1).sub(got).abs().max() > 0  # a second input gives a second answer, not a cache


def _openvino_bf16() -> bool:
    return HAVE["openvino"] and openvino_has_bf16()


@needs["openvino"]
@pytest.mark.skipif(not _openvino_bf16(), reason="OpenVINO has no bf16 on this CPU")
def test_openvino_bf16_is_its_own_bf16_and_agrees_with_autocast():
    model, x = _convs(), torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        fp32 = model(x)
        with torch.autocast("cpu", torch.bfloat16):
            autocast = model(x)
    rt = build_runtime(model, x, RuntimeOptions("openvino", dtype=torch.bfloat16))
    got = rt(x)
    assert "bf16" in rt.precision and "autocast" not in rt.precision
    assert compare(autocast, got, torch.bfloat16)[0]
    # it really computed in bf16: not the fp32 answer to fp32 precision
    assert not compare(fp32, got, None)[0]


@needs["openvino"]
@pytest.mark.skipif(_openvino_bf16(), reason="OpenVINO computes in bf16 on this CPU")
def test_openvino_bf16_on_a_cpu_without_it_is_unavailable_and_says_why():
    with pytest.raises(RuntimeUnavailable, match="no bf16 support on this CPU"):
        build_runtime(_convs(), torch.randn(1, 3, 32, 32),
                      RuntimeOptions("openvino", dtype=torch.bfloat16))


@needs["onnxruntime"]
def test_onnxruntime_bf16_is_unavailable_with_the_runtimes_reason():
    with pytest.raises(RuntimeUnavailable, match="bf16") as info:
        build_runtime(_convs(), torch.randn(1, 3, 32, 32),
                      RuntimeOptions("onnxruntime", dtype=torch.bfloat16))
    assert "fp32 only" in str(info.value)


@pytest.mark.parametrize("runtime", runtimes.RUNTIMES)
def test_missing_runtime_names_the_install_command(runtime, monkeypatch):
    monkeypatch.setitem(sys.modules, runtime, None)  # import fails as if not installed
    assert INSTALL in (runtimes.available(runtime) or "")
    with pytest.raises(RuntimeUnavailable, match="memlayout\\[runtimes\\]"):
        build_runtime(_convs(), torch.randn(1, 3, 32, 32), RuntimeOptions(runtime))


def test_missing_runtimes_are_unavailable_records_and_the_rest_runs(tmp_path, monkeypatch):
    for name in runtimes.RUNTIMES:
        monkeypatch.setitem(sys.modules, name, None)
    cfg = BenchConfig.from_strings([f"{_nets_file(tmp_path)}:convs"],
                                   modes="nchw,openvino,onnxruntime", batch=2, image_size=32,
                                   rounds=2, gemm_size=32)
    by_mode = {r.mode: r for r in run_bench(cfg).records}
    assert by_mode["nchw"].status == "ok"
    for name in runtimes.RUNTIMES:
        assert by_mode[name].status == "unavailable"
        assert INSTALL in by_mode[name].error


@pytest.mark.skipif(not all(HAVE.values()), reason=f"runtimes not installed ({INSTALL})")
def test_runtime_modes_are_timed_checked_and_recorded(tmp_path):
    cfg = BenchConfig.from_strings([f"{_nets_file(tmp_path)}:convs"],
                                   modes="nchw,openvino,onnxruntime", dtypes="fp32,bf16",
                                   tasks="infer,train", batch=2, image_size=32, rounds=2,
                                   gemm_size=32)
    got = {(r.dtype, r.task, r.mode): r for r in run_bench(cfg).records}
    bf16 = openvino_has_bf16()
    for dtype in ("fp32", "bf16"):
        ov = got[(dtype, "infer", "openvino")]
        if dtype == "bf16" and not bf16:  # this CPU has none: a record that says so
            assert ov.status == "unavailable" and "no bf16 support" in ov.error
        else:
            assert ov.status == "ok", ov.error
            assert ov.rounds == 2 and ov.speedup is not None and ov.compile_s > 0
            assert "output vs eager NCHW" in ov.note and ov.peak_fraction is not None
        for runtime in runtimes.RUNTIMES:  # training is not what these runtimes do
            assert got[(dtype, "train", runtime)].status == "unavailable"
    if bf16:
        assert "bf16" in got[("bf16", "infer", "openvino")].note
    assert got[("fp32", "infer", "onnxruntime")].status == "ok"
    ort_bf16 = got[("bf16", "infer", "onnxruntime")]
    assert ort_bf16.status == "unavailable" and "bf16" in ort_bf16.error


@needs["openvino"]
def test_a_runtime_that_computes_something_else_is_an_error_record(tmp_path, monkeypatch):
    real = runtimes.build_runtime

    def off_by_one(*args, **kwargs):
        rt = real(*args, **kwargs)
        return dataclasses.replace(rt, run=lambda x: rt.run(x) + 1)
    monkeypatch.setattr(runtimes, "build_runtime", off_by_one)
    cfg = BenchConfig.from_strings([f"{_nets_file(tmp_path)}:convs"], modes="nchw,openvino",
                                   batch=2, image_size=32, rounds=2, gemm_size=32)
    nchw, ov = run_bench(cfg).records
    assert nchw.status == "ok"
    assert ov.status == "error" and "differs from eager NCHW" in ov.error and ov.rounds == 0


def test_gemm_peak_is_measured_once_per_dtype_and_shared_by_every_record(tmp_path):
    events = []
    nets = _nets_file(tmp_path)
    (tmp_path / "rt_nets2.py").write_text(textwrap.dedent(NETS))
    cfg = BenchConfig.from_strings([f"{nets}:convs", f"{tmp_path / 'rt_nets2.py'}:convs"],
                                   modes="nchw,nhwc", dtypes="fp32,bf16", batch=2,
                                   image_size=32, rounds=3, warmup=0, gemm_size=64)
    records = run_bench(cfg, on_event=events.append).records
    peak_rounds = [(e.dtype, e.round) for e in events if e.model == PEAK_EVENT_MODEL]
    assert all(e.mode == GEMM for e in events if e.model == PEAK_EVENT_MODEL)
    assert sorted(peak_rounds) == [(d, r) for d in ("bf16", "fp32") for r in range(3)]
    for dtype in ("fp32", "bf16"):
        rates = {r.gemm_flops_per_s for r in records if r.dtype == dtype}
        assert len(rates) == 1 and None not in rates
        methods = {r.gemm_method for r in records if r.dtype == dtype}
        assert methods == {next(iter(methods))} and f"on {dtype} tensors" in next(iter(methods))
        for r in records:
            if r.dtype == dtype:
                assert r.peak_fraction == pytest.approx(r.flops_per_s / r.gemm_flops_per_s)
