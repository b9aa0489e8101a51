"""CPUs a test can state it assumes: what the planner reads as the instruction set is one value,
``memlayout.machine.cpu_isa()``; a test whose checks depend on it says which CPU it means."""

from __future__ import annotations

import pytest

from memlayout import machine
from memlayout.machine import CpuIsa

#: an AVX-512 Xeon without AMX: ATen dispatches to AVX512, oneDNN has avx512f but no bf16 units
AVX512 = CpuIsa("AVX512", frozenset({"avx2", "avx512f"}))
#: an AVX2-only CPU (an AMD EPYC before Zen 4): ATen dispatches to AVX2, bf16 is emulated
AVX2 = CpuIsa("AVX2", frozenset({"avx2"}))


def as_cpu(monkeypatch: pytest.MonkeyPatch, isa: CpuIsa) -> None:
    """The code under test sees ``isa`` as this machine's instruction set."""
    monkeypatch.setattr(machine, "cpu_isa", lambda: isa)


def openvino_has_bf16() -> bool:
    """Whether OpenVINO's CPU plugin computes in bf16 on this CPU (AVX512-BF16 or AMX): its
    own word, ``OPTIMIZATION_CAPABILITIES``; elsewhere it grants f32 where bf16 is asked."""
    import openvino as ov

    return "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
