"""What every verb of the ``memlayout`` command shares: the console, the one error line, the
flag checks (each returns the parsed value or raises a ``MemlayoutError`` naming the flag), and
the conditions line printed before anything is timed."""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

import torch
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from memlayout.devices import seam
from memlayout.dtypes import dtype_name, parse_dtype
from memlayout.errors import MemlayoutError
from memlayout.machine import Bf16Speed, Conditions

console = Console()
if not console.is_terminal:  # piped or captured: do not squeeze tables into 80 columns
    console = Console(width=140)

#: the autocast dtypes of the verbs that run a model (bench has no fp16 cases)
DTYPES = ("fp32", "bf16", "fp16")
BENCH_DTYPES = ("fp32", "bf16")
PLAN_COSTS = ("measured", "analytic")


class UsageError(MemlayoutError, ValueError):
    """A flag value a verb cannot run with; reported before the verb does anything."""


def fail(exc: MemlayoutError, *, debug: bool = False) -> NoReturn:
    if debug and exc.__cause__ is not None:  # the user's code that failed, where it failed
        import traceback

        console.print("".join(traceback.format_exception(exc.__cause__)), markup=False,
                      highlight=False)
    console.print(f"[bold red]error:[/bold red] {escape(str(exc))}")
    raise typer.Exit(2)


def debug_log(ctx: typer.Context, enabled: bool) -> None:
    """With ``--debug``, memlayout's debug log (what torch printed or logged while capturing)
    goes to stderr until the command ends; without it nothing of it reaches the terminal."""
    if not enabled:
        return
    logger = logging.getLogger("memlayout")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("debug: %(name)s: %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)

    def remove() -> None:
        logger.removeHandler(handler)
        logger.setLevel(level)

    ctx.call_on_close(remove)


# -- flag checks: each returns the parsed value or raises a MemlayoutError naming the flag ----
def check_dtype(value: str, allowed: tuple[str, ...] = DTYPES) -> str:
    """The short name of a ``--dtype`` value (``bfloat16`` -> ``bf16``)."""
    return dtype_name(parse_dtype(value, allowed=allowed))


def check_dtypes(value: str, allowed: tuple[str, ...]) -> str:
    """A comma-separated ``--dtype`` list with each name checked and shortened."""
    return ",".join(check_dtype(item, allowed) for item in value.split(",") if item.strip())


def at_least(low: int, **flags: int | None) -> None:
    """Each flag given (not ``None``) is ``>= low``; keyword names are flag names."""
    for name, value in flags.items():
        if value is not None and value < low:
            raise UsageError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")


def choice(flag: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise UsageError(f"{flag} {value!r} is not one of {', '.join(allowed)}")
    return value


def check_device(value: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` that exists on this machine."""
    text = value.strip().lower()
    if text == "cpu":
        return text
    if not re.fullmatch(r"cuda(:\d+)?", text):
        raise UsageError(f"unknown device {value!r}; expected cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise UsageError(f"--device {value}: CUDA is not available here "
                         "(torch.cuda.is_available() is False); use --device cpu")
    count = torch.cuda.device_count()
    if ":" in text and int(text.split(":")[1]) >= count:
        raise UsageError(f"--device {value}: this machine has {count} CUDA device(s), "
                         f"cuda:0 to cuda:{count - 1}")
    return text


def writable_file(flag: str, path: Path) -> None:
    """``path`` can be written: its folder exists and is writable, and it is not a folder."""
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file name")
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {path}: the folder {folder} is not writable")


def print_conditions(conditions: Conditions) -> None:
    """The conditions a measurement is taken under, and the warning when the machine is busy."""
    console.print(f"conditions: {conditions.describe()}", markup=False, highlight=False)
    warning = conditions.warning()
    if warning:
        console.print(f"[yellow]warning[/yellow]: {escape(warning)}")


def print_measuring_conditions(measure: bool) -> None:
    """``optimize``'s first words before it measures: the conditions, and what the planner
    does with numbers taken on a busy machine."""
    from memlayout.plan.check.guard import SUSPECT
    from memlayout.plan.costs.measure import RETRIES

    conditions = Conditions.now()
    print_conditions(conditions)
    if measure and conditions.busy:
        console.print(
            f"costs measured now are marked noisy (one whose rounds spread too far is taken "
            f"again, at most {RETRIES} times) and counted in the plan's summary; a later run on "
            "a quiet machine measures them again instead of reading them from the cache, and a "
            f"plan predicting more than {SUSPECT:g}x the guard's measured time measures its "
            "costs once more", markup=False, highlight=False)


def bf16_notice(dtypes: str | tuple[str, ...], device: str, then: str) -> Bf16Speed | None:
    """Where bf16 is asked for, its speed here measured against fp32 (once per process);
    where it is emulated, one note saying so up front and ``then``, what the verb does about
    it. ``None`` when no bf16 is asked for, or bf16 is the device's own arithmetic (a GPU)."""
    if "bf16" not in ((dtypes,) if isinstance(dtypes, str) else dtypes):
        return None
    speed = seam(device).bf16()  # measured on a CPU (tests inject it: machine.bf16_speed)
    if speed is not None and speed.emulated:
        console.print(f"note: {speed.describe()}; {then}", markup=False, highlight=False)
    return speed


def on_device(value: Any, device: str) -> Any:
    """A tensor, or a tuple / list / dict of them, on ``device``."""
    if isinstance(value, dict):
        return {k: on_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_device(v, device) for v in value)
    return value.to(device) if isinstance(value, torch.Tensor) else value


def progress_bar(out: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=out, transient=False)


MODEL_HELP = "Model spec: torchvision:NAME, timm:NAME or file.py:factory."
DEVICE_HELP = "cpu, cuda or cuda:N. Default: cpu."
CUDNN_BENCHMARK_HELP = ("torch.backends.cudnn.benchmark = True before any work: cuDNN times its "
                        "convolution algorithms at each new shape and keeps the fastest; costs "
                        "are measured and cached under the setting in force. Default: off "
                        "(torch's default).")


def cudnn_benchmark(on: bool) -> None:
    """``--cudnn-benchmark``: cuDNN picks each convolution's algorithm by timing them (the
    device seam keys every cost by this setting, so a cached cost taken without it is not
    read with it)."""
    if on:
        torch.backends.cudnn.benchmark = True

