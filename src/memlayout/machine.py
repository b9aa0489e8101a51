"""The conditions a measurement is taken under (L1): load against cores, threads, OpenMP's
wait policy, the CPU's instruction sets, and a fingerprint of the machine and software that a
cached number belongs to.

A number measured while more jobs were runnable than there are cores is stretched and noisy;
spinning OpenMP threads (the runtime's default wait policy) make it worse. Every verb that
times something states the conditions up front, and every cached measurement stores them.

>>> c = Conditions(load_average=5.0, cpu_count=2, threads=2, omp_wait_policy="")
>>> c.busy
True
>>> print(c.warning())
load average 5.0 on 2 CPUs: other jobs compete for the cores, so timings will be stretched and noisy. OpenMP threads spin while waiting (OMP_WAIT_POLICY unset): multi-threaded runs suffer most; OMP_WAIT_POLICY=PASSIVE or --threads 1 limits the damage.
>>> Conditions(load_average=0.4, cpu_count=2, threads=2, omp_wait_policy="PASSIVE").warning() is None
True
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

#: the relative spread of a measurement's rounds, (max - min) / median, above which it is
#: noisy: quiet runs stay well under it, runs beside another job on a small machine reach
#: spreads of 1 or more (docs/benchmarks.md)
SPREAD_LIMIT = 0.3


@dataclass(frozen=True)
class Conditions:
    """What the machine was doing when a number was measured."""

    load_average: float | None  # 1-minute load average (``None`` where unknown)
    cpu_count: int | None
    threads: int  # torch's intra-op threads
    omp_wait_policy: str  # ``OMP_WAIT_POLICY``; empty: the runtime's default (spinning)
    taken_at: str = field(default="", compare=False)  # UTC, ISO 8601

    @classmethod
    def now(cls) -> Conditions:
        """The conditions at this moment."""
        try:
            load: float | None = round(os.getloadavg()[0], 2)
        except (AttributeError, OSError):  # not on every platform
            load = None
        return cls(load, os.cpu_count(), torch.get_num_threads(),
                   os.environ.get("OMP_WAIT_POLICY", ""),
                   datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))

    def less_own(self, cores: float) -> Conditions:
        """These conditions with ``cores`` (this process's own use of the CPU over what was
        measured, in cores) taken out of the load average: the load of other jobs.

        >>> Conditions(2.8, 2, 2, "").less_own(1.9).busy, Conditions(2.8, 2, 2, "").busy
        (False, True)
        """
        if self.load_average is None:
            return self
        return dataclasses.replace(self,
                                   load_average=round(max(0.0, self.load_average - cores), 2))

    @property
    def busy(self) -> bool:
        """More runnable jobs than cores: timings are not to be trusted beyond their direction."""
        return overloaded(self.load_average, self.cpu_count)

    @property
    def spinning(self) -> bool:
        """OpenMP threads spin while they wait (no ``OMP_WAIT_POLICY=PASSIVE``)."""
        return self.omp_wait_policy.upper() != "PASSIVE"

    def warning(self) -> str | None:
        """One sentence for the top of a verb's output when the machine is busy, else ``None``."""
        if not self.busy:
            return None
        text = (f"load average {self.load_average:.1f} on {self.cpu_count} CPUs: other jobs "
                "compete for the cores, so timings will be stretched and noisy.")
        if self.spinning and self.threads > 1:
            text += (f" OpenMP threads spin while waiting (OMP_WAIT_POLICY "
                     f"{self.omp_wait_policy or 'unset'}): multi-threaded runs suffer most; "
                     "OMP_WAIT_POLICY=PASSIVE or --threads 1 limits the damage.")
        return text

    def describe(self) -> str:
        """One line: load, cores, threads, wait policy."""
        load = "unknown" if self.load_average is None else f"{self.load_average:.1f}"
        return (f"load {load} on {self.cpu_count or '?'} CPUs, {self.threads} threads, "
                f"OMP_WAIT_POLICY={self.omp_wait_policy or 'unset'}")


def busier(before: Conditions, after: Conditions) -> Conditions:
    """The busier of the conditions before and after a measurement (``after`` when both or
    neither are busy): load at either end stretches the numbers taken between.

    >>> quiet = Conditions(load_average=0.5, cpu_count=2, threads=1, omp_wait_policy="")
    >>> loaded = Conditions(load_average=5.0, cpu_count=2, threads=1, omp_wait_policy="")
    >>> busier(loaded, quiet) is loaded, busier(quiet, loaded) is loaded
    (True, True)
    """
    return after if after.busy or not before.busy else before


def overloaded(load_average: float | None, cpu_count: int | None) -> bool:
    """A load average above the core count (either unknown: not overloaded).

    >>> overloaded(2.5, 2), overloaded(1.5, 2), overloaded(None, 2)
    (True, False, False)
    """
    return load_average is not None and cpu_count is not None and load_average > cpu_count


def noisy(spread: float | None) -> bool:
    """A measurement whose rounds spread more than ``SPREAD_LIMIT`` (relative to the median).

    >>> noisy(0.05), noisy(8.5), noisy(None)
    (False, True, False)
    """
    return spread is not None and spread > SPREAD_LIMIT


#: a bf16 matmul at less than this fraction of the fp32 rate has no bf16 instructions behind
#: it (converted to fp32 and back around each kernel): 0.07-0.3x measured on an AVX2-only CPU,
#: above 1x where AVX512-BF16 or AMX run it
EMULATED_BELOW = 0.8
#: side of the square matmuls compared (seconds in all on an AVX2-only CPU)
BF16_SIDE = 256


@dataclass(frozen=True)
class Bf16Speed:
    """How fast bf16 matrix multiplication runs here against fp32, as measured."""

    relative: float  # the bf16 matmul's rate / the fp32 one's (> 1: bf16 is faster)
    device: str
    side: int = BF16_SIDE

    @property
    def emulated(self) -> bool:
        """No bf16 arithmetic behind bf16 here: it runs slower than fp32.

        >>> Bf16Speed(0.3, "cpu").emulated, Bf16Speed(2.1, "cpu").emulated
        (True, False)
        """
        return self.relative < EMULATED_BELOW

    def describe(self) -> str:
        """One phrase with the measured rate.

        >>> Bf16Speed(0.29, "cpu").describe()
        'bf16 is emulated on this cpu: a 256x256 bf16 matmul runs at 0.29x the fp32 rate (measured now)'
        """
        what = "emulated" if self.emulated else "native"
        return (f"bf16 is {what} on this {self.device}: a {self.side}x{self.side} bf16 matmul "
                f"runs at {self.relative:.2g}x the fp32 rate (measured now)")


@functools.cache
def bf16_speed() -> Bf16Speed:
    """The bf16 matmul rate against fp32 on this CPU, measured once per process (a few
    interleaved rounds of one matmul each, by the one timer), never guessed from the CPU's
    name: what torch's kernels do with bf16 here is what counts. (A GPU's verdict is the
    device seam's: ``memlayout.devices.seam(device).bf16()``; a matmul this small is
    launch-bound there.)"""
    from memlayout.timing import interleaved  # the timer's records carry Conditions

    gen = torch.Generator().manual_seed(0)
    a32, b32 = (torch.randn(BF16_SIDE, BF16_SIDE, generator=gen) for _ in range(2))
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    out32, out16 = torch.empty_like(a32), torch.empty_like(a16)
    c = interleaved({"fp32": lambda: torch.mm(a32, b32, out=out32),
                     "bf16": lambda: torch.mm(a16, b16, out=out16)},
                    rounds=5, warmup=1)
    return Bf16Speed(c["fp32"].median / c["bf16"].median, "cpu")


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or sys.platform


@dataclass(frozen=True)
class CpuIsa:
    """The CPU's instruction sets as memlayout sees them.

    ``capability``: what ATen's vectorized CPU kernels dispatch to
    (``torch.backends.cpu.get_cpu_capability()``: ``"AVX512"``, ``"AVX2"``, ``"DEFAULT"``, ...),
    which ``ATEN_CPU_CAPABILITY=avx2`` lowers on an AVX-512 CPU. ``flags``: the CPU's feature
    flags (``/proc/cpuinfo``), what oneDNN's AMX and AVX512-BF16 kernels depend on; no
    environment variable hides them.

    >>> isa = CpuIsa("AVX2", frozenset({"avx2", "fma"}))
    >>> isa.vector_floats, "avx512f" in isa.flags
    (8, False)
    >>> CpuIsa("AVX512").vector_floats, CpuIsa("DEFAULT").vector_floats
    (16, 4)
    """

    capability: str
    flags: frozenset[str] = frozenset()

    @property
    def vector_floats(self) -> int:
        """fp32 lanes of ATen's vector width: 16 (AVX-512), 8 (AVX2), else 4."""
        if "AVX512" in self.capability:
            return 16
        return 8 if "AVX2" in self.capability else 4


@functools.lru_cache(maxsize=1)
def cpu_isa() -> CpuIsa:
    """This process's :class:`CpuIsa`: the one place memlayout reads the instruction set.
    Code that depends on it takes a ``CpuIsa`` (``None``: this one), so tests state the CPU
    they assume instead of inheriting the machine's."""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):  # a build without it
        capability = "DEFAULT"
    flags: frozenset[str] = frozenset()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("flags"):
                flags = frozenset(line.split(":", 1)[1].split())
                break
    return CpuIsa(capability, flags)


def fingerprint() -> str:
    """What a cached measurement of this host is only valid for: CPU model, threads, torch
    version, OpenMP wait policy and the instruction set ATen's kernels dispatch to (a timing
    taken with AVX-512 kernels says nothing of AVX2's). A measurement on a GPU is keyed by
    the device seam's fingerprint as well (``memlayout.devices``).

    >>> fingerprint().count("|")
    4
    """
    return (f"{cpu_model()}|threads={torch.get_num_threads()}|torch={torch.__version__}"
            f"|omp={os.environ.get('OMP_WAIT_POLICY', '') or 'default'}|isa={cpu_isa().capability}")
