"""The device seam: its CUDA implementation run on the CPU through the recording fake, and
the planner's three entry points run with every device question answered by it."""

from __future__ import annotations

import json
import sqlite3
import warnings

import pytest
import torch
import torch._dynamo
from torch import nn

import memlayout
from memlayout import devices, machine
from memlayout.errors import MemlayoutError
from memlayout.plan.compilers.backend import Backend
from memlayout.timing import repeats_for
from tests.support.fake_cuda import FakeGpu, Recording, fake_gpu


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()).eval()


def test_the_fake_refuses_what_torch_cuda_does_not_have():
    fake = Recording(torch.cuda, {"synchronize": None})
    with pytest.raises(AttributeError):
        fake.measured_on  # noqa: B018  (no such function in torch.cuda)
    with pytest.raises(TypeError):  # the real signature: synchronize(device=None)
        fake.synchronize(0, 1)
    with pytest.raises(AssertionError, match="does not model"):
        fake.get_device_name  # noqa: B018


def test_synchronize_waits_on_the_device_it_is_for():
    gpu = FakeGpu()
    gpu.device(torch.device("cuda", 1)).synchronize()
    gpu.device(torch.device("cuda")).synchronize()  # no index: the current device's
    assert gpu.cuda.called("synchronize") == [((1,), {}), ((0,), {})]


def test_the_fingerprint_holds_every_setting_that_picks_kernels():
    gpu = FakeGpu()
    seam = gpu.device(torch.device("cuda", 0))
    first = seam.fingerprint()
    assert first.startswith("cuda:NVIDIA H100 80GB HBM3:sm90:")
    assert "cudnn=91002" in first and f"cuda={torch.version.cuda}" in first
    seen = {first}
    for setting, value in (("benchmark", True), ("allow_tf32", False), ("deterministic", True)):
        setattr(gpu.cudnn, setting, value)
        seen.add(seam.fingerprint())
    gpu.matmul.allow_tf32 = True
    seen.add(seam.fingerprint())
    assert len(seen) == 5  # each setting changes the key its costs are cached under
    # a plan for cuda:0 serves cuda:1 of the same kind
    assert gpu.device(torch.device("cuda", 1)).fingerprint() == seam.fingerprint()


def test_tf32_rounding_is_read_from_the_settings_and_the_gpu():
    assert FakeGpu().device(torch.device("cuda")).fp32_rounding()  # cuDNN's default: on
    old = FakeGpu(capability=(7, 0))  # Volta: no TF32
    assert not old.device(torch.device("cuda")).fp32_rounding()
    off = FakeGpu()
    off.cudnn.allow_tf32 = False
    assert not off.device(torch.device("cuda")).fp32_rounding()
    assert not devices.seam("cpu").fp32_rounding()


def test_warm_up_runs_until_the_per_call_time_settles():
    """A first call that autotunes (1 s) and a second still loading kernels (0.3 s), then
    0.5 ms calls: the repeat count comes from the 0.5 ms, not from the first call."""
    reads, now = [], 0.0
    for seconds in (0.3, 0.0005, 0.0005, 0.0005):  # each call: a clock read before and after
        reads += [now, now + seconds]
        now += seconds
    clock = iter(reads).__next__
    calls = []
    settled = FakeGpu().device(torch.device("cuda")).settle(lambda: calls.append(1), 1.0,
                                                            clock=clock)
    assert settled == pytest.approx(0.0005)
    assert len(calls) == 3  # 0.3 s, then 0.5 ms twice in a row
    assert repeats_for(settled) > repeats_for(1.0) == 1
    assert devices.seam("cpu").settle(lambda: None, 1.0) == 1.0  # a CPU: the first call


def test_peak_memory_and_the_rng_fork_go_through_the_allocator_and_the_gpu_state():
    gpu = FakeGpu()
    seam = gpu.device(torch.device("cuda"))
    gpu.allocated = 100

    def call():
        gpu.peak, gpu.allocated = 1100, 300
    assert seam.peak_memory(call) == devices.MemoryPeak(1000, 200)
    assert [n for n, *_ in gpu.cuda.calls][1:3] == ["synchronize", "memory_allocated"]
    before = torch.random.get_rng_state()
    with seam.fork_rng():
        torch.rand(3)
    assert torch.equal(torch.random.get_rng_state(), before)
    (state, index), _ = gpu.cuda.called("set_rng_state")[0]
    assert state is gpu.rng_states[0] and index == 0
    assert seam.channel_blocks(torch.bfloat16) == (8,) and not seam.host
    assert seam.bf16() is None  # bf16 is a GPU's own arithmetic: not measured


def test_a_device_memlayout_does_not_run_on_is_refused_in_one_line():
    with pytest.raises(MemlayoutError, match="cpu and cuda"):
        devices.seam("xpu")


def test_a_cpu_fingerprint_is_the_cpu_and_its_threads():
    fingerprint = devices.seam("cpu").fingerprint()
    assert machine.cpu_model() in fingerprint and machine.cpu_isa().capability in fingerprint


@pytest.fixture
def gpu(monkeypatch) -> FakeGpu:
    torch._dynamo.reset()
    yield fake_gpu(monkeypatch)
    torch._dynamo.reset()


def _keys(path) -> list[str]:
    with sqlite3.connect(path) as db:
        return [json.loads(k)[1] for (k,) in db.execute("SELECT key FROM entries")
                if k.startswith("[")]


QUICK = {"rounds": 2, "guard_rounds": 2, "padding": False}


def test_optimize_through_the_cuda_seam_measures_guards_and_verifies(gpu, tmp_path):
    net, x = _net(), torch.randn(2, 3, 16, 16)
    cache = tmp_path / "costs.sqlite"
    planned = memlayout.optimize(net, x, cache=cache, **QUICK)
    torch.testing.assert_close(planned(x), net(x))
    assert planned.plan.verification is not None
    synced = gpu.cuda.called("synchronize")
    assert synced and all(args == (0,) for args, _ in synced)
    fingerprint = gpu.device(torch.device("cuda")).fingerprint()
    keys = [k for k in _keys(cache) if isinstance(k, str) and k.startswith("cuda:")]
    assert keys and set(keys) == {fingerprint}


def test_memlayout_compile_through_the_cuda_seam(gpu, tmp_path):
    net, x = _net(), torch.randn(2, 3, 16, 16)
    fast = memlayout.compile(net, x, cache=tmp_path / "c.sqlite", rounds=2, backend="eager",
                             runtimes=(), plan_kwargs=QUICK)
    torch.testing.assert_close(fast(x), net(x))
    assert gpu.cuda.called("synchronize")


def test_the_backend_through_the_cuda_seam(gpu, tmp_path):
    net, x = _net(), torch.randn(2, 3, 16, 16)
    compiled = torch.compile(net, backend=Backend(cache=tmp_path / "b.sqlite", rounds=2,
                                                  inner="eager"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(x)
    assert not [str(w.message) for w in caught if "memlayout backend" in str(w.message)]
    torch.testing.assert_close(out, net(x))
    report = memlayout.backend_report()
    assert report.graphs and all(g.planned for g in report.graphs)
    assert gpu.cuda.called("synchronize")
    assert any(k.startswith("cuda:") for k in _keys(tmp_path / "b.sqlite") if isinstance(k, str))


def test_fp32_under_tf32_is_held_to_tf32s_rounding(monkeypatch):
    """NCHW and NHWC convolutions round TF32 inputs differently: an fp32 result off by TF32's
    rounding (10 mantissa bits) grown through a few layers, injected here, is within
    tolerance where the device rounds to TF32, and outside it where fp32 is computed in fp32."""
    from memlayout.plan.compare import compare

    want = torch.randn(4, 8, 6, 6)
    scale = want.abs().max()
    rounded = want + 4 * 2.0 ** -10 * scale * torch.randn_like(want).sign()
    assert not compare(want, rounded, None)[0]  # a CPU: fp32 is fp32
    gpu = fake_gpu(monkeypatch)
    assert compare(want, rounded, None)[0]
    gpu.cudnn.allow_tf32 = False  # torch.backends.cudnn.allow_tf32 = False: fp32 again
    assert not compare(want, rounded, None)[0]


def test_the_fp32_gemm_peak_runs_in_the_convolutions_precision(monkeypatch):
    """cuDNN rounds fp32 convolutions to TF32 by default and cuBLAS does not: the GEMM peak
    they are compared with is timed with cuBLAS's switch set to cuDNN's, then restored."""
    from memlayout.bench.modes import gemm_step, matmul_isa

    gpu = fake_gpu(monkeypatch)
    seen = []
    monkeypatch.setattr(torch, "mm", lambda a, b, out: seen.append(gpu.matmul.allow_tf32))
    gemm, _ = gemm_step(8, "fp32")
    gemm()
    assert seen == [True] and gpu.matmul.allow_tf32 is False
    assert "TF32" in matmul_isa("fp32", "cpu") and "TF32" not in matmul_isa("bf16", "cpu")


def test_a_call_that_never_settles_is_timed_as_it_last_ran_and_the_device_is_made_current():
    gpu = FakeGpu()
    seam = gpu.device(torch.device("cuda", 3))
    reads, now = [], 0.0
    for k in range(devices.SETTLE_CALLS):  # each call twice as long as the last: never settles
        reads += [now, now + 1e-9 * 2 ** (k + 1)]
        now += 1e-9 * 2 ** (k + 1)
    last = seam.settle(lambda: None, 1e-9, clock=iter(reads).__next__)
    assert last == pytest.approx(1e-9 * 2 ** devices.SETTLE_CALLS)
    assert len(gpu.cuda.called("synchronize")) == 2 * devices.SETTLE_CALLS
    seam.make_current()
    seam.release()
    assert gpu.cuda.called("set_device") == [((3,), {})] and gpu.cuda.called("empty_cache")
