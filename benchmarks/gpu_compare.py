"""The layout comparison on a CUDA GPU in one process and one time budget: per case (model x
dtype x task) eager NCHW, eager channels-last (``nhwc``) and its A/A control (``nhwc-again``,
a second copy prepared the same way: the spread between identical modes), memlayout's plan
(``memlayout.optimize``), ``torch.compile`` and ``torch.compile`` with memlayout's backend
(``compile-memlayout``), training and inference, in fp32, bf16 and fp16.

Per case every mode gets its own copy of the model and its input in the format it reads, one
untimed first call (for a compile mode, its compile, and the plan's for ``planned`` and
``compile-memlayout``: ``first_call_s``), a check of that call's output (training: the first
step's loss) against eager NCHW's within the dtype's tolerance (``memlayout.plan.compare``; a
mode that computes something else is an ``error`` record, never a timing), then ``rounds``
rounds of ``repeat`` steps, interleaved (``memlayout.timing.interleaved``). ``vs_nchw`` is the
median over rounds of eager NCHW's time / the mode's (> 1: faster).

bf16 and fp16 run under ``torch.autocast`` (``memlayout.dtypes.autocast``): weights fp32, the
backward outside autocast, no gradient scaler. A training step is forward, backward of
``memlayout.tensors.mean_square_loss`` and ``SGD.step``. fp32 convolutions on an Ampere or
later GPU round to TF32 (torch's default), so fp32 outputs are checked at fp16's tolerance there.

Cases run in ``cases()`` order, the most wanted first. Before each case the budget is checked:
a case that would end past it (``forecast``: the longest case of its task so far) is a
``skipped`` record, and within a case a mode not yet built when the budget
runs out is one too. Results are rewritten after every case, so a run stopped half way keeps
what it measured. ``benchmarks/gpu.sh`` runs it; ``--dry-run`` runs the same code on the CPU
on a tiny model for two rounds, with Dynamo's ``eager`` backend and the planner's analytical
costs, so the script is known to work before a GPU session runs it.

    PYTHONPATH=src python3 benchmarks/gpu_compare.py --out gpu-results --budget 420
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

import memlayout
from memlayout.bench.config import BACKEND_MODE, CONTROL
from memlayout.bench.unets import UNet
from memlayout.devices import seam
from memlayout.dtypes import autocast, parse_dtype
from memlayout.models import load_model
from memlayout.plan.compare import compare
from memlayout.plan.compilers.backend import Backend
from memlayout.plan.compilers.backend_report import backend_report
from memlayout.plan.pipeline import optimize
from memlayout.tensors import mean_square_loss
from memlayout.timing import interleaved

MODES: tuple[str, ...] = ("nchw", "nhwc", CONTROL, "planned", "compile", BACKEND_MODE)
TASKS: tuple[str, ...] = ("train", "infer")
DTYPES: tuple[str, ...] = ("bf16", "fp32", "fp16")
LEARNING_RATE = 1e-3
#: a case's relative time by task, compiles dominating: training compiles a forward and a
#: backward graph where inference compiles one
TASK_COST = {"train": 2.0, "infer": 1.0}
HERE = Path(__file__).resolve()

#: the files a run writes into ``--out``, the table first (gpu.sh adds the machine and the log)
TABLE, RESULTS, ENVIRONMENT = "01-table.md", "02-results.json", "03-environment.json"


def tiny() -> nn.Module:
    """A few convolutions: the dry run's model."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def unet() -> nn.Module:
    """A segmentation UNet: 4 levels of two 3x3 convolutions, widths 32 to 512, skip
    concatenations, transposed-convolution upsampling."""
    return UNet(width=32, depth=4)


@dataclass(frozen=True)
class Model:
    """A model and the sizes a GPU user runs it at, large enough that an H100's kernels
    outlast eager's launches (resnet50's bf16 training step at 128: ~20 ms of kernels, ~7 ms
    of Python launching ~700 of them)."""

    name: str
    spec: str
    infer_batch: int
    train_batch: int
    image_size: int


MODELS: dict[str, Model] = {m.name: m for m in (
    Model("resnet50", "torchvision:resnet50", 128, 128, 224),
    Model("convnext_tiny", "timm:convnext_tiny", 128, 128, 224),
    Model("efficientnet_b0", "torchvision:efficientnet_b0", 128, 128, 224),
    Model("unet", f"{HERE}:unet", 32, 16, 256),
)}
DRY_RUN_MODEL = Model("tiny", f"{HERE}:tiny", 2, 2, 16)


@dataclass(frozen=True)
class Case:
    model: Model
    dtype: str
    task: str

    @property
    def batch(self) -> int:
        return self.model.train_batch if self.task == "train" else self.model.infer_batch


def cases(models: Sequence[str], dtypes: Sequence[str], tasks: Sequence[str]) -> list[Case]:
    """The cases asked for, most wanted first: resnet50 in bf16 and fp32, then in fp16, then
    the other models in bf16, then in fp16 and fp32; training before inference in each.

    >>> for c in cases(["resnet50", "unet"], ["fp32", "bf16"], ["infer"]):
    ...     print(c.model.name, c.dtype, c.task, c.batch)
    resnet50 bf16 infer 128
    resnet50 fp32 infer 128
    unet bf16 infer 32
    unet fp32 infer 32
    """
    first, others = ["resnet50"], [m for m in MODELS if m != "resnet50"]
    order = [(first, ("bf16", "fp32")), (first, ("fp16",)), (others, ("bf16",)),
             (others, ("fp16", "fp32"))]
    return [Case(MODELS[m], d, t) for names, ds in order for d in ds for m in names for t in TASKS
            if m in models and d in dtypes and t in tasks]


@dataclass(frozen=True)
class Options:
    device: str
    rounds: int
    repeat: int
    warmup: int
    #: ``inductor``; ``eager``: Dynamo's eager backend, and memlayout's backend runs its
    #: planned graphs eagerly
    compile_backend: str
    #: the planner's costs timed here (cached in the user's cost cache); else its analytical model
    measure: bool
    budget_s: float


@dataclass(frozen=True)
class Record:
    """One case x mode (``mode`` ``all``: a case skipped whole)."""

    model: str
    dtype: str
    task: str
    mode: str
    status: str  # ok, error, skipped
    device: str
    batch: int
    image_size: int
    median_s: float | None = None
    round_times_s: tuple[float, ...] = ()
    vs_nchw: float | None = None
    vs_nchw_min: float | None = None
    vs_nchw_max: float | None = None
    first_call_s: float | None = None
    #: the allocator's peak during one step beyond what was allocated before it (CUDA only)
    step_peak_bytes: int | None = None
    max_error: float | None = None
    note: str = ""
    error: str = ""


@dataclass(frozen=True)
class Prepared:
    step: Callable[[], Any]
    note: str = ""


def prepare(mode: str, model: nn.Module, x: torch.Tensor, case: Case,
            options: Options) -> Prepared:
    """``mode`` on its own copy of ``model`` and ``x``; the step runs one training step or one
    inference."""
    train = case.task == "train"
    dtype = parse_dtype(case.dtype)
    work = copy.deepcopy(model).to(options.device).train(train)
    x = x.to(options.device)
    note = ""
    if mode in ("nhwc", CONTROL):
        work = work.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    elif mode == "planned":
        work = optimize(work, (x,), dtype=dtype, input_format="auto", train=train,
                        measure=options.measure, cache=options.measure).train(train)
        (x,) = memlayout.prepare_inputs(work, x)
        note = work.plan.headline()
    elif mode == "compile":
        work = torch.compile(work, backend=options.compile_backend)
    elif mode == BACKEND_MODE:
        inner = "eager" if options.compile_backend == "eager" else "inductor"
        work = torch.compile(work, backend=Backend(measure=options.measure,
                                                   cache=options.measure, inner=inner))
    return Prepared(_step(work, x, dtype, train, options.device), note)


def _step(model: nn.Module, x: torch.Tensor, dtype: torch.dtype | None, train: bool,
          device: str) -> Callable[[], torch.Tensor]:
    if not train:
        def infer() -> torch.Tensor:
            with torch.no_grad(), autocast(device, dtype):
                return model(x)
        return infer
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)

    def train_step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with autocast(device, dtype):
            out = model(x)
        loss = mean_square_loss(out)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return train_step


def _backend_note() -> str:
    """What memlayout's backend did with the graphs of the first call."""
    report = backend_report()
    ran = ", ".join(f"{sum(g.ran == how for g in report.graphs)} {how}"
                    for how in dict.fromkeys(g.ran for g in report.graphs))
    return (f"{len(report.graphs)} graphs ({ran}); {len(report.differing)} convolutions "
            "differ from Inductor's rule")


def _draws_random(model: nn.Module, x: torch.Tensor, dtype: torch.dtype | None,
                  device: str) -> bool:
    """Whether the model's training forward draws random numbers (dropout, stochastic depth):
    two seeds give two outputs. Then no two modes' first losses agree (Inductor's random
    stream is not eager's), and none is compared."""
    work, x = copy.deepcopy(model).to(device).train(), x.to(device)
    outs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        with torch.no_grad(), autocast(device, dtype):
            outs.append(work(x))
    return not compare(*outs, dtype)[0]


def run_case(case: Case, options: Options, deadline: float) -> list[Record]:
    """Every mode of one case, checked against eager NCHW, then timed interleaved; a mode
    whose turn to be built comes after ``deadline`` (``time.monotonic``) is skipped."""
    built = load_model(case.model.spec, batch=case.batch, image_size=case.model.image_size)
    model, x = built.module, built.example_input.contiguous()
    base = {"model": case.model.name, "dtype": case.dtype, "task": case.task,
            "device": options.device, "batch": case.batch, "image_size": int(x.shape[-1])}
    device = seam(options.device)
    dtype = parse_dtype(case.dtype)
    # TF32 keeps fp16's 10 mantissa bits, and NCHW and NHWC kernels round differently
    checked_as = torch.float16 if dtype is None and device.fp32_rounding() else dtype
    unchecked = case.task == "train" and _draws_random(model, x, dtype, options.device)
    torch._dynamo.reset()  # each case's graphs are its own; no recompile limit carried over
    records: dict[str, Record] = {}
    steps: dict[str, Callable[[], Any]] = {}
    want: Any = None
    for mode in MODES:
        if mode != "nchw" and time.monotonic() > deadline:
            records[mode] = Record(**base, mode=mode, status="skipped",
                                   error="budget: spent before this mode was built")
            continue
        print(f"{case.model.name} {case.dtype} {case.task}: {mode}", flush=True)
        backend_report(clear=True)
        start = time.perf_counter()
        try:
            prepared = prepare(mode, model, x, case, options)
            torch.manual_seed(0)
            got = prepared.step()
            device.synchronize()
        except Exception as exc:  # a mode that fails on this model is a result
            records[mode] = Record(**base, mode=mode, status="error",
                                   error=f"{type(exc).__name__}: {str(exc)[:400]}")
            if mode == "nchw":
                break  # the reference: nothing to check the others against
            continue
        first = time.perf_counter() - start
        note = _backend_note() if mode == BACKEND_MODE else prepared.note
        if mode == "nchw":
            want = got
        if unchecked:
            ok, worst = True, None
            note = "; ".join(n for n in (note, "training draws random numbers: first loss not "
                                               "compared") if n)
        else:
            ok, worst, _ = compare(want, got, checked_as)
        if not ok:
            records[mode] = Record(**base, mode=mode, status="error", max_error=worst,
                                   first_call_s=first,
                                   error=f"output differs from eager NCHW by {worst:.3g}: "
                                         "not timed")
            continue
        peak = device.peak_memory(prepared.step)
        records[mode] = Record(**base, mode=mode, status="ok", first_call_s=first,
                               max_error=worst, note=note,
                               step_peak_bytes=None if peak is None else peak.peak)
        steps[mode] = prepared.step
    if "nchw" in steps:
        timing = interleaved(steps, rounds=options.rounds, warmup=options.warmup,
                             repeat=options.repeat, baseline="nchw", sync=device.synchronize)
        for mode in steps:
            if not timing[mode].ok:
                records[mode] = replace(records[mode], status="error",
                                        error=str(timing[mode].error)[:400])
                continue
            r = timing.ratios(mode)
            records[mode] = replace(records[mode], median_s=timing[mode].median,
                                    round_times_s=timing[mode].times,
                                    vs_nchw=statistics.median(r), vs_nchw_min=min(r),
                                    vs_nchw_max=max(r))
    return [records[m] for m in MODES if m in records]


def table(records: Sequence[Record]) -> str:
    """The results as one markdown table, a row per case x mode."""
    lines = ["| model | dtype | task | batch | mode | status | ms/step | img/s | "
             "vs eager NCHW (min-max) | first call s | step peak GB | note |",
             "|---|---|---|---:|---|---|---:|---:|---|---:|---:|---|"]
    for r in records:
        ms = f"{r.median_s * 1e3:.2f}" if r.median_s else "-"
        rate = f"{r.batch / r.median_s:.0f}" if r.median_s else "-"
        vs = (f"{r.vs_nchw:.3f} ({r.vs_nchw_min:.2f}-{r.vs_nchw_max:.2f})"
              if r.vs_nchw is not None else "-")
        first = f"{r.first_call_s:.1f}" if r.first_call_s is not None else "-"
        peak = f"{r.step_peak_bytes / 2**30:.2f}" if r.step_peak_bytes is not None else "-"
        text = (r.error or r.note).replace("|", "/").replace("\n", " ")
        text = text if len(text) <= 160 else text[:157] + "..."
        lines.append(f"| {r.model} | {r.dtype} | {r.task} | {r.batch} | {r.mode} | {r.status} "
                     f"| {ms} | {rate} | {vs} | {first} | {peak} | {text} |")
    return "\n".join(lines) + "\n"


def environment(options: Options) -> dict[str, Any]:
    import torchvision

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "torchvision": torchvision.__version__, "argv": sys.argv,
                           "options": asdict(options),
                           "device": seam(options.device).fingerprint()}
    try:
        import timm
        env["timm"] = timm.__version__
    except ImportError:
        env["timm"] = None
    return env


def forecast(longest: dict[str, float], task: str) -> float:
    """A case's expected seconds: the longest case of its task so far, else the longest of
    another task scaled by ``TASK_COST`` (0 before any case).

    >>> forecast({"train": 200.0}, "train"), forecast({"train": 200.0}, "infer")
    (200.0, 100.0)
    >>> forecast({}, "infer")
    0.0
    """
    if task in longest:
        return longest[task]
    return max((s * TASK_COST[task] / TASK_COST[t] for t, s in longest.items()), default=0.0)


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu-results",
                        help="the folder the results go to (default: gpu-results)")
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds the cases may take; later ones are skipped (default: 420)")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated (default: {','.join(MODELS)})")
    parser.add_argument("--dtypes", default=",".join(DTYPES),
                        help=f"comma-separated (default: {','.join(DTYPES)})")
    parser.add_argument("--tasks", default=",".join(TASKS),
                        help=f"comma-separated (default: {','.join(TASKS)})")
    parser.add_argument("--rounds", type=int, default=10,
                        help="interleaved timed rounds per case (default: 10)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="steps per timed sample (default: 3)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps per mode before the rounds (default: 2)")
    parser.add_argument("--compile-backend", default="inductor", choices=("inductor", "eager"),
                        help="eager: Dynamo's eager backend, and memlayout's backend runs its "
                             "plans eagerly (default: inductor)")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same run on the CPU: a tiny model at batch 2 and 16 px, bf16 "
                             "training and fp32 inference, 2 rounds, Dynamo's eager backend, "
                             "analytical plans, no cost cache: does the script work here "
                             "(default: off)")
    args = parser.parse_args(argv)
    picked = {"models": args.models.split(","), "dtypes": args.dtypes.split(","),
              "tasks": args.tasks.split(",")}
    for flag, allowed in (("models", MODELS), ("dtypes", DTYPES), ("tasks", TASKS)):
        unknown = sorted(set(picked[flag]) - set(allowed))
        if unknown:
            parser.error(f"--{flag}: unknown {unknown}; expected some of {', '.join(allowed)}")
    if args.dry_run:
        todo = [Case(DRY_RUN_MODEL, "bf16", "train"), Case(DRY_RUN_MODEL, "fp32", "infer")]
        options = Options("cpu", rounds=2, repeat=1, warmup=0, compile_backend="eager",
                          measure=False, budget_s=args.budget)
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device here (--dry-run runs the script on the CPU)")
        todo = cases(**picked)
        options = Options("cuda", args.rounds, args.repeat, args.warmup, args.compile_backend,
                          measure=True, budget_s=args.budget)
    start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / ENVIRONMENT).write_text(json.dumps(environment(options), indent=1))
    longest: dict[str, float] = {}  # task -> its longest case so far
    records: list[Record] = []
    for case in todo:
        spent, expected = time.monotonic() - start, forecast(longest, case.task)
        if spent + expected > options.budget_s:
            records.append(Record(case.model.name, case.dtype, case.task, "all", "skipped",
                                  options.device, case.batch, case.model.image_size,
                                  error=f"budget: {spent:.0f} s of {options.budget_s:.0f} spent, "
                                        f"and this case is forecast at {expected:.0f} s"))
        else:
            case_start = time.monotonic()
            records += run_case(case, options, deadline=start + options.budget_s)
            gc.collect()  # the case's models, now unreferenced, before the next case's
            seam(options.device).release()
            longest[case.task] = max(longest.get(case.task, 0.0),
                                     time.monotonic() - case_start)
        # rewritten after every case: a run stopped half way keeps what it measured
        (out / RESULTS).write_text(json.dumps([asdict(r) for r in records], indent=1))
        (out / TABLE).write_text(table(records))
    print(table(records), flush=True)
    return out


if __name__ == "__main__":
    main()
