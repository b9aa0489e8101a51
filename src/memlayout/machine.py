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

import datetime
import functools
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

#: the relative spread of a measurement's rounds, (max - min) / median, above which it is
#: noisy: quiet runs on this project's 2-core machine stay well under it, runs beside another
#: job reach 1-18 (8.5 and 18.5 seen in one comparison)
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

    @property
    def busy(self) -> bool:
        """More runnable jobs than cores: timings are not to be trusted beyond their direction."""
        return (self.load_average is not None and self.cpu_count is not None
                and self.load_average > self.cpu_count)

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


def noisy(spread: float | None) -> bool:
    """A measurement whose rounds spread more than ``SPREAD_LIMIT`` (relative to the median).

    >>> noisy(0.05), noisy(8.5), noisy(None)
    (False, True, False)
    """
    return spread is not None and spread > SPREAD_LIMIT


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


def fingerprint(device: str = "cpu") -> str:
    """What a cached measurement is only valid for: device model, threads, torch version,
    OpenMP wait policy.

    >>> fingerprint().count("|")
    3
    """
    if device.startswith("cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = cpu_model()
    return (f"{name}|threads={torch.get_num_threads()}|torch={torch.__version__}"
            f"|omp={os.environ.get('OMP_WAIT_POLICY', '') or 'default'}")
