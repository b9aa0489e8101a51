"""Run a benchmark: per model x dtype x task, every mode and a GEMM interleaved round by round.

For each case the runner builds every mode (one untimed first call each: compile time), then
hands all of them to :func:`memlayout.timing.interleaved` (the one timer), in rotating order.
The machine's GEMM peak is measured once per dtype per run, by the same timer, before the first
case of that dtype is timed; every record's fraction of peak divides by it. A mode that fails is recorded and the others go on; a mode that runs out of
memory makes the whole case retry at half the batch (all modes at the same batch, so ratios
stay comparable), and the records say so.

>>> from memlayout.bench.config import BenchConfig
>>> cfg = BenchConfig.from_strings(["torchvision:squeezenet1_1"], modes="nchw,nhwc",
...                                batch=1, image_size=32, rounds=2)
>>> result = run_bench(cfg)  # doctest: +SKIP
>>> [(r.mode, r.status) for r in result.records]  # doctest: +SKIP
[('nchw', 'ok'), ('nhwc', 'ok')]
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memlayout import malloc
from memlayout.bench.config import BASELINE, BenchConfig, ModeUnavailable
from memlayout.bench.modes import (
    GemmPeak,
    PreparedMode,
    count_flops,
    gemm_step,
    is_out_of_memory,
    matmul_isa,
    prepare_mode,
)
from memlayout.bench.records import BenchRecord, Environment
from memlayout.devices import seam
from memlayout.models import ModelSpec, load_model
from memlayout.plan.inputs import keyword_call
from memlayout.tensors import iter_tensors
from memlayout.timing import Comparison, interleaved

#: name of the matmul timed for the peak (not a mode: it yields no record of its own)
GEMM = "gemm"
#: the model name of the peak measurement's progress events
PEAK_EVENT_MODEL = "(GEMM peak)"
_MAX_ERROR = 600  # characters of an error message kept in a record (Inductor's run to pages)


@dataclass(frozen=True)
class BenchEvent:
    """Progress: ``phase`` is ``setup`` (building / compiling ``mode``) or ``round`` (about to
    time ``mode`` in round ``round``)."""

    model: str
    dtype: str
    task: str
    mode: str
    phase: str
    round: int | None = None
    batch: int | None = None


@dataclass(frozen=True)
class BenchResult:
    """Everything a run produced: the config, the environment and the flat records."""

    config: BenchConfig
    env: Environment
    records: tuple[BenchRecord, ...]


class _OutOfMemory(Exception):
    def __init__(self, mode: str, message: str) -> None:
        super().__init__(f"{mode}: {message}")
        self.mode = mode


def run_bench(config: BenchConfig, *, on_event: Callable[[BenchEvent], None] | None = None,
              clock: Callable[[], float] = time.perf_counter,
              skip: Collection[tuple[str, str, str]] = (),
              on_case: Callable[[list[BenchRecord]], None] | None = None) -> BenchResult:
    """Run every case of ``config``; never raises for a failing model or mode (they become
    ``error`` / ``unavailable`` records). ``clock`` goes to the timer (tests inject a fake).

    ``skip``: ``(model, dtype, task)`` cases already measured (a resumed run); a model whose
    cases are all skipped is not even loaded. ``on_case(records)`` is called after each case
    with its records, so a caller can save them before the next (long) case starts."""
    emit = on_event or (lambda event: None)
    done = on_case or (lambda records: None)
    skipped = set(skip)
    if config.steady_heap:
        malloc.steady_heap()
    with _threads(config.threads):
        env = Environment.collect(config.device)
        records: list[BenchRecord] = []
        peaks: dict[str, GemmPeak] = {}  # filled by the first timed case of each dtype
        for spec_text in config.models:
            cases = [(d, t) for d in config.dtypes for t in config.tasks
                     if (spec_text, d, t) not in skipped]
            if not cases:
                continue
            spec, load_error = _load(spec_text, config)
            for dtype, task in cases:
                if spec is None:
                    case = _failed_case(env, spec_text, dtype, task, config, "error", load_error)
                else:
                    case = _run_case(config, env, spec, dtype, task, emit, clock, peaks)
                records.extend(case)
                done(case)
            del spec
            _release_memory(config.device)
    return BenchResult(config, env, tuple(records))


def _load(spec_text: str, config: BenchConfig) -> tuple[ModelSpec | None, str]:
    try:
        return load_model(spec_text, batch=config.batch,
                          image_size=config.image_size_for(spec_text)), ""
    except Exception as exc:  # a model that cannot be built is a result of the run
        return None, _describe(exc)


def _run_case(config: BenchConfig, env: Environment, spec: ModelSpec, dtype: str, task: str,
              emit: Callable[[BenchEvent], None], clock: Callable[[], float],
              peaks: dict[str, GemmPeak]) -> list[BenchRecord]:
    batch = config.batch
    notes: list[str] = []
    while True:
        try:
            return _measure(config, env, spec, dtype, task, batch, notes, emit, clock, peaks)
        except _OutOfMemory as oom:
            _release_memory(config.device)
            if not isinstance(spec.example_input, torch.Tensor):
                return _failed_case(env, spec.spec, dtype, task, config, "error",
                                    f"out of memory at the factory's own input, whose batch "
                                    f"memlayout cannot halve ({oom})", notes)
            if batch == 1:
                return _failed_case(env, spec.spec, dtype, task, config, "error",
                                    f"out of memory at batch 1 ({oom})", notes)
            notes.append(f"out of memory at batch {batch} in {oom.mode}; retried at batch {batch // 2}")
            batch //= 2


def case_inputs(spec: ModelSpec, batch: int) -> tuple[nn.Module, tuple[Any, ...]]:
    """The module and positional inputs every mode of a case is timed with: a built input at
    ``batch``, or a factory's own inputs as given (keyword inputs become trailing positional
    ones, ``memlayout.plan.inputs.KeywordCall``, so every mode passes one tuple)."""
    if isinstance(spec.example_input, torch.Tensor):
        return spec.module, (spec.example_input[:batch],)
    args = tuple(spec.example_input) if isinstance(spec.example_input, (tuple, list)) else (
        spec.example_input,)
    return keyword_call(spec.module, args, dict(spec.example_kwargs))


def _measure(config: BenchConfig, env: Environment, spec: ModelSpec, dtype: str, task: str,
             batch: int, notes: list[str], emit: Callable[[BenchEvent], None],
             clock: Callable[[], float], peaks: dict[str, GemmPeak]) -> list[BenchRecord]:
    module, args = case_inputs(spec, batch)
    first = next(iter_tensors(args), None)
    if first is not None and first.dim() > 0:
        batch = first.shape[0]  # a factory's own input has its own batch
    if spec.note:
        notes = [*notes, spec.note]
    common = {"env": env, "model": spec.spec, "dtype": dtype, "task": task, "kind": spec.kind,
              "batch": batch, "requested_batch": config.batch,
              "input_shape": " ".join("x".join(str(s) for s in t.shape)
                                      for t in iter_tensors(args))}
    flops: int | None = None
    try:
        flops = count_flops(module, args, dtype=dtype, task=task, device=config.device)
    except Exception as exc:  # FLOPs are a column, not a reason to skip the case
        if is_out_of_memory(exc):
            raise _OutOfMemory("flop count", _describe(exc)) from exc
        notes = [*notes, f"FLOP count failed: {_describe(exc)}"]
    if any("compile" in m for m in config.modes):
        _reset_dynamo()  # fresh compile caches per case: no recompile limit, honest compile time

    prepared: dict[str, PreparedMode] = {}
    failed: dict[str, tuple[str, str]] = {}
    for mode in config.modes:
        emit(BenchEvent(spec.spec, dtype, task, mode, "setup", batch=batch))
        try:
            prepared[mode] = prepare_mode(mode, module, args, dtype=dtype, task=task,
                                          fmt=spec.fmt, device=config.device,
                                          compile_backend=config.compile_backend,
                                          plan_measure=config.plan_measure)
        except ModeUnavailable as exc:
            failed[mode] = ("unavailable", str(exc))
        except Exception as exc:  # the mode fails on this model: record it, go on
            if is_out_of_memory(exc):
                raise _OutOfMemory(mode, _describe(exc)) from exc
            failed[mode] = ("error", _describe(exc))

    comparison: Comparison | None = None
    if prepared:
        if dtype not in peaks:
            peaks[dtype] = measure_peak(config, dtype, emit, clock)
        fns: dict[str, Callable[[], object]] = {m: p.step for m, p in prepared.items()}
        comparison = interleaved(
            fns, rounds=config.rounds, warmup=config.warmup,
            baseline=BASELINE if BASELINE in fns else next(iter(fns)),
            sync=seam(config.device).synchronize, clock=clock,
            on_step=lambda r, m: emit(BenchEvent(spec.spec, dtype, task, m, "round", r, batch)),
        )
        for name, timing in comparison.modes.items():
            if is_out_of_memory(timing.error_type, timing.error or ""):
                raise _OutOfMemory(name, timing.error or "")

    note = "; ".join(notes)
    records = []
    for mode in config.modes:
        if mode in failed:
            status, error = failed[mode]
            records.append(BenchRecord(**common, mode=mode, status=status, error=error,
                                       flops=flops, note=note))
            continue
        assert comparison is not None
        records.append(_timed_record(common, mode, prepared[mode], comparison, flops,
                                     peaks[dtype], note))
    del prepared, comparison
    _release_memory(config.device)
    return records


def measure_peak(config: BenchConfig, dtype: str, emit: Callable[[BenchEvent], None],
                 clock: Callable[[], float] = time.perf_counter) -> GemmPeak:
    """The GEMM peak in ``dtype``: a square matmul on ``dtype`` tensors (bf16: real bf16
    tensors, so oneDNN's AMX / AVX512-BF16 kernels run) through the one timer, ``config.rounds``
    timed calls after ``config.warmup``; the fastest call's rate. A peak is what the machine can
    do: on shared cores the median call is stretched by whatever else ran then (at load 3 on two
    cores the median fp32 2048 matmul read 70 GFLOP/s, minutes later at load 2 153)."""
    side, isa = config.gemm_side(), matmul_isa(dtype, config.device)
    gemm, flops = gemm_step(side, dtype, config.device)
    timing = interleaved({GEMM: gemm}, rounds=config.rounds, warmup=config.warmup,
                         baseline=GEMM, sync=seam(config.device).synchronize, clock=clock,
                         on_step=lambda r, m: emit(BenchEvent(PEAK_EVENT_MODEL, dtype, "", m,
                                                              "round", r)))[GEMM]
    rate = flops / timing.min if timing.ok and timing.min > 0 else None
    return GemmPeak(dtype, side, rate, len(timing.times), isa, timing.error)


def _timed_record(common: dict, mode: str, prep: PreparedMode, comparison: Comparison,
                  flops: int | None, peak: GemmPeak, note: str) -> BenchRecord:
    t = comparison[mode]
    gemm_rate = peak.flops_per_s
    has_baseline = comparison.baseline == BASELINE
    timed = bool(t.times)
    median = t.median if timed else None
    rate = flops / median if flops and median else None
    iqr = t.iqr if timed else (None, None)
    speed_range = comparison.speedup_range(mode) if has_baseline else None
    return BenchRecord(
        **common, mode=mode, status="ok" if t.ok else "error", error=t.error,
        input_format=prep.input_format, rounds=len(t.times),
        median_s=median, min_s=t.min if timed else None, max_s=t.max if timed else None,
        q1_s=iqr[0], q3_s=iqr[1], spread=t.spread if timed else None,
        speedup=comparison.speedup(mode) if has_baseline else None,
        speedup_min=speed_range[0] if speed_range else None,
        speedup_max=speed_range[1] if speed_range else None,
        round_times_s=t.times,
        round_speedups=comparison.ratios(mode) if has_baseline and comparison[BASELINE].ok else (),
        setup_s=prep.setup_s, first_call_s=prep.first_call_s,
        compile_s=(prep.compile_s if prep.compile_s is not None
                   else prep.first_call_s if "compile" in mode else None),
        flops=flops, flops_per_s=rate, gemm_flops_per_s=gemm_rate, gemm_method=peak.method(),
        peak_fraction=rate / gemm_rate if rate and gemm_rate else None,
        peak_mem_bytes=prep.peak_mem_bytes, note="; ".join(n for n in (prep.note, note) if n),
    )


def _failed_case(env: Environment, model: str, dtype: str, task: str, config: BenchConfig,
                 status: str, error: str, notes: list[str] | None = None) -> list[BenchRecord]:
    return [BenchRecord(env=env, model=model, dtype=dtype, task=task, mode=mode, status=status,
                        error=error, requested_batch=config.batch, note="; ".join(notes or ()))
            for mode in config.modes]


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= _MAX_ERROR else text[:_MAX_ERROR] + " ..."


def _reset_dynamo() -> None:
    dynamo = getattr(torch, "_dynamo", None)
    if dynamo is not None and hasattr(dynamo, "reset"):
        dynamo.reset()


def _release_memory(device: str) -> None:
    gc.collect()
    seam(device).release()


@contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """Run with ``n`` intra-op threads and restore the caller's setting afterwards."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
