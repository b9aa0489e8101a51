"""Ops that took a planning process down (L2 plan): a kernel fault no rule of
``memlayout.plan.costs.faults`` knows yet crashes or hangs the process the first time it runs;
it never does so twice.

Before a layout node is run for its measurement, its channels-last cache key is recorded in
the cost cache as an *attempt* (``["attempt", key]``: this process's id, its start time where
the system tells it, and the host), committed;
when the measurement returns, or raises, the record is deleted. A record left behind by a
process of this host that is gone is an op that crashed it (or hung until it was killed); one
whose process still runs after ``HUNG_AFTER`` seconds is an op that hangs it. Either way the
next plan treats the op as a fault: never run channels-last, kept contiguous, named in the
plan's notes and the backend's report, as the known faults are. The record is keyed like the
op's costs (device, torch version, op, shapes, strides, dtype, training or not), so another
torch or another shape tries again; ``memlayout cache clear`` forgets it.

>>> import tempfile, pathlib
>>> from memlayout.plan.costs.cache import CostCache
>>> cache = CostCache(pathlib.Path(tempfile.mkdtemp()) / "costs.sqlite")
>>> with attempting(cache, '["node", "conv"]'):
...     cache.recorded(attempt_key('["node", "conv"]')) is not None
True
>>> cache.recorded(attempt_key('["node", "conv"]')) is None, crashed(cache, '["node", "conv"]')
(True, None)
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from memlayout.plan.costs.cache import CostCache

#: an attempt whose process still runs this long after it began has hung it: one op's
#: measurement takes seconds
HUNG_AFTER = 600.0


def attempt_key(key: str) -> str:
    """The cache key of an attempt to run the op measured under ``key``."""
    return json.dumps(["attempt", key])


@contextlib.contextmanager
def attempting(cache: CostCache | None, key: str) -> Iterator[None]:
    """Within it, the op of ``key`` is being run: a crash or a hang leaves its record behind."""
    if cache is None:
        yield
        return
    record = attempt_key(key)
    cache.put(record, {"pid": os.getpid(), "start": _start_time(os.getpid()),
                       "host": socket.gethostname()}, is_noisy=False)
    try:
        yield
    finally:
        cache.delete(record)


def crashed(cache: CostCache | None, key: str, *,
            now: datetime.datetime | None = None) -> str | None:
    """Why the op measured under ``key`` must not run (channels-last) again, or ``None``: an
    attempt to run it left behind by a process of this host that is gone, or that has run
    it for ``HUNG_AFTER`` seconds."""
    entry = cache.recorded(attempt_key(key)) if cache is not None else None
    if entry is None or not isinstance(entry.value, dict):
        return None
    pid, host, start = (entry.value.get(k) for k in ("pid", "host", "start"))
    if not isinstance(pid, int) or host != socket.gethostname():
        return None  # another host's process: nothing to tell from here
    since = entry.age(now)
    if _alive(pid, start if isinstance(start, str) else None):
        if pid == os.getpid() or since is None or since < HUNG_AFTER:
            return None  # a process measuring it now
        return (f"it has run channels-last in process {pid} since {entry.taken_at} without "
                "returning (a hang in torch's kernel that no rule of memlayout knows)")
    return (f"it took the planning process {pid} down when run channels-last "
            f"({entry.taken_at}): a crash or hang in torch's kernel that no rule of "
            "memlayout knows; `memlayout cache clear` forgets it")


def _alive(pid: int, start: str | None) -> bool:
    """Whether the process that wrote a record still runs: the process of that id, started
    when the record says (a container's process often has the same id every run)."""
    return _running(pid) if start is None else _start_time(pid) == start


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started, in clock ticks since boot (Linux's ``/proc``), or
    ``None`` where the system does not say or there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after the command's name, which may hold spaces
    return fields[19] if len(fields) > 19 else None


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
