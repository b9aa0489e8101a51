"""The five layout strategies as ready-to-time callables, plus FLOP counting and the GEMM peak.

Each mode gets its own deep copy of the model (conversion and SGD steps are in place), its own
input in its own layout, and one untimed first call whose duration is kept: for ``compile``
modes that call is the compilation (reported as compile time, never mixed into the rounds).

- ``nchw``: eager, contiguous model and input (the baseline).
- ``nhwc``: eager, the PyTorch tutorial's recipe ``model.to(memory_format=channels_last)`` and
  ``x.contiguous(memory_format=channels_last)`` (``channels_last_3d`` for video), converted once
  outside the timed region.
- ``nhwc-again``: a second copy prepared exactly as ``nhwc``, an A/A control (``CONTROL``).
- ``planned``: ``memlayout.optimize(model, (x,), dtype=..., measure=..., input_format="auto")``
  on the NCHW model (task ``train``: ``train=True``, planned and verified for a training step);
  the plan chooses the format its input arrives in (its conversion costed like any other) and
  the input is converted to it once outside the timed region, as ``nhwc``'s is: each eager
  mode gets its input in its own format, none converts it per call. Planning time (cost
  measurements included, unless cached) is ``setup_s``.
- ``compile``: ``torch.compile`` (default mode; Inductor picks layouts) on the NCHW model.
- ``planned+compile``: ``memlayout.compile`` (inference: the fastest verified of the plan
  compiled so it stands, Inductor's own layout and, on the CPU, the peer runtimes installed;
  Inductor's unless another measures >2 % faster), its input in the format the kept candidate
  reads (``prepare_inputs``, once); training: ``torch.compile`` of the planned model, NCHW
  input as ``compile``'s.
- ``compile-memlayout``: ``torch.compile(model, backend=memlayout.backend(measure=...))`` on the
  NCHW model, NCHW input as ``compile``'s: each graph Dynamo hands over planned from measured
  costs (task ``train``: forward and backward) and compiled by Inductor with the plan
  standing, or run eagerly with its plan where that measured faster; with
  ``--compile-backend eager`` the planned graphs run eagerly. The note is the backend's
  report: graphs, how each ran, the convolutions whose format differs from Inductor's rule.
- ``openvino``, ``onnxruntime``: the model converted for a peer runtime
  (``memlayout.runtimes``), inference on the CPU only, NCHW input. Their bf16 is the runtime's
  own (OpenVINO's ``INFERENCE_PRECISION_HINT=bf16``), not autocast; ONNX Runtime has no bf16
  convolution on the CPU and is ``unavailable`` there. Conversion and compilation time is the
  record's ``compile_s``. Their first output is checked against eager NCHW in the same dtype
  (``memlayout.plan.compare`` tolerances): a runtime that computes something else is an error,
  never a timing.

Dtype ``bf16`` runs under ``torch.autocast(device, bfloat16)`` (what users do: weights stay
fp32, matmuls and convolutions run in bf16); the backward pass runs outside autocast as the
PyTorch AMP recipe says. Task ``train`` is forward + backward + ``SGD.step``, with the loss
``memlayout.tensors.mean_square_loss``: ``sum(0.5 * mean(y ** 2))`` over every floating output
tensor that requires grad (any model, and stable for the few steps a benchmark takes).

>>> import torch
>>> from torch import nn
>>> m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
>>> p = prepare_mode("nhwc", m, torch.randn(2, 3, 8, 8), dtype="fp32", task="infer")
>>> p.input_format, tuple(p.step().shape)
('channels_last', (2, 4, 6, 6))
>>> count_flops(m, torch.randn(2, 3, 8, 8), dtype="fp32", task="infer") == 2 * (2 * 4 * 6 * 6) * 27
True
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from memlayout import machine, runtimes
from memlayout.bench.config import BACKEND_MODE, CONTROL, DTYPES, RUNTIME_MODES, ModeUnavailable
from memlayout.devices import seam
from memlayout.dtypes import Compared, autocast, parse_dtype, tolerance
from memlayout.errors import MemlayoutError
from memlayout.layout import Format
from memlayout.machine import CpuIsa
from memlayout.plan.compare import compare as compare_outputs
from memlayout.plan.compilers.backend_report import BackendReport
from memlayout.plan.compilers.backend_report import backend_report as report_backend
from memlayout.plan.compilers.compiled import compile as plan_and_compile
from memlayout.plan.costs.faults import module_faults
from memlayout.plan.inputs import example_inputs_of
from memlayout.plan.pipeline import optimize
from memlayout.plan.runners import Runner
from memlayout.plan.steer.steering import prepare_inputs
from memlayout.tensors import (
    convert_batch,
    format_name,
    format_of,
    iter_tensors,
    mean_square_loss,
    torch_memory_format,
)

LEARNING_RATE = 1e-3

#: what counts as "out of memory" by type: CUDA's and Python's.
OUT_OF_MEMORY: tuple[type[BaseException], ...] = (
    getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),
    MemoryError,
)
#: c10's CPU allocator has no exception type of its own: it raises a plain RuntimeError
#: ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate
#: memory: ..."), so CPU out of memory is the one case recognised by its message.
_CPU_OUT_OF_MEMORY = "DefaultCPUAllocator: can't allocate memory"


def is_out_of_memory(exc: BaseException | type[BaseException] | None, message: str = "") -> bool:
    """Whether an exception (or its type plus message, as the timer records them) is an
    allocation failure: CUDA's ``OutOfMemoryError``, ``MemoryError``, or the CPU allocator's.

    >>> is_out_of_memory(MemoryError()), is_out_of_memory(RuntimeError("shape mismatch"))
    (True, False)
    >>> is_out_of_memory(RuntimeError, "DefaultCPUAllocator: can't allocate memory: you tried")
    True
    """
    if exc is None:
        return False
    kind = exc if isinstance(exc, type) else type(exc)
    text = message if isinstance(exc, type) else str(exc)
    if issubclass(kind, OUT_OF_MEMORY):
        return True
    return issubclass(kind, RuntimeError) and _CPU_OUT_OF_MEMORY in text


@dataclass
class PreparedMode:
    """A mode ready to time: ``step()`` runs one inference or one training step."""

    name: str
    step: Callable[[], object]
    setup_s: float
    first_call_s: float
    input_format: str
    peak_mem_bytes: int | None = None
    note: str = ""
    #: the mode's own copy of the model (converted, planned and/or compiled)
    module: nn.Module | None = None
    #: conversion + compilation seconds where they happen before the first call (runtimes);
    #: ``None``: a compiled mode's first call is its compile time
    compile_s: float | None = None


class OutputMismatch(MemlayoutError):
    """A mode whose output differs from eager NCHW's beyond the dtype's tolerance."""


def _autocast_dtype(dtype: str) -> torch.dtype | None:
    """The autocast dtype of a benchmark dtype (``None`` for fp32), by ``memlayout.dtypes``."""
    return parse_dtype(dtype, allowed=DTYPES)


def _train_loss(out: Any) -> torch.Tensor:
    """``mean_square_loss`` of a model's output, or a ``TypeError`` when it has nothing to
    train on (a bench case records it as the mode's error)."""
    loss = mean_square_loss(out)
    if loss is None:
        raise TypeError(f"model output {type(out).__name__} holds no floating tensor that "
                        "requires grad to train on")
    return loss


def _on(inputs: torch.Tensor | tuple[Any, ...], device: str) -> tuple[Any, ...]:
    """A model's positional inputs (one tensor, or a tuple: keyword inputs made trailing
    positional ones by ``memlayout.plan.inputs.keyword_call``), copied onto ``device``."""
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a
                 for a in example_inputs_of(inputs))


def _step_fn(model: nn.Module, args: tuple[Any, ...], dtype: str, task: str,
             device: str) -> Callable[[], object]:
    run_dtype = _autocast_dtype(dtype)
    if task == "infer":
        def infer() -> object:
            with torch.no_grad(), autocast(device, run_dtype):
                return model(*args)
        return infer

    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                lr=LEARNING_RATE)

    def train() -> object:
        optimizer.zero_grad(set_to_none=True)
        with autocast(device, run_dtype):
            out = model(*args)
        loss = _train_loss(out)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return train


def _refuse_faults(mode: str, module: nn.Module, device: str) -> None:
    """``ModeUnavailable`` where training ``module`` channels-last would run a kernel's known
    fault (``memlayout.plan.costs.faults``)."""
    faults = module_faults(module, device=torch.device(device))
    if faults:
        raise ModeUnavailable(f"{mode} is not run in training: it would run {', '.join(faults)} "
                              f"channels-last, and {next(iter(faults.values()))}")


def prepare_mode(mode: str, module: nn.Module, inputs: torch.Tensor | tuple[Any, ...], *,
                 dtype: str, task: str, fmt: Format = Format.CHANNELS_LAST, device: str = "cpu",
                 compile_backend: str = "inductor", plan_measure: bool = True) -> PreparedMode:
    """Copy ``module``, apply ``mode``, make one untimed first call and return the timed step.
    ``inputs``: one tensor or a tuple of ``forward``'s positional inputs.

    An exception is the mode failing on this model, for the caller to record.
    """
    args = _on(inputs, device)
    if mode in RUNTIME_MODES:
        return _prepare_runtime(mode, module, args, dtype=dtype, task=task, device=device)
    bf16 = seam(device).bf16() if "compile" in mode and dtype == "bf16" else None
    if bf16 is not None and bf16.emulated:
        # resnet50's planned+compile build ran past 20 minutes on an AVX2-only CPU
        raise ModeUnavailable(f"{mode} is not built in bf16 here: "
                              f"{bf16.describe()}, and Inductor's bf16 "
                              "build on such a CPU runs for many minutes to time what no CPU "
                              "with bf16 instructions would do")
    if mode in ("nhwc", CONTROL) and task == "train":
        _refuse_faults(mode, module, device)
    start = time.perf_counter()
    model = copy.deepcopy(module).to(device)
    model.train(task == "train")
    note = ""
    if mode in ("nhwc", CONTROL):
        model = model.to(memory_format=torch_memory_format(fmt))
        args = convert_batch(args, fmt)  # every input of the format's rank
    elif mode == "planned+compile" and task == "infer":
        # memlayout.compile: the fastest verified of the plan compiled so that it stands,
        # Inductor's own layout and the peer runtimes installed (CPU); Inductor's unless
        # another measured >2 % faster. The input in the format the winner reads, converted
        # once here, as the planned mode's is.
        model = plan_and_compile(model, args, dtype=_autocast_dtype(dtype), measure=plan_measure,
                                 backend=compile_backend)
        args = prepare_inputs(model, *args)
        record = model.plan.compiled  # type: ignore[union-attr]
        note = (f"memlayout.compile(backend={compile_backend!r}): kept {record.kept} "
                f"({record.precision.get(record.kept, dtype)}); compile time = its "
                "candidates' builds + the first call")
    elif mode in ("planned", "planned+compile"):
        # task train: planned for a training step (forward + backward costs, gradients verified)
        own_input = mode == "planned"  # its input in the plan's format, like nhwc's (above)
        model = optimize(model, args, dtype=_autocast_dtype(dtype), measure=plan_measure,
                         **({"train": True} if task == "train" else {}),
                         **({"input_format": "auto"} if own_input else {}))
        model.train(task == "train")
        plan = getattr(model, "plan", None)
        note = plan.headline() if plan is not None else ""
        if own_input:
            args = prepare_inputs(model, *args)
    if mode == BACKEND_MODE:
        from memlayout.plan.compilers import backend

        inner = "eager" if compile_backend == "eager" else "inductor"
        model = torch.compile(model, backend=backend.Backend(measure=plan_measure, inner=inner))
    if mode == "compile" or (mode == "planned+compile" and task == "train"):
        model = torch.compile(model, backend=compile_backend)
        note = "; ".join(n for n in (note, f"torch.compile(backend={compile_backend!r}); "
                                      "first call = compile time") if n)
    step = _step_fn(model, args, dtype, task, device)
    setup_s = time.perf_counter() - start

    sync = seam(device).synchronize
    if mode == BACKEND_MODE:
        report_backend(clear=True)  # this mode's graphs only
    start = time.perf_counter()
    step()
    sync()
    first_call_s = time.perf_counter() - start
    if mode == BACKEND_MODE:  # the guard's races on the graphs' calls end before timing
        note = _backend_note(report_backend(), inner, _raced(step))
    if mode == "planned+compile" and task == "infer":  # compiled inside memlayout.compile
        first_call_s += sum(model.plan.compiled.compile_seconds.values())  # type: ignore[union-attr]
    # this mode's own: its model's state on the device, and what one step allocates beyond
    # what was there before it (the other modes' models are there too, and not counted)
    allocated = seam(device).peak_memory(step)
    peak = None if allocated is None else _state_bytes(model) + allocated.peak
    return PreparedMode(mode, step, setup_s, first_call_s, _input_format(args), peak, note,
                        model)


def _state_bytes(model: Any) -> int:
    """Bytes of a model's distinct parameters, buffers and gradients (a compiled model's
    through the module it wraps; a runtime's model: none on the device)."""
    module = getattr(model, "_orig_mod", model)
    if not isinstance(module, nn.Module):
        return 0
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [p.grad for p in module.parameters() if p.grad is not None]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _raced(step: Callable[[], Any], limit: int = 200) -> int:
    """Call ``step`` until no graph of the backend's races on its calls (or ``limit`` calls):
    what is timed after is what runs from then on. The calls made."""
    for made in range(limit):
        if not any(g.racing for g in report_backend().graphs):
            return made
        step()
    return limit


def _backend_note(report: BackendReport, inner: str, raced: int = 0) -> str:
    """What the backend did on the first call: graphs, how they ran, the convolutions whose
    format differs from Inductor's rule, the weights the plans that run convert per call, how
    much slower the guard timed Inductor's own layouts where they were, and the calls after
    the first its races on the graphs' calls took (``raced``)."""
    ran = ", ".join(f"{sum(g.ran == how for g in report.graphs)} {how}"
                    for how in dict.fromkeys(g.ran for g in report.graphs))
    differ = [c.where for _, c in report.differing]
    shown = ", ".join(differ[:4]) + (", ..." if len(differ) > 4 else "")
    weights = [size for g in report.graphs if g.ran in (Runner.PLAN_COMPILED, Runner.PLAN_EAGER)
               for _, size in g.converted_weights]
    slower = [s for g in report.graphs if (s := g.own_layouts_slower) is not None]
    own = (f"; the guard timed Inductor's own layouts at up to {max(slower):.3g}x the compiled "
           "plan's time" if slower else "")
    return (f"torch.compile(backend=memlayout.backend(inner={inner!r})): "
            f"{len(report.graphs)} graphs ({ran}); {len(differ)} convolutions differ from "
            f"Inductor's rule{': ' + shown if differ else ''}; {len(weights)} weights "
            f"({sum(weights) / 1e6:.3g} MB) converted per call{own}; "
            + (f"the guard's races on the calls ended {raced} calls after the first; "
               if raced else "")
            + "first call = plan + compile time")


def _input_format(args: tuple[Any, ...]) -> str:
    """The format of the first image-like (rank 3-5) input, else of the first tensor."""
    tensors = list(iter_tensors(args))
    first = next((t for t in tensors if 3 <= t.dim() <= 5), tensors[0] if tensors else None)
    return format_name(format_of(first)) if first is not None else "none"


def _prepare_runtime(mode: str, module: nn.Module, args: tuple[Any, ...], *, dtype: str,
                     task: str, device: str) -> PreparedMode:
    """A peer runtime as a mode: converted, compiled, called once and checked against eager
    NCHW in the same dtype (autocast for bf16, as the ``nchw`` mode runs)."""
    if task != "infer":
        raise ModeUnavailable(f"{mode} runs inference only (no training)")
    if not seam(device).host:
        raise ModeUnavailable(f"{mode} is measured on the CPU only; got device {device!r}")
    reason = runtimes.available(mode)
    if reason:
        raise ModeUnavailable(reason)
    if len(args) != 1 or not isinstance(args[0], torch.Tensor):
        raise ModeUnavailable(f"{mode} is built here for a model with one tensor input; this "
                              f"one takes {len(args)} inputs")
    x = args[0]
    run_dtype = _autocast_dtype(dtype)
    start = time.perf_counter()
    try:
        model = runtimes.build_runtime(module, x, runtimes.RuntimeOptions(mode, dtype=run_dtype))
    except runtimes.RuntimeUnavailable as exc:
        raise ModeUnavailable(str(exc)) from exc
    setup_s = time.perf_counter() - start
    x = x.contiguous()

    def step() -> object:
        return model(x)

    start = time.perf_counter()
    got = step()
    first_call_s = time.perf_counter() - start
    reference = copy.deepcopy(module).eval()
    with torch.no_grad(), autocast(device, run_dtype):
        want = reference(x)
    ok, worst, _ = compare_outputs(want, got, run_dtype)
    if not ok:
        rtol = tolerance(run_dtype or torch.float32, Compared.MODEL)[0]
        raise OutputMismatch(f"{mode} output differs from eager NCHW by {worst:.3g} (relative to "
                             f"its largest magnitude; tolerance {rtol:g} for {dtype}): not timed")
    note = f"{model.describe()}; output vs eager NCHW: {worst:.2g} relative"
    return PreparedMode(mode, step, setup_s, first_call_s, format_name(format_of(x)), None, note,
                        None, model.convert_s + model.compile_s)


def count_flops(module: nn.Module, inputs: torch.Tensor | tuple[Any, ...], *, dtype: str,
                task: str, device: str = "cpu") -> int:
    """FLOPs of one step (forward; forward + backward for ``train``) by
    ``torch.utils.flop_counter.FlopCounterMode``: matmuls and convolutions, the same in every
    layout, so one count serves every mode. The optimizer step is not counted."""
    model = copy.deepcopy(module).to(device)
    model.train(task == "train")
    args = _on(inputs, device)
    run_dtype = _autocast_dtype(dtype)
    with FlopCounterMode(display=False) as counter:
        if task == "infer":
            with torch.no_grad(), autocast(device, run_dtype):
                model(*args)
        else:
            with autocast(device, run_dtype):
                out = model(*args)
            _train_loss(out).backward()
    return int(counter.get_total_flops())


def gemm_step(side: int, dtype: str, device: str = "cpu") -> tuple[Callable[[], object], int]:
    """A ``side`` x ``side`` matmul in ``dtype`` (real bf16 tensors for bf16) and its FLOPs:
    the machine's practical peak, timed in the same interleaved rounds as the models; fp32
    in the precision fp32 convolutions run in here (TF32 on a GPU that rounds them so)."""
    gen = torch.Generator().manual_seed(0)
    tensor_dtype = _autocast_dtype(dtype) or torch.float32
    a, b = (torch.randn(side, side, generator=gen).to(device=device, dtype=tensor_dtype)
            for _ in range(2))
    out = torch.empty_like(a)

    on = seam(device)

    def gemm() -> object:
        with on.matmul_as_convolutions():
            return torch.mm(a, b, out=out)
    return gemm, 2 * side ** 3


@dataclass(frozen=True)
class GemmPeak:
    """This machine's practical matmul rate in one dtype, measured once per run."""

    dtype: str
    side: int
    #: ``None`` when the matmul failed (then no record has a fraction of peak)
    flops_per_s: float | None
    rounds: int
    #: the matrix instructions the CPU offers for this dtype (``/proc/cpuinfo`` flags)
    isa: str
    error: str | None = None

    def method(self) -> str:
        """How the peak was measured, in one phrase for ``summary.md`` and every record."""
        return (f"{self.side}x{self.side} torch.mm on {self.dtype} tensors, fastest of "
                f"{self.rounds} timed calls, once per run; {self.isa}")


def matmul_isa(dtype: str, device: str = "cpu", isa: CpuIsa | None = None) -> str:
    """The matrix instructions behind a ``dtype`` matmul here (``isa``, default this CPU's
    flags): AMX tiles and AVX-512 BF16 are what make bf16 faster than fp32 on a Xeon (oneDNN
    picks the best).

    >>> matmul_isa("bf16", "cuda")
    'device cuda'
    >>> matmul_isa("bf16", isa=CpuIsa("AVX2", frozenset({"avx2"})))
    'CPU bf16 instructions: none (bf16 emulated)'
    """
    on = seam(device)
    if not on.host:
        tf32 = dtype == "fp32" and on.fp32_rounding()
        return f"device {device}" + ("; fp32 as TF32, as its convolutions" if tf32 else "")
    flags = (isa or machine.cpu_isa()).flags
    found = [name for flag, name in (("amx_bf16", "AMX-BF16"), ("amx_tile", "AMX tiles"),
                                      ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX-512"),
                                      ("avx2", "AVX2")) if flag in flags]
    if dtype == "bf16":
        bf16 = [n for n in found if "BF16" in n]
        return "CPU bf16 instructions: " + (", ".join(bf16) if bf16 else "none (bf16 emulated)")
    return "CPU vector instructions: " + (", ".join(n for n in found if "BF16" not in n) or "unknown")

