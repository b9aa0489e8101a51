"""The device seam (L1): the one place that knows how devices differ.

Everything that depends on what runs the kernels asks :func:`seam` for the device's
implementation of one interface, :class:`Device`, and never branches on ``device.type``:

- ``synchronize``: wait for this device's queued work (a CUDA stream runs ahead of Python,
  so a clock read without it times launches, not kernels); per device index;
- ``peak_memory``: the allocator's peak around one call (``None`` on a CPU: no allocator
  statistics there, so the caller counts tensor lifetimes);
- ``fingerprint``: what a timing depends on, the first part of every cost key (on CUDA the
  GPU, its capability, the CUDA and cuDNN versions, ``cudnn.benchmark``, TF32 and
  ``deterministic``: a cost taken under one setting says nothing of another);
- ``fork_rng``: the random state of this device restored after a block;
- ``bf16``: the measured bf16 verdict (CPUs only: without AVX512-BF16 or AMX it is emulated);
- ``settle``: the warm-up rule, until the per-call time stops falling (cuDNN autotuning and
  lazy kernel loading make a GPU's first calls slow);
- ``fp32_rounding``: whether fp32 convolutions or matmuls round their inputs to TF32 here
  (NCHW and NHWC kernels then round differently: the tolerance follows).

The CUDA implementation takes ``torch.cuda`` and ``torch.backends``' cuDNN and cuBLAS
settings as arguments, so the test suite runs every line of it on a CPU through a recording
fake (``tests/support/fake_cuda.py``) that refuses any attribute torch itself lacks.

>>> cpu = seam("cpu")
>>> cpu.synchronize()  # nothing queued on a CPU
>>> cpu.fingerprint().startswith("cpu:"), cpu.peak_memory(lambda: None), cpu.fp32_rounding()
(True, None, False)
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from memlayout import machine
from memlayout.errors import MemlayoutError

#: the warm-up rule: calls after the first until two in a row agree within this fraction
SETTLED = 0.2
#: at most this many warm-up calls (a call that never settles is timed as it is then) ...
SETTLE_CALLS = 20
#: ... and at most this many seconds of them
SETTLE_SECONDS = 2.0


@dataclass(frozen=True)
class MemoryPeak:
    """The allocator's peak during a call and what was still allocated after it, in bytes
    beyond what was allocated before."""

    peak: int
    end: int


class Device:
    """One device's answers (module docstring); :func:`seam` gives the right one.
    ``host``: the kernels run on the host CPU (oneDNN's blocked tensors and the peer
    runtimes, OpenVINO and ONNX Runtime's CPU provider, exist only there)."""

    host = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def synchronize(self) -> None:
        """Wait for the work queued on this device."""

    def name(self) -> str:
        """What runs the kernels: the CPU's model name, or the GPU's."""
        return machine.cpu_model()

    def fingerprint(self) -> str:
        """What a timing on this device depends on (a cost key's first part)."""
        raise NotImplementedError

    def peak_memory(self, fn: Callable[[], Any]) -> MemoryPeak | None:
        """The allocator's peak around ``fn()``; ``None``: no allocator statistics here."""
        return None

    @contextlib.contextmanager
    def fork_rng(self) -> Iterator[None]:
        """The CPU's random state (and this device's) as it was before the block."""
        with torch.random.fork_rng(devices=[]):
            yield

    def bf16(self) -> machine.Bf16Speed | None:
        """The measured bf16 verdict; ``None`` where bf16 is the device's own arithmetic."""
        return None

    def fp32_rounding(self) -> bool:
        """fp32 convolutions or matmuls round their inputs to TF32 here."""
        return False

    @contextlib.contextmanager
    def matmul_as_convolutions(self) -> Iterator[None]:
        """fp32 matmuls in the block round as fp32 convolutions do here (a GEMM peak that
        convolutions are compared with must be taken in their precision)."""
        yield

    def channel_blocks(self, dtype: torch.dtype | None,
                       isa: machine.CpuIsa | None = None) -> tuple[int, ...]:
        """The channel multiples the kernels favour here (padding candidates): a CPU's
        (``isa``, default this one's) vector width in fp32 lanes, 16 and 8 with AVX-512.

        >>> seam("cpu").channel_blocks(None, machine.CpuIsa("AVX512"))
        (16, 8)
        """
        lanes = (isa or machine.cpu_isa()).vector_floats
        return (16, 8) if lanes == 16 else (lanes,)

    def settle(self, fn: Callable[[], Any], first: float, *,
               clock: Callable[[], float] = time.perf_counter) -> float:
        """Seconds per call of ``fn`` once warm, given the first call's ``first`` seconds."""
        return first

    def make_current(self) -> None:
        """Make this device the process's current one (before any collective on it)."""

    def release(self) -> None:
        """Give cached, unused memory back (between benchmark modes)."""


class CpuDevice(Device):
    """The CPU (and the meta device): nothing queued, no allocator statistics, the first call
    timed as it is (oneDNN's primitive cache fills at it, and a second call is no faster
    than a repeat)."""

    def fingerprint(self) -> str:
        """The CPU's model, the instruction set ATen dispatches to (``ATEN_CPU_CAPABILITY``
        lowers it) and torch's thread count."""
        return (f"cpu:{machine.cpu_model()}:{machine.cpu_isa().capability}"
                f":threads={torch.get_num_threads()}")

    def bf16(self) -> machine.Bf16Speed:
        return machine.bf16_speed()


class CudaDevice(Device):
    """An NVIDIA GPU through ``cuda`` (``torch.cuda``), ``cudnn`` (``torch.backends.cudnn``)
    and ``matmul`` (``torch.backends.cuda.matmul``), each injectable."""

    host = False

    def __init__(self, device: torch.device, *, cuda: Any = None, cudnn: Any = None,
                 matmul: Any = None) -> None:
        self.cuda = torch.cuda if cuda is None else cuda
        self.cudnn = torch.backends.cudnn if cudnn is None else cudnn
        self.matmul = torch.backends.cuda.matmul if matmul is None else matmul
        super().__init__(device)

    @functools.cached_property
    def index(self) -> int:
        """The device's index; ``cuda`` without one: the current device (asked only when
        needed, so a question that needs no GPU works without one)."""
        return self.device.index if self.device.index is not None else int(self.cuda.current_device())

    def synchronize(self) -> None:
        self.cuda.synchronize(self.index)

    def name(self) -> str:
        return str(self.cuda.get_device_name(self.index))

    def fingerprint(self) -> str:
        """The GPU and capability, CUDA and cuDNN versions, and the settings that pick its
        kernels (no device index: a plan for ``cuda:0`` serves ``cuda:1`` of the same kind)."""
        major, minor = self.cuda.get_device_capability(self.index)
        return (f"cuda:{self.name()}:sm{major}{minor}:cuda={torch.version.cuda}"
                f":cudnn={self.cudnn.version()}:benchmark={bool(self.cudnn.benchmark)}"
                f":tf32=conv{int(bool(self.cudnn.allow_tf32))}"
                f",mm{int(bool(self.matmul.allow_tf32))}"
                f",{torch.get_float32_matmul_precision()}"
                f":deterministic={bool(self.cudnn.deterministic)}")

    def peak_memory(self, fn: Callable[[], Any]) -> MemoryPeak:
        self.synchronize()
        before = int(self.cuda.memory_allocated(self.index))
        self.cuda.reset_peak_memory_stats(self.index)
        fn()
        self.synchronize()
        peak = int(self.cuda.max_memory_allocated(self.index)) - before
        return MemoryPeak(peak, int(self.cuda.memory_allocated(self.index)) - before)

    @contextlib.contextmanager
    def fork_rng(self) -> Iterator[None]:
        cpu = torch.random.get_rng_state()
        gpu = self.cuda.get_rng_state(self.index)
        try:
            yield
        finally:
            torch.random.set_rng_state(cpu)
            self.cuda.set_rng_state(gpu, self.index)

    def fp32_rounding(self) -> bool:
        """TF32 needs compute capability 8.0 (Ampere) or later."""
        major, _ = self.cuda.get_device_capability(self.index)
        tf32 = (bool(self.cudnn.allow_tf32) or bool(self.matmul.allow_tf32)
                or torch.get_float32_matmul_precision() != "highest")
        return major >= 8 and tf32

    def settle(self, fn: Callable[[], Any], first: float, *,
               clock: Callable[[], float] = time.perf_counter) -> float:
        """Calls ``fn`` until two calls in a row agree within ``SETTLED`` (cuDNN's autotuning
        under ``cudnn.benchmark`` and lazily loaded kernels make the first calls slow)."""
        last, spent = first, first
        for _ in range(SETTLE_CALLS):
            self.synchronize()
            start = clock()
            fn()
            self.synchronize()
            now = clock() - start
            spent += now
            if abs(now - last) <= SETTLED * max(now, last) or spent > SETTLE_SECONDS:
                return now
            last = now
        return last

    @contextlib.contextmanager
    def matmul_as_convolutions(self) -> Iterator[None]:
        """cuBLAS's TF32 switch set to cuDNN's for the block (torch's defaults differ: cuDNN
        rounds fp32 convolutions to TF32, cuBLAS keeps fp32 matmuls fp32)."""
        before = bool(self.matmul.allow_tf32)
        self.matmul.allow_tf32 = bool(self.cudnn.allow_tf32)
        try:
            yield
        finally:
            self.matmul.allow_tf32 = before

    def channel_blocks(self, dtype: torch.dtype | None,
                       isa: machine.CpuIsa | None = None) -> tuple[int, ...]:
        """Tensor cores: channels in multiples of 8 for fp16/bf16; 4 and 8 for fp32 (TF32)."""
        return (8,) if dtype in (torch.float16, torch.bfloat16) else (4, 8)

    def make_current(self) -> None:
        self.cuda.set_device(self.index)

    def release(self) -> None:
        self.cuda.empty_cache()


#: device type -> its implementation (the test suite maps ``cpu`` to a faked CUDA here)
KINDS: dict[str, Callable[[torch.device], Device]] = {
    "cpu": CpuDevice, "meta": CpuDevice, "cuda": CudaDevice}


def seam(device: str | torch.device | None = None) -> Device:
    """The implementation for ``device`` (default: the CPU).

    >>> type(seam("cpu")).__name__
    'CpuDevice'
    >>> seam("mps")
    Traceback (most recent call last):
    ...
    memlayout.errors.MemlayoutError: device 'mps': memlayout runs on cpu and cuda devices; move the model and inputs to one of them
    """
    device = torch.device("cpu" if device is None else device)
    kind = KINDS.get(device.type)
    if kind is None:
        raise MemlayoutError(f"device {device.type!r}: memlayout runs on cpu and cuda devices; "
                             "move the model and inputs to one of them")
    return kind(device)
