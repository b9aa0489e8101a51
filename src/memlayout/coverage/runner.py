"""Run the matrix: every selected op, each dtype, in worker processes with hard time limits.

A sample that hangs inside a C++ kernel, or an op that crashes the interpreter, must not take
the matrix down: each op runs in a worker process; one that runs past ``op_timeout`` or dies is
replaced and the op recorded as an error with what happened. ``jobs=0`` runs in this process
(no isolation; tests and debugging).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import signal
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memlayout.coverage.check import check_op
from memlayout.coverage.opinfo import describe, load_op_db, op_name, select_ops
from memlayout.coverage.records import CoverageReport, OpRecord, Values, Verdict
from memlayout.dtypes import torch_name
from memlayout.errors import CoverageUnavailableError, LayoutError
from memlayout.layout import Format

#: the tensor dtypes OpInfo samples are drawn in that the matrix covers (torch's own names)
_OPINFO_DTYPES = {"float16", "bfloat16", "float32", "float64", "complex64", "complex128"}


def opinfo_dtype(name: str) -> torch.dtype:
    """The tensor dtype OpInfo samples are made in, by torch's name: ``torch.float64`` from
    ``"float64"`` (or ``"torch.float64"``). Not an autocast dtype (``memlayout.dtypes``): the
    samples themselves are in it.

    >>> opinfo_dtype("bfloat16"), opinfo_dtype("torch.complex64")
    (torch.bfloat16, torch.complex64)
    """
    key = torch_name(str(name).strip())
    if key not in _OPINFO_DTYPES:
        raise LayoutError(f"unknown dtype {name!r} for the coverage matrix; "
                          f"known: {', '.join(sorted(_OPINFO_DTYPES))}")
    return getattr(torch, key)


@dataclass(frozen=True)
class CoverageConfig:
    """What to run. ``fmt`` is CHANNELS_LAST (rank 4) or CHANNELS_LAST_3D (rank 5)."""

    device: str = "cpu"
    dtypes: tuple[str, ...] = ("float32",)
    fmt: Format = Format.CHANNELS_LAST
    ops: str | None = None  # comma-separated globs; None: every op
    max_samples: int = 24
    sample_timeout: float = 20.0  # per sample, inside the worker (Python-level)
    op_timeout: float = 120.0  # per op, hard: the worker is killed
    jobs: int = 1  # worker processes; 0: in this process
    threads: int = 1  # torch threads per worker

    def __post_init__(self) -> None:
        if self.fmt not in (Format.CHANNELS_LAST, Format.CHANNELS_LAST_3D):
            raise LayoutError(f"coverage checks channels_last or channels_last_3d, got "
                              f"{self.fmt.value}; pass --format channels_last or channels_last_3d")
        for d in self.dtypes:
            opinfo_dtype(d)

    @property
    def op_budget(self) -> float:
        """Soft per-op budget inside the worker: stop taking samples after this long."""
        return max(1.0, self.op_timeout / 2)


_Task = tuple[int, str, str, tuple[int, ...]]  # op index, op name, dtype, samples to skip


def _failed(name: str, message: str) -> OpRecord:
    return OpRecord(name=name, forward=Verdict.ERROR, backward=Verdict.ERROR,
                    values=Values.NOT_APPLICABLE, grads=Values.NOT_APPLICABLE, errors=(message,))


def _check(ops: tuple[Any, ...], idx: int, dtype: str, config: CoverageConfig,
           on_step: Any = None, skip: tuple[int, ...] = ()) -> OpRecord:
    return check_op(ops[idx], device=config.device, dtype=opinfo_dtype(dtype), fmt=config.fmt,
                    max_samples=config.max_samples, sample_timeout=config.sample_timeout,
                    op_budget=config.op_budget, on_step=on_step, skip=skip)


def _announce(conn: Any) -> Any:
    last: list[int] = [-1]

    def send(i: int, sample: Any, step: str) -> None:
        if i != last[0]:  # describe each sample once
            conn.send(("sample", i, describe(sample), sample.lifted))
            last[0] = i
        conn.send(("step", step))
    return send


def _worker(conn: Any, config: CoverageConfig) -> None:
    """A worker process: load op_db once, then check ops until told to stop."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(config.threads)
    try:
        ops = load_op_db()
    except CoverageUnavailableError as exc:
        conn.send(("fatal", str(exc)))
        return
    conn.send(("ready",))
    while True:
        task = conn.recv()
        if task is None:
            return
        idx, name, dtype, skip = task
        try:
            if op_name(ops[idx]) != name:  # both processes import the same op_db
                raise RuntimeError(f"op_db order differs between processes at {idx}")
            rec = _check(ops, idx, dtype, config, _announce(conn), skip)
        except Exception as exc:
            rec = _failed(name, f"{type(exc).__name__}: {exc}")
        conn.send(("done", rec.to_dict()))


class _Worker:
    def __init__(self, ctx: Any, config: CoverageConfig) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, config), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.task: _Task | None = None
        self.since = time.monotonic()
        self.sample, self.sample_idx = "", -1  # the sample and run it is in, for a crash report
        self.step = ""

    def send(self, task: _Task) -> None:
        self.task, self.since, self.step = task, time.monotonic(), ""
        self.sample, self.sample_idx = "", -1
        self.conn.send(task)

    def where(self) -> str:
        if not self.sample:
            return "sample set-up"
        return f"{self.sample}, {self.step} run" if self.step else self.sample

    def exit_reason(self) -> str:
        code = self.proc.exitcode
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                return f"signal {signal.Signals(-code).name}"
        return f"exit code {code}"

    def stop(self, kill: bool = False) -> None:
        if not kill and self.proc.is_alive():
            try:
                self.conn.send(None)
                self.proc.join(5)
            except (BrokenPipeError, OSError):
                pass
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


Progress = Callable[[str, OpRecord], None]

_MAX_SKIPS = 3  # samples of one op skipped after they crash or hang its worker


def _with_crashes(rec: OpRecord, crashes: list[str]) -> OpRecord:
    """``rec`` of a rerun that skipped samples which crashed (or hung) earlier workers."""
    if not crashes:
        return rec
    notes = (*rec.notes, f"{len(crashes)} samples crashed or hung the worker; skipped in a rerun")
    forward = Verdict.ERROR if rec.forward is Verdict.NOT_APPLICABLE else rec.forward
    return dataclasses.replace(rec, forward=forward, notes=notes,
                               errors=(*crashes, *rec.errors)[:4],
                               error_samples=rec.error_samples + len(crashes))


def _run_isolated(ops: tuple[Any, ...], tasks: list[_Task], config: CoverageConfig,
                  on_record: Progress | None) -> dict[tuple[str, str], OpRecord]:
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold CUDA
    pending = deque(tasks)
    results: dict[tuple[str, str], OpRecord] = {}
    crashes: dict[tuple[str, str], list[str]] = {}

    def deliver(w: _Worker, rec: OpRecord) -> None:
        assert w.task is not None
        _, name, dtype, _ = w.task
        results[(dtype, name)] = _with_crashes(rec, crashes.pop((dtype, name), []))
        w.task = None
        if on_record is not None:
            on_record(dtype, results[(dtype, name)])

    workers = [_Worker(ctx, config) for _ in range(max(1, min(config.jobs, len(tasks))))]
    startup_limit = 300.0

    try:
        while pending or any(w.task for w in workers):
            for w in workers:
                if w.ready and w.task is None and pending:
                    w.send(pending.popleft())
            ready = multiprocessing.connection.wait([w.conn for w in workers], timeout=1.0)
            now = time.monotonic()
            for i, w in enumerate(workers):
                died = None
                if w.conn in ready:
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):
                        w.proc.join(5)
                        died = (f"worker process died ({w.exit_reason()}) in {w.where()}"
                                f": a crash in torch")
                    else:
                        if msg[0] == "fatal":
                            raise CoverageUnavailableError(msg[1])
                        if msg[0] == "ready":
                            w.ready = True
                        elif msg[0] == "sample":
                            origin = "lifted by memlayout" if msg[3] else "from OpInfo"
                            w.sample, w.step = f"sample {msg[1]} ({origin}: {msg[2]})", ""
                            w.sample_idx = msg[1]
                        elif msg[0] == "step":
                            w.step = msg[1]
                        else:
                            deliver(w, OpRecord.from_dict(msg[1]))
                elif w.task is not None and now - w.since > config.op_timeout:
                    died = f"timed out after {config.op_timeout:g} s in {w.where()} (worker killed)"
                elif not w.ready and now - w.since > startup_limit:
                    raise CoverageUnavailableError(
                        f"a coverage worker did not start within {startup_limit:g} s")
                if died is not None:
                    if w.task is None:
                        raise CoverageUnavailableError(f"a coverage worker failed: {died}")
                    idx, name, dtype, skip = w.task
                    crashes.setdefault((dtype, name), []).append(died)
                    if w.sample_idx >= 0 and len(skip) < _MAX_SKIPS:  # rerun without it
                        pending.appendleft((idx, name, dtype, (*skip, w.sample_idx)))
                        w.task = None
                    else:
                        deliver(w, _failed(name, died))
                    w.stop(kill=True)
                    workers[i] = _Worker(ctx, config)
    finally:
        for w in workers:
            w.stop(kill=bool(w.task))
    return results


def run_coverage(config: CoverageConfig, *, on_start: Callable[[int], None] | None = None,
                 on_record: Progress | None = None, command: str = "") -> list[CoverageReport]:
    """One ``CoverageReport`` per dtype of ``config``. ``on_start(total)`` is called once the
    ops are selected, ``on_record(dtype, record)`` after each op (for a progress bar).

    Raises ``CoverageUnavailableError`` when torch's OpInfo database cannot be imported.
    """
    ops = load_op_db()
    chosen = select_ops(ops, config.ops)
    if not chosen:
        raise LayoutError(f"no OpInfo op matches {config.ops!r}; patterns are comma-separated "
                          f"globs over names such as 'nn.functional.conv2d' or '*pad*'")
    tasks: list[_Task] = [(i, op_name(ops[i]), d, ()) for d in config.dtypes for i in chosen]
    if on_start is not None:
        on_start(len(tasks))
    start = time.perf_counter()
    last: dict[str, float] = {}  # dtypes run one after the other: wall time of each

    def record(dtype: str, rec: OpRecord) -> None:
        last[dtype] = time.perf_counter()
        if on_record is not None:
            on_record(dtype, rec)

    if config.jobs <= 0:
        results = {}
        for i, name, d, _ in tasks:
            results[(d, name)] = _check(ops, i, d, config)
            record(d, results[(d, name)])
    else:
        results = _run_isolated(ops, tasks, config, record)
    reports, previous = [], start
    for d in config.dtypes:
        recs = tuple(results[(d, n)] for _, n, dd, _ in tasks if dd == d)
        reports.append(CoverageReport(
            torch_version=torch.__version__, device=config.device, dtype=d,
            fmt=config.fmt.value, ops=recs, seconds=round(last.get(d, previous) - previous, 1),
            command=command, max_samples=config.max_samples))
        previous = last.get(d, previous)
    return reports
