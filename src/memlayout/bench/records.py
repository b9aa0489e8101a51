"""Benchmark results as plain data: one flat record per model x dtype x task x mode.

>>> env = Environment.collect("cpu", threads=2)
>>> r = BenchRecord(env=env, model="torchvision:resnet18", dtype="fp32", task="infer",
...                 mode="planned", status="unavailable", error="no planner")
>>> flat = r.to_flat()
>>> flat["model"], flat["status"], flat["threads"], flat["speedup"]
('torchvision:resnet18', 'unavailable', 2, None)
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import torch

from memlayout import malloc
from memlayout.devices import seam
from memlayout.machine import Conditions

STATUSES = ("ok", "error", "unavailable")


@dataclass(frozen=True)
class Environment:
    """Versions and machine, repeated in every flat record so each row stands alone."""

    device: str
    device_name: str
    threads: int
    torch: str
    torchvision: str
    memlayout: str
    python: str
    platform: str
    timestamp: str  # UTC, to the millisecond: two runs within one second stay two (--resume)
    #: 1-minute load average and CPU count when the run started (``None`` where unknown):
    #: with more runnable jobs than cores every timing is stretched and noisy
    load_average: float | None = None
    cpu_count: int | None = None
    #: OpenMP's wait policy (``OMP_WAIT_POLICY``; empty: the runtime's default, spinning)
    omp_wait_policy: str = ""
    #: the host allocator (``memlayout.malloc.describe``): glibc's default refaults every large
    #: block each step, a steady heap or jemalloc/tcmalloc do not
    malloc: str = ""

    @classmethod
    def collect(cls, device: str, threads: int | None = None) -> Environment:
        now = Conditions.now()
        return cls(
            device=device,
            device_name=seam(device).name(),
            threads=threads if threads is not None else torch.get_num_threads(),
            torch=torch.__version__,
            torchvision=_version("torchvision"),
            memlayout=_version("memlayout"),
            python=platform.python_version(),
            platform=platform.platform(),
            timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
            load_average=now.load_average,
            cpu_count=now.cpu_count,
            omp_wait_policy=now.omp_wait_policy,
            malloc=malloc.describe(),
        )

    @property
    def overloaded(self) -> bool:
        """More runnable jobs than cores when the run started: timings are not to be trusted
        beyond their direction."""
        return Conditions(self.load_average, self.cpu_count, self.threads,
                          self.omp_wait_policy).busy


@dataclass(frozen=True)
class BenchRecord:
    """One model x dtype x task x mode. Times are seconds per step; ``speedup`` is the median of
    the per-round ratios NCHW time / mode time from the same interleaved rounds (> 1: faster)."""

    env: Environment
    model: str
    dtype: str
    task: str
    mode: str
    status: str
    error: str | None = None
    kind: str = ""
    batch: int | None = None
    requested_batch: int | None = None
    input_shape: str = ""
    input_format: str = ""
    rounds: int = 0
    median_s: float | None = None
    min_s: float | None = None
    max_s: float | None = None
    q1_s: float | None = None
    q3_s: float | None = None
    spread: float | None = None
    speedup: float | None = None
    speedup_min: float | None = None
    speedup_max: float | None = None
    round_times_s: tuple[float, ...] = ()
    round_speedups: tuple[float, ...] = ()
    setup_s: float | None = None
    first_call_s: float | None = None
    compile_s: float | None = None
    flops: int | None = None
    flops_per_s: float | None = None
    gemm_flops_per_s: float | None = None
    #: how ``gemm_flops_per_s`` was measured (size, dtype, once per run, the CPU's instructions)
    gemm_method: str = ""
    peak_fraction: float | None = None
    peak_mem_bytes: int | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    def to_flat(self) -> dict[str, Any]:
        """One flat dict: the record's fields, then the environment's (no nesting)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "env"}
        out["round_times_s"] = list(self.round_times_s)
        out["round_speedups"] = list(self.round_speedups)
        out.update(dataclasses.asdict(self.env))
        return out


FLAT_FIELDS: tuple[str, ...] = tuple(
    [f.name for f in dataclasses.fields(BenchRecord) if f.name != "env"]
    + [f.name for f in dataclasses.fields(Environment)]
)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"
