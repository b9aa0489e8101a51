"""The host allocator under CPU tensors (L1): glibc's page-fault churn, and how to stop it.

PyTorch has no caching allocator on the CPU: every activation, autocast weight copy and layout
conversion is a ``malloc``/``free``. glibc serves blocks above its mmap threshold (128 KiB,
raised on the fly up to 32 MiB) with fresh ``mmap``s and unmaps them on ``free``, so the next
step faults every page in again, zeroed by the kernel: an alexnet bf16 forward (autocast
copies its fp32 weights to bf16 on every call) faults in about its weights' size per call,
every call. The threshold also moves while a process runs, so one model can run at two speeds
a round apart. Timings and fault counts with and without: ``benchmarks/malloc.py``
(``docs/benchmarks.md``).

``steady_heap()`` asks glibc (``mallopt``) to serve every block from the heap and never give
freed memory back: after a few steps (the heap settles; a small allocation can take a freed
hole, so the heap grows by a few blocks first) nothing faults. The cost: the process keeps its
peak heap (``benchmarks/malloc.py`` prints the peak resident memory under each). jemalloc or tcmalloc
under ``LD_PRELOAD`` do the same job where installed; ``describe()`` says which allocator a
run had, for the records.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
_TRIM_NEVER = 2**31 - 1  # mallopt takes an int: trim only a free top of 2 GiB or more
_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")
_state = {"steady": False}


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    # find_library runs ldconfig in a subprocess: once per process, not per record
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None


def preloaded() -> str:
    """The allocator library in ``LD_PRELOAD`` (jemalloc, tcmalloc, mimalloc), or ``""``."""
    for path in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        base = os.path.basename(path)
        if any(name in base for name in ("jemalloc", "tcmalloc", "mimalloc")):
            return base
    return ""


def steady_heap() -> bool:
    """Serve every allocation from glibc's heap and never return freed memory to the OS
    (``mallopt(M_MMAP_MAX, 0)``, ``mallopt(M_TRIM_THRESHOLD, huge)``), for the rest of the
    process. Returns ``False`` (and changes nothing) where the C library is not glibc or
    another allocator is preloaded."""
    if preloaded():
        return False
    libc = _libc()
    if libc is None:
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = libc.mallopt(M_MMAP_MAX, 0) == 1
    ok = libc.mallopt(M_TRIM_THRESHOLD, _TRIM_NEVER) == 1 and ok
    _state["steady"] = _state["steady"] or ok
    return ok


def describe() -> str:
    """The allocator this process runs on, in a few words (kept in benchmark records)."""
    lib = preloaded()
    if lib:
        return f"LD_PRELOAD {lib}"
    if _libc() is None:
        return "system malloc (not glibc)"
    if _state["steady"]:
        return "glibc, steady heap (memlayout.malloc.steady_heap)"
    env = [f"{k}={os.environ[k]}" for k in _ENV if k in os.environ]
    return f"glibc ({', '.join(env)})" if env else "glibc (default)"
