"""A recording fake of ``torch.cuda`` and cuDNN's and cuBLAS's settings, for running the
device seam's CUDA implementation (``memlayout.devices.CudaDevice``) on a CPU.

It proves wiring, not speed: every attribute the seam reads must exist on the real torch
module (else ``AttributeError``, as on a GPU), every call must bind to the real function's
signature, and every call is recorded with its arguments. The kernels themselves run on the
CPU, so a CUDA synchronize here has nothing to wait for and the allocator's statistics are
the fake's own counters.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from memlayout import devices


class Recording:
    """A stand-in for ``real`` that answers only what ``answers`` models: a name ``real``
    lacks raises ``AttributeError``; a name it has but the fake does not model fails the test
    (the seam reached for something no test covers); each call is checked against the real
    signature and recorded in ``calls`` as ``(name, args, kwargs)``."""

    def __init__(self, real: Any, answers: dict[str, Any]) -> None:
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_answers", dict(answers))
        object.__setattr__(self, "calls", [])

    def __getattr__(self, name: str) -> Any:
        if not hasattr(self._real, name):
            raise AttributeError(f"{self._real!r} has no attribute {name!r}")
        if name not in self._answers:
            raise AssertionError(f"the fake does not model {name!r}: add it with its real answer")
        answer, real = self._answers[name], getattr(self._real, name)
        if not callable(real):
            self.calls.append((name, (), {}))
            return answer
        signature = inspect.signature(real)

        def call(*args: Any, **kwargs: Any) -> Any:
            signature.bind(*args, **kwargs)  # TypeError where the real one would raise it
            self.calls.append((name, args, kwargs))
            return answer(*args, **kwargs) if callable(answer) else answer
        return call

    def __setattr__(self, name: str, value: Any) -> None:
        if not hasattr(self._real, name):
            raise AttributeError(f"{self._real!r} has no attribute {name!r}")
        self._answers[name] = value

    def called(self, name: str) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        """The arguments of each call of ``name``."""
        return [(args, kwargs) for n, args, kwargs in self.calls if n == name]


class FakeGpu:
    """``cuda``, ``cudnn`` and ``matmul`` fakes with an H100's answers and the settings torch
    defaults to (cuDNN's TF32 on, cuBLAS's off, benchmark off); ``allocated``/``peak``: the
    allocator's counters as the seam reads them."""

    def __init__(self, *, capability: tuple[int, int] = (9, 0)) -> None:
        self.allocated, self.peak = 0, 0
        self.rng_states: list[torch.Tensor] = []
        self.cuda = Recording(torch.cuda, {
            "current_device": 0, "synchronize": None, "set_device": None, "empty_cache": None,
            "get_device_name": "NVIDIA H100 80GB HBM3", "get_device_capability": capability,
            "memory_allocated": lambda *a, **k: self.allocated,
            "max_memory_allocated": lambda *a, **k: self.peak,
            "reset_peak_memory_stats": None, "is_bf16_supported": True,
            "get_rng_state": self._get_rng_state, "set_rng_state": None,
        })
        self.cudnn = Recording(torch.backends.cudnn, {
            "version": 91002, "benchmark": False, "allow_tf32": True, "deterministic": False})
        self.matmul = Recording(torch.backends.cuda.matmul, {"allow_tf32": False})

    def _get_rng_state(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        state = torch.get_rng_state()
        self.rng_states.append(state)
        return state

    def device(self, device: torch.device) -> devices.CudaDevice:
        return devices.CudaDevice(device, cuda=self.cuda, cudnn=self.cudnn, matmul=self.matmul)

    def install(self, monkeypatch: Any) -> FakeGpu:
        """Every CPU device answers as this GPU (``devices.KINDS``) for the test."""
        monkeypatch.setitem(devices.KINDS, "cpu", self.device)
        return self


def fake_gpu(monkeypatch: Any, **kwargs: Any) -> FakeGpu:
    """A :class:`FakeGpu` installed for the test."""
    return FakeGpu(**kwargs).install(monkeypatch)


__all__: list[str] = ["FakeGpu", "Recording", "fake_gpu"]
