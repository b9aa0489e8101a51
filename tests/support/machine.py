"""CPUs a test can state it assumes: what the planner reads as the instruction set is one value,
``memlayout.machine.cpu_isa()``; a test whose checks depend on it says which CPU it means."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import memlayout.plan.check.guard as guard
from memlayout import machine, timing
from memlayout.machine import Conditions, CpuIsa
from memlayout.plan.compilers import backend_race

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


def fake_guard_clock(monkeypatch: pytest.MonkeyPatch, seconds_of: Callable[[str, int], float]) -> None:
    """The ``i``-th call of the guard's candidate ``name`` (a whole model, or one of the
    backend's ways to run a graph, timed before the backend returns or on the graph's own
    calls) takes ``seconds_of(name, i)`` on a fake clock."""
    now, calls = [0.0], {}

    def advanced(name, fn):
        fn = getattr(fn, "unclocked", fn)  # a way a first race kept, raced again: timed once

        def call(*args):
            i = calls[name] = calls.get(name, -1) + 1
            now[0] += seconds_of(name, i)
            return fn(*args)
        call.unclocked = fn
        return call

    real_race = backend_race.CallRace.__init__

    def racing(self, fns, **kwargs):
        real_race(self, {n: advanced(n, f) for n, f in fns.items()}, **kwargs)

    monkeypatch.setattr(backend_race.CallRace, "__init__", racing)
    monkeypatch.setattr(backend_race, "clock", lambda: now[0])

    def fake_interleaved(fns, **kwargs):
        return timing.interleaved({n: advanced(n, f) for n, f in fns.items()},
                                  clock=lambda: now[0], **kwargs)

    monkeypatch.setattr(guard, "interleaved", fake_interleaved)
    # the clock is fake: the cost table's prediction (real timings) cannot agree with it
    monkeypatch.setattr(guard, "SUSPECT", float("inf"))
    fake_load(monkeypatch, load=0.0)  # the clock is fake: so is the machine's load


def fake_load(monkeypatch: pytest.MonkeyPatch, *, load: float) -> None:
    """``Conditions.now()`` reports ``load`` on 2 CPUs (busy above 2)."""
    monkeypatch.setattr(Conditions, "now",
                        classmethod(lambda cls: cls(load, 2, 1, "PASSIVE", "now")))
