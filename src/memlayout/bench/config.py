"""What a benchmark run measures: a typed, frozen config (no ``kwargs.pop``, no args mutation).

>>> cfg = BenchConfig.from_strings(["torchvision:resnet18"], modes="nchw,nhwc", dtypes="fp32,bf16")
>>> cfg.modes, cfg.dtypes, cfg.tasks
(('nchw', 'nhwc'), ('fp32', 'bf16'), ('infer',))
>>> BenchConfig.from_strings(["torchvision:resnet18"], modes="nhwc,fast")
Traceback (most recent call last):
...
memlayout.bench.config.BenchConfigError: unknown mode 'fast' in --modes 'nhwc,fast'; expected a comma-separated subset of nchw, nhwc, planned, compile, planned+compile, compile-memlayout, nhwc-again, openvino, onnxruntime
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from memlayout.errors import MemlayoutError

#: eager NCHW is the baseline every ratio is taken against
BASELINE = "nchw"
#: an A/A control: a second, independent copy of ``nhwc`` timed in the same rounds. Its ratio
#: to ``nhwc`` should be 1; its spread is the noise floor of every comparison of the run
#: (a planned model that *is* eager NHWC can only be judged against it). Not in the default.
CONTROL = "nhwc-again"
DEFAULT_MODES: tuple[str, ...] = ("nchw", "nhwc", "planned", "compile", "planned+compile")
#: peer inference runtimes (``memlayout.runtimes``): not in the default, they need the
#: ``memlayout[runtimes]`` extra; asked for without it they are ``unavailable`` records
RUNTIME_MODES: tuple[str, ...] = ("openvino", "onnxruntime")
#: ``torch.compile(model, backend="memlayout")``: not in the default (it measures each graph's
#: costs on its first call, once per machine)
BACKEND_MODE = "compile-memlayout"
MODES: tuple[str, ...] = (*DEFAULT_MODES, BACKEND_MODE, CONTROL, *RUNTIME_MODES)
DTYPES: tuple[str, ...] = ("fp32", "bf16")
TASKS: tuple[str, ...] = ("infer", "train")
DEVICES: tuple[str, ...] = ("cpu", "cuda")


class BenchConfigError(MemlayoutError, ValueError):
    """A benchmark request that cannot be run as given (unknown mode, dtype, zoo, bad sizes)."""


class ModeUnavailable(MemlayoutError):
    """A mode this installation cannot run at all (e.g. ``planned`` before the planner exists).

    Recorded as ``status="unavailable"``, never faked and never counted as a failure.
    """


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run: every model x dtype x task, all ``modes`` interleaved per round."""

    models: tuple[str, ...]
    modes: tuple[str, ...] = DEFAULT_MODES
    dtypes: tuple[str, ...] = ("fp32",)
    tasks: tuple[str, ...] = ("infer",)
    batch: int = 8
    #: ``None``: each model's own size (the zoo's, else ``load_model``'s default: 224, video 112)
    image_size: int | None = None
    rounds: int = 7
    warmup: int = 1
    #: ``None``: leave torch's thread count as it is
    threads: int | None = None
    device: str = "cpu"
    compile_backend: str = "inductor"
    #: the planner's costs: measured on this machine (cached), or its analytic model (faster)
    plan_measure: bool = True
    #: side of the square matmul that measures the GEMM peak; ``None``: 2048 on CPU, 8192 on CUDA
    gemm_size: int | None = None
    #: per-model image sizes from a zoo, used when ``image_size`` is ``None``
    zoo_sizes: tuple[tuple[str, int], ...] = ()
    #: ``memlayout.malloc.steady_heap()`` for the rest of the process before the first case:
    #: no page-fault churn from glibc returning large blocks to the OS after every step
    steady_heap: bool = False

    def __post_init__(self) -> None:
        if not self.models:
            raise BenchConfigError("no models given; name MODEL_SPECs or pick a --zoo (quick, classification, all)")
        _check_subset(self.modes, MODES, "mode", "--modes")
        _check_subset(self.dtypes, DTYPES, "dtype", "--dtype")
        _check_subset(self.tasks, TASKS, "task", "--task")
        if BASELINE not in self.modes:
            raise BenchConfigError(
                f"--modes {','.join(self.modes)!r} lacks {BASELINE!r}, the baseline every speedup "
                f"is measured against; add it, e.g. --modes {BASELINE},{','.join(self.modes)}"
            )
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise BenchConfigError(f"unknown device {self.device!r}; expected cpu, cuda or cuda:N")
        for name, value, low in (("batch", self.batch, 1), ("rounds", self.rounds, 1),
                                 ("warmup", self.warmup, 0)):
            if value < low:
                raise BenchConfigError(f"--{name} must be >= {low}, got {value}")
        for name, value in (("image-size", self.image_size), ("threads", self.threads),
                            ("gemm-size", self.gemm_size)):
            if value is not None and value < 1:
                raise BenchConfigError(f"--{name} must be >= 1 when given, got {value}")

    @classmethod
    def from_strings(cls, models: Sequence[str], *, modes: str = ",".join(DEFAULT_MODES),
                     dtypes: str = "fp32", tasks: str = "infer", **kwargs: object) -> BenchConfig:
        """Build a config from the CLI's comma-separated lists (``"nchw,nhwc"``)."""
        return cls(models=tuple(models), modes=_split(modes, MODES, "mode", "--modes"),
                   dtypes=_split(dtypes, DTYPES, "dtype", "--dtype"),
                   tasks=_split(tasks, TASKS, "task", "--task"), **kwargs)  # type: ignore[arg-type]

    def image_size_for(self, spec: str) -> int | None:
        """The image size ``spec`` runs at: ``image_size`` if set, else the zoo's, else ``None``."""
        if self.image_size is not None:
            return self.image_size
        return dict(self.zoo_sizes).get(spec)

    def gemm_side(self) -> int:
        return self.gemm_size or (8192 if self.device.startswith("cuda") else 2048)


def _split(text: str, allowed: tuple[str, ...], what: str, flag: str) -> tuple[str, ...]:
    items = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    if not items:
        raise BenchConfigError(f"{flag} is empty; expected a comma-separated subset of {', '.join(allowed)}")
    for item in items:
        if item not in allowed:
            raise BenchConfigError(
                f"unknown {what} {item!r} in {flag} {text!r}; expected a comma-separated subset "
                f"of {', '.join(allowed)}"
            )
    return items


def _check_subset(items: tuple[str, ...], allowed: tuple[str, ...], what: str, flag: str) -> None:
    _split(",".join(items), allowed, what, flag)
    if len(set(items)) != len(items):
        raise BenchConfigError(f"{flag} names a {what} twice: {', '.join(items)}")
