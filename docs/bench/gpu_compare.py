"""The inference comparison on a GPU, in one process: eager NCHW, eager channels-last, the plan,
torch.compile, memlayout.compile and, where installed, TensorRT (``torch_tensorrt``).

Per model and dtype every mode gets its own copy of the model and its input in the format it
reads, one untimed first call (a compile mode's compile; its seconds recorded), a check of its
output against eager NCHW in the same dtype (``memlayout.plan.compare`` tolerances: a mode that
computes something else is an ``error`` record, never a timing), then ``--rounds`` rounds timed
interleaved (``memlayout.timing.interleaved``, the device synchronised around each sample).
Ratios are eager NCHW time / mode time per round (> 1: faster than eager NCHW), median and
range; ``vs_best_peer`` is the best peer (torch.compile, TensorRT) time / memlayout.compile time.

fp16 and bf16 are ``torch.autocast`` for the PyTorch modes and TensorRT's own reduced precision
(``enabled_precisions``) for TensorRT; the records say so. ``docs/bench/gpu.sh`` runs it on
CUDA; ``--device cpu --smoke`` runs a tiny model for two rounds (what the test suite does, so
the script is known to work before a GPU session runs it once).

    python docs/bench/gpu_compare.py --device cuda --models torchvision:resnet50 \
        --dtypes fp32,fp16,bf16 --batch 32 --image-size 224 --rounds 15 --out gpu-results
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import memlayout
from memlayout.dtypes import autocast, dtype_name, parse_dtype
from memlayout.machine import Conditions
from memlayout.models import load_model
from memlayout.plan.check.speed import busier
from memlayout.plan.compare import compare
from memlayout.plan.compilers.compiled import compile as plan_and_compile
from memlayout.plan.pipeline import optimize
from memlayout.timing import device_sync, interleaved

MODES: tuple[str, ...] = ("nchw", "nhwc", "planned", "compile", "memlayout.compile", "tensorrt")
PEERS: tuple[str, ...] = ("compile", "tensorrt")
SMOKE_MODEL = f"{Path(__file__).resolve()}:tiny"


def tiny() -> nn.Module:
    """A few convolutions: the smoke run's model."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


@dataclass(frozen=True)
class Record:
    """One model x dtype x mode."""

    model: str
    dtype: str
    mode: str
    status: str  # ok, error, unavailable
    device: str
    batch: int
    image_size: int
    precision: str = ""
    median_s: float | None = None
    vs_nchw: float | None = None  # median of per-round NCHW / mode time
    vs_nchw_min: float | None = None
    vs_nchw_max: float | None = None
    first_call_s: float | None = None
    max_error: float | None = None
    note: str = ""
    error: str = ""
    rounds: int = 0
    conditions: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Prepared:
    step: Callable[[], Any]
    precision: str
    note: str = ""


class Unavailable(Exception):
    """A mode that cannot run here (not installed, no kernels for the dtype)."""


def prepare(mode: str, model: nn.Module, x: torch.Tensor, dtype: torch.dtype | None,
            device: str, backend: str, measure: bool = True) -> Prepared:
    """``mode`` built on its own copy of ``model``; the step runs one inference. ``measure``:
    the planner measures its costs (cached in the user's cost cache), else its analytical
    model, no cache (the smoke run)."""
    plan = {"measure": measure} if measure else {"measure": False, "cache": False}
    work = copy.deepcopy(model).to(device).eval()
    x = x.to(device)
    amp = "fp32" if dtype is None else f"torch.autocast {dtype_name(dtype)}"
    note = ""
    if mode == "nhwc":
        work = work.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    elif mode == "planned":
        work = optimize(work, (x,), dtype=dtype, input_format="auto", **plan)
        (x,) = memlayout.prepare_inputs(work, x)
        note = work.plan.headline()
    elif mode == "compile":
        work = torch.compile(work, backend=backend)
    elif mode == "memlayout.compile":
        work = plan_and_compile(work, (x,), dtype=dtype, backend=backend, **plan)
        (x,) = memlayout.prepare_inputs(work, x)
        record = work.plan.compiled
        note = f"kept {record.kept}"
        amp = record.precision.get(record.kept, amp)
    elif mode == "tensorrt":
        return _tensorrt(work, x, dtype)

    def step() -> Any:
        with torch.no_grad(), autocast(device, dtype):
            return work(x)
    return Prepared(step, amp, note)


def _tensorrt(model: nn.Module, x: torch.Tensor, dtype: torch.dtype | None) -> Prepared:
    """TensorRT through torch_tensorrt's dynamo path; fp16/bf16 are TensorRT's own precisions."""
    if x.device.type != "cuda":
        raise Unavailable("TensorRT runs on CUDA only")
    try:
        import torch_tensorrt
    except ImportError as exc:
        raise Unavailable(f"torch_tensorrt is not installed ({exc})") from exc
    precisions = {torch.float32} | ({dtype} if dtype is not None else set())
    with torch.no_grad():
        trt = torch_tensorrt.compile(model, ir="dynamo", inputs=[x],
                                     enabled_precisions=precisions)

    def step() -> Any:
        with torch.no_grad():
            return trt(x)
    names = "+".join(sorted(dtype_name(None if p is torch.float32 else p) for p in precisions))
    return Prepared(step, f"TensorRT {torch_tensorrt.__version__} enabled_precisions {names}")


def run_case(spec: str, dtype_text: str, args: argparse.Namespace) -> list[Record]:
    """Every mode of one model x dtype, verified, then timed interleaved."""
    built = load_model(spec, batch=args.batch, image_size=args.image_size)
    size = int(built.example_input.shape[-1])
    model, x = built.module.eval(), built.example_input.contiguous()
    dtype = parse_dtype(dtype_text)
    base = {"model": spec, "dtype": dtype_text, "device": args.device, "batch": args.batch,
            "image_size": size}
    with torch.no_grad(), autocast(args.device, dtype):
        want = copy.deepcopy(model).to(args.device)(x.to(args.device))
    records: dict[str, Record] = {}
    steps: dict[str, Callable[[], Any]] = {}
    for mode in args.modes:
        sync = device_sync(args.device)
        start = time.perf_counter()
        try:
            prepared = prepare(mode, model, x, dtype, args.device, args.compile_backend,
                               measure=not args.smoke)
            got = prepared.step()
            sync()
        except Unavailable as exc:
            records[mode] = Record(**base, mode=mode, status="unavailable", error=str(exc))
            continue
        except Exception as exc:  # a mode that fails on this model is a result
            records[mode] = Record(**base, mode=mode, status="error",
                                   error=f"{type(exc).__name__}: {str(exc)[:400]}")
            continue
        first = time.perf_counter() - start
        ok, worst, _ = compare(want, got, dtype)
        if not ok:
            records[mode] = Record(**base, mode=mode, status="error", max_error=worst,
                                   precision=prepared.precision,
                                   error=f"output differs from eager NCHW by {worst:.3g}: not timed")
            continue
        records[mode] = Record(**base, mode=mode, status="ok", precision=prepared.precision,
                               first_call_s=first, max_error=worst, note=prepared.note)
        steps[mode] = prepared.step
    if "nchw" not in steps:
        return list(records.values())
    before = Conditions.now()
    timing = interleaved(steps, rounds=args.rounds, warmup=args.warmup, baseline="nchw",
                         sync=device_sync(args.device))
    conditions = asdict(busier(before, Conditions.now()))
    out = []
    for mode, record in records.items():
        if mode in steps and timing[mode].ok:
            r = timing.ratios(mode)
            record = Record(**{**asdict(record), "median_s": timing[mode].median,
                               "vs_nchw": statistics.median(r), "vs_nchw_min": min(r),
                               "vs_nchw_max": max(r), "rounds": len(timing[mode].times),
                               "conditions": conditions})
        elif mode in steps:
            record = Record(**{**asdict(record), "status": "error", "error": timing[mode].error})
        out.append(record)
    return out


def summary(records: Sequence[Record]) -> str:
    """A markdown table per dtype: speedup over eager NCHW, and memlayout.compile against the
    fastest peer (torch.compile, TensorRT) by median time."""
    lines = ["| model | dtype | " + " | ".join(MODES) + " | best peer / memlayout.compile time |",
             "|---|---|" + "---|" * (len(MODES) + 1)]
    cases = dict.fromkeys((r.model, r.dtype) for r in records)
    for model, dtype in cases:
        by_mode = {r.mode: r for r in records if (r.model, r.dtype) == (model, dtype)}
        cells = []
        for mode in MODES:
            r = by_mode.get(mode)
            cells.append("-" if r is None else r.status if r.vs_nchw is None else
                         f"{r.vs_nchw:.2f}x ({r.vs_nchw_min:.2f}-{r.vs_nchw_max:.2f})")
        ours = by_mode.get("memlayout.compile")
        peers = [by_mode[p].median_s for p in PEERS if p in by_mode and by_mode[p].median_s]
        best = (f"{min(peers) / ours.median_s:.3f}" if ours is not None and ours.median_s
                and peers else "-")
        lines.append(f"| {model} | {dtype} | " + " | ".join(cells) + f" | {best} |")
    return "\n".join(lines)


def environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                           "device": device, "threads": torch.get_num_threads(),
                           "argv": sys.argv}
    if torch.device(device).type == "cuda":
        env.update(cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(device),
                   cudnn=torch.backends.cudnn.version())
    try:
        import torch_tensorrt
        env["torch_tensorrt"] = torch_tensorrt.__version__
    except ImportError:
        env["torch_tensorrt"] = None
    return env


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default="torchvision:resnet50,torchvision:mobilenet_v2")
    parser.add_argument("--dtypes", default="fp32,fp16,bf16")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--out", default="gpu-results")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model, batch 2, 16 px, 2 rounds, analytical plans, no cost "
                             "cache: does the script work here")
    args = parser.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown or "nchw" not in args.modes:
        parser.error(f"--modes: nchw required, the others from {', '.join(MODES)}; got {unknown}")
    if args.smoke:
        args.models, args.batch, args.image_size, args.rounds, args.warmup = (
            SMOKE_MODEL, 2, 16, 2, 0)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu --smoke to try the script)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "environment.json").write_text(json.dumps(environment(args.device), indent=1))
    records: list[Record] = []
    for spec in args.models.split(","):
        for dtype in args.dtypes.split(","):
            records += run_case(spec, dtype, args)
            # rewritten after every case: a run stopped half way keeps what it measured
            (out / "results.json").write_text(json.dumps([asdict(r) for r in records], indent=1))
            (out / "summary.md").write_text(summary(records) + "\n")
            print(summary(records[-len(args.modes):]).splitlines()[-1], flush=True)
    return out


if __name__ == "__main__":
    main()
