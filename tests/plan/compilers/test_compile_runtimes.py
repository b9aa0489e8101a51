"""``memlayout.compile`` with peer runtimes (OpenVINO, ONNX Runtime) as candidates.

Timings are injected (the guard's timer replaced by one that returns chosen ratios) and
Inductor's compile is replaced by the eager module: these tests are about which candidate is
built, verified, kept, recorded and returned, not about speed or Inductor.
"""

from __future__ import annotations

import statistics
from typing import Any

import pytest
import torch
from torch import nn

import memlayout
from memlayout import runtimes
from memlayout.errors import MemlayoutError
from memlayout.plan.compare import compare
from memlayout.plan.compilers import compiled as c
from memlayout.plan.report.plan import Plan
from memlayout.timing import Race, Ratio
from tests.support.machine import openvino_has_bf16

# Peer runtimes (OpenVINO, ONNX Runtime, mkldnn) are built in this process: `make test` runs
# these tests in a pytest process of their own (see the Makefile).
pytestmark = pytest.mark.runtimes

QUICK = {"memory": False, "padding": False, "blocked": False}
# the plan's own guard off: it would call the injected timer too
needs_openvino = pytest.mark.skipif(runtimes.available("openvino") is not None,
                                    reason="openvino is not installed")
needs_mkldnn = pytest.mark.skipif(runtimes.available("mkldnn") is not None,
                                  reason="this torch has no mkldnn tensors")

# (per-round ratios baseline / candidate, margin) -> the candidate kept
DECISIONS = [
    ({"inductor": [1.0, 1.0, 1.0], "openvino": [2.0, 1.9, 2.1]}, 0.02, "openvino"),
    ({"inductor": [1.0, 1.0, 1.0], "openvino": [1.01, 1.01, 1.01]}, 0.02, "inductor"),
    ({"inductor": [0.9, 0.9, 0.9]}, 0.02, "planned+inductor"),
    ({"inductor": [0.99, 0.99, 0.99]}, 0.02, "inductor"),
    ({"inductor": [1.2, 1.2, 1.2], "onnxruntime": [1.3, 1.3, 1.3]}, 0.02, "onnxruntime"),
    ({"inductor": [1.2, 1.2, 1.2], "onnxruntime": [1.21, 1.21, 1.21]}, 0.02, "inductor"),
    ({"openvino": [0.5, 0.5, 0.5]}, 0.02, "planned+inductor"),  # no inductor: the baseline is the default
]


@pytest.mark.parametrize(("ratios", "margin", "kept"), DECISIONS)
def test_the_fastest_candidate_is_kept_only_beyond_the_margin_over_inductor(ratios, margin, kept):
    race = Race(c.Runner.PLAN_COMPILED,
                {n: Ratio(c.Runner.PLAN_COMPILED, n, statistics.median(r), tuple(r))
                 for n, r in ratios.items()}, rounds=3)
    assert race.kept(c.Runner.INDUCTOR_OWN, margin) == kept


def test_runtimes_are_not_candidates_for_training_other_devices_dtypes_or_several_inputs():
    net, x = nn.Conv2d(3, 4, 3), torch.randn(1, 3, 8, 8)
    names = ("openvino", "onnxruntime")
    assert set(c.runtimes_unavailable(names, (x,), net, None, True)) == set(names)
    assert "cannot train" in c.runtimes_unavailable(names, (x,), net, None, True)["openvino"]
    assert "fp16" in c.runtimes_unavailable(names, (x,), net, torch.float16, False)["openvino"]
    assert "one input" in c.runtimes_unavailable(names, (x, x), net, None, False)["onnxruntime"]
    on_cpu = c.runtimes_unavailable(names, (x,), net, torch.bfloat16, False)
    assert on_cpu == {n: runtimes.available(n) for n in names if runtimes.available(n)}
    with pytest.raises(ValueError, match="unknown runtimes"):
        c.runtimes_unavailable(("tensorrt",), (x,), net, None, False)
    with pytest.raises(TypeError, match="a tuple of names"):
        c.runtimes_unavailable("openvino", (x,), net, None, False)


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3)).eval()


def _fake_timer(seconds: dict[str, float], calls: list[dict[str, Any]]):
    """The guard's timer with chosen per-call seconds: each model is called once on its own
    inputs (as the real timer does), then the ratios those seconds give are returned."""

    def time_candidates(models, inputs, dtype, *, device, rounds, inputs_of=None, **_: Any):
        for name, m in models.items():
            with torch.no_grad():
                m(*(inputs_of or {}).get(name, inputs))
        calls.append(dict(models))
        base = seconds[c.Runner.PLAN_COMPILED]  # the plan is the baseline: the race's reference
        speed = {n: base / seconds.get(n, seconds[c.Runner.INDUCTOR_OWN]) for n in models if n != c.Runner.PLAN_COMPILED}
        return Race(c.Runner.PLAN_COMPILED, {n: Ratio(c.Runner.PLAN_COMPILED, n, s, (s,) * rounds)
                                for n, s in speed.items()}, rounds=rounds)
    return time_candidates


@pytest.fixture
def eager_inductor(monkeypatch):
    """Inductor's compile replaced by the eager module: its compile is not under test here."""
    monkeypatch.setattr(c, "_compiled", lambda module, kwargs: module)


@pytest.mark.parametrize("runtime", [pytest.param("openvino", marks=needs_openvino),
                                     pytest.param("mkldnn", marks=needs_mkldnn)])
def test_a_faster_runtime_is_kept_verified_recorded_and_cached(runtime, tmp_path, monkeypatch,
                                                                eager_inductor):
    net, x = _cnn(), torch.randn(2, 3, 16, 16)
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(c, "time_candidates", _fake_timer(
        {c.Runner.PLAN_COMPILED: 1.0, c.Runner.INDUCTOR_OWN: 1.0, runtime: 0.5}, calls))
    cache = tmp_path / "costs.sqlite"
    fast = memlayout.compile(net, x, cache=cache, rounds=3, guard=False, plan_kwargs=QUICK,
                             runtimes=(runtime,))
    record = fast.plan.compiled
    assert isinstance(fast, c.RuntimeModule) and isinstance(fast, nn.Module)
    assert record.kept == runtime and record.source == "measured"
    assert set(calls[0]) == {c.Runner.PLAN_COMPILED, c.Runner.INDUCTOR_OWN, c.Runner.INDUCTOR_FROZEN, runtime}  # one timing
    assert record.candidates[runtime].median == pytest.approx(2.0)
    assert record.candidates[c.Runner.INDUCTOR_OWN].median == pytest.approx(1.0)
    assert record.baseline == c.Runner.PLAN_COMPILED
    assert set(record.compile_seconds) == {c.Runner.PLAN_COMPILED, c.Runner.INDUCTOR_OWN, c.Runner.INDUCTOR_FROZEN, runtime}
    # the runtime's own words for its precision, once built
    assert record.precision[runtime] != f"{runtime} fp32" and "32" in record.precision[runtime]
    assert record.precision[c.Runner.PLAN_COMPILED] == "fp32"
    assert record.input_format == "contiguous"
    assert f"kept the {runtime} runtime's model" in fast.plan.summary()
    assert Plan.from_json(fast.plan.to_json()).compiled == record

    # called with tensors, in any layout; prepare_inputs hands over the one it reads
    with torch.no_grad():
        want = net(x)
    torch.testing.assert_close(fast(x), want, rtol=1e-4, atol=1e-5)
    cl = x.contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(fast(cl), want, rtol=1e-4, atol=1e-5)
    (prepared,) = memlayout.prepare_inputs(fast, cl)
    assert prepared.is_contiguous()

    # the original's state_dict; load_state_dict rebuilds the runtime's own copy of the weights
    assert list(fast.state_dict()) == list(net.state_dict())
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in fast.state_dict().items())
    other = _cnn()
    fast.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fast(x), other(x), rtol=1e-4, atol=1e-5)

    with pytest.raises(MemlayoutError, match="inference only"):
        fast.train()(x)
    fast.eval()

    # the second compile reads the decision: builds the runtime only, times nothing
    again = memlayout.compile(net, x, cache=cache, rounds=3, guard=False, plan_kwargs=QUICK,
                              runtimes=(runtime,))
    assert again.plan.compiled.source == "cache" and again.plan.compiled.kept == runtime
    assert list(again.plan.compiled.compile_seconds) == [runtime]
    assert len(calls) == 1


@needs_openvino
def test_a_runtime_in_bf16_is_its_own_bf16_verified_at_bf16_tolerance(monkeypatch,
                                                                      eager_inductor):
    net, x = _cnn(), torch.randn(2, 3, 16, 16)
    monkeypatch.setattr(c, "time_candidates", _fake_timer(
        {c.Runner.PLAN_COMPILED: 1.0, c.Runner.INDUCTOR_OWN: 1.0, "openvino": 0.5, "onnxruntime": 2.0}, []))
    fast = memlayout.compile(net, x, dtype="bf16", cache=False, rounds=3, guard=False, plan_kwargs=QUICK)
    record = fast.plan.compiled
    assert record.precision[c.Runner.INDUCTOR_OWN].startswith("torch.autocast bf16")
    if not openvino_has_bf16():  # a CPU without bf16: OpenVINO says so, not a failure
        assert "no bf16 support" in record.unavailable["openvino"]
        assert record.kept == c.Runner.INDUCTOR_OWN
        return
    assert record.kept == "openvino", record
    assert "bf16" in record.precision["openvino"] and "own bf16" in record.precision["openvino"]
    # ONNX Runtime's CPU provider has no bf16 convolution: not a candidate, and why
    if runtimes.available("onnxruntime") is None:
        assert "bf16" in record.unavailable["onnxruntime"]
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        want = net(x)
    got = fast(x)
    assert got.dtype == torch.float32  # fp32 out of the runtime, bf16 inside
    ok, err, _ = compare(want, got, torch.bfloat16)
    assert ok, err


def test_runtimes_off_keeps_to_pytorch(monkeypatch, eager_inductor):
    net, x = _cnn(), torch.randn(1, 3, 12, 12)
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(c, "time_candidates", _fake_timer(
        {c.Runner.PLAN_COMPILED: 1.0, c.Runner.INDUCTOR_OWN: 2.0}, calls))
    fast = memlayout.compile(net, x, cache=False, rounds=3, guard=False, plan_kwargs=QUICK, runtimes=())
    assert set(calls[0]) == {c.Runner.PLAN_COMPILED, c.Runner.INDUCTOR_OWN, c.Runner.INDUCTOR_FROZEN}
    assert fast.plan.compiled.kept == c.Runner.PLAN_COMPILED
    assert fast.plan.compiled.unavailable == {}


@needs_mkldnn
def test_mkldnn_runs_a_model_of_mkldnn_ops_and_is_unavailable_for_one_without(monkeypatch,
                                                                              eager_inductor):
    net, x = _cnn(), torch.randn(2, 3, 16, 16)
    model = runtimes.build_runtime(net, x, runtimes.RuntimeOptions("mkldnn"))
    with torch.no_grad():
        torch.testing.assert_close(model(x), net(x), rtol=1e-4, atol=1e-5)
    # ReLU6 (every MobileNet) has no mkldnn kernel: not a candidate, and the op is named
    relu6 = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU6()).eval()
    monkeypatch.setattr(c, "time_candidates", _fake_timer({c.Runner.PLAN_COMPILED: 1.0, c.Runner.INDUCTOR_OWN: 1.0}, []))
    fast = memlayout.compile(relu6, x, cache=False, rounds=3, guard=False, plan_kwargs=QUICK,
                             runtimes=("mkldnn",), freezing=False)
    assert "hardtanh" in fast.plan.compiled.unavailable["mkldnn"]
    assert fast.plan.compiled.kept in (c.Runner.PLAN_COMPILED, c.Runner.INDUCTOR_OWN)


def test_a_training_plan_has_no_runtime_or_frozen_candidate_and_says_why(monkeypatch,
                                                                         eager_inductor):
    net, x = _cnn(), torch.randn(2, 3, 16, 16)
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(c, "time_candidates", _fake_timer({c.Runner.PLAN_COMPILED: 1.0, c.Runner.INDUCTOR_OWN: 1.0},
                                                            calls))
    fast = memlayout.compile(net, x, cache=False, rounds=3, guard=False,
                             plan_kwargs={**QUICK, "train": True})
    record = fast.plan.compiled
    assert set(calls[0]) == {c.Runner.PLAN_COMPILED, c.Runner.INDUCTOR_OWN}
    assert c.Runner.INDUCTOR_FROZEN not in record.settings
    assert set(record.unavailable) == set(runtimes.ADAPTERS)
    assert all("cannot train" in why for why in record.unavailable.values())
    assert "not a candidate: a runtime model cannot train" in fast.plan.summary()


@needs_openvino
def test_the_bench_mode_runs_the_kept_runtime_on_the_input_it_reads(monkeypatch, eager_inductor,
                                                                    tmp_path):
    from memlayout.bench.modes import prepare_mode

    monkeypatch.setenv("MEMLAYOUT_CACHE_DIR", str(tmp_path))  # the cost cache: not the user's
    monkeypatch.setattr(c, "time_candidates", _fake_timer(
        {c.Runner.PLAN_COMPILED: 1.0, c.Runner.INDUCTOR_OWN: 1.0, "openvino": 0.25}, []))
    net, x = _cnn(), torch.randn(2, 3, 16, 16)
    prepared = prepare_mode("planned+compile", net, x.contiguous(memory_format=torch.channels_last),
                            dtype="fp32", task="infer")
    assert "kept openvino" in prepared.note and "f32" in prepared.note
    assert prepared.input_format == "contiguous"  # converted once, before the timed calls
    with torch.no_grad():
        torch.testing.assert_close(prepared.step(), net(x), rtol=1e-4, atol=1e-5)


@needs_mkldnn
def test_a_runtime_model_refuses_what_it_would_ignore() -> None:
    """A runtime runs no Python of the model: a hook on it, or anything changed in the copy
    it was built from, raises instead of being silently ignored; rebuild() takes the change."""
    from memlayout.errors import MemlayoutError
    from memlayout.plan.compilers.runtime_model import RuntimeModule

    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).eval()
    x = torch.randn(1, 3, 8, 8)
    fast = RuntimeModule(net, None, x, runtimes.RuntimeOptions("mkldnn"))
    with torch.no_grad():
        torch.testing.assert_close(fast(x), net(x), rtol=1e-4, atol=1e-5)
    with pytest.raises(MemlayoutError, match="never run"):
        fast.register_forward_hook(lambda *_: None)
    fast.module[1] = nn.Identity()  # a replaced submodule the runtime would not see
    with pytest.raises(MemlayoutError, match="changed since it was built"):
        fast(x)
    fast.rebuild()
    with torch.no_grad():
        torch.testing.assert_close(fast(x), net[0](x), rtol=1e-4, atol=1e-5)
