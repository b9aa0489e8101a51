"""``memlayout.malloc``: the steady heap stops the page-fault churn of large CPU tensors.

Counted, not timed: minor page faults (``getrusage``) of writing a fresh 64 MiB tensor, sixteen
times over, in a child process (the heap setting lasts for the rest of a process). The heap
needs a few steps to settle (a small allocation lands in the freed hole, so the next block
extends the heap; seen here: 2-6 blocks), so the steady state is read from the last four.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from memlayout import malloc

CHILD = """
import json, resource, sys, torch
from memlayout import malloc
steady = malloc.steady_heap() if sys.argv[1] == "steady" else None
faults = []
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(64 * 2**20, dtype=torch.uint8)
    t.fill_(1)  # touch every page
    del t
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"steady": steady, "faults": faults, "describe": malloc.describe()}))
"""

glibc = pytest.mark.skipif(malloc._libc() is None or bool(malloc.preloaded()),
                           reason="glibc's mallopt is what is tested")


def _child(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUN"))}
    env.pop("LD_PRELOAD", None)
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                         check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_steady_heap_stops_refaulting_a_freed_block():
    pages = 64 * 2**20 // os.sysconf("SC_PAGE_SIZE")
    default, steady = _child("default"), _child("steady")
    # glibc's default: each fresh 64 MiB block is a new mmap, every page faults again
    assert all(f >= 0.9 * pages for f in default["faults"]), default
    assert default["describe"] == "glibc (default)"
    # steady heap: the first block grows the heap, once settled the block is reused
    assert steady["steady"] is True and steady["faults"][0] >= 0.9 * pages
    assert all(f < 0.01 * pages for f in steady["faults"][-4:]), steady
    assert sum(steady["faults"]) < 0.5 * sum(default["faults"])
    assert steady["describe"].startswith("glibc, steady heap")


def test_describe_names_a_preloaded_allocator(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert malloc.preloaded() == "libjemalloc.so.2"
    assert malloc.describe() == "LD_PRELOAD libjemalloc.so.2"
    assert malloc.steady_heap() is False  # another allocator's business: nothing changed
