"""What ``memlayout.optimize`` is asked for, and what each planning step is told (L2 plan).

:class:`PlanOptions` is the front door: every option of a planning run, one frozen record
checked when it is made (``optimize(model, x, options=...)``, or the same names as keywords).
:func:`run_options` resolves it once against the model and its example into
:class:`RunOptions` (the device, the autocast dtype, the layout ranks, the input and output
labels), which every step reads.

>>> PlanOptions(dtype="bf16", measure=False).measure
False
>>> PlanOptions(max_plans=0)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
memlayout.errors.PlanError: max_plans must be an int >= 1 ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memlayout import dtypes
from memlayout.errors import DtypeError, PlanError
from memlayout.layout import Format
from memlayout.plan.graph import Label, Request, planned_ranks
from memlayout.plan.inputs import format_label
from memlayout.plan.weights import CONTIGUOUS, CONVERTED, WEIGHTS
from memlayout.tensors import device_of
from memlayout.timing import KEEP_MARGIN

#: ``progress(done, total, what)``, called while measuring
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class PlanOptions:
    """How ``memlayout.optimize`` plans: every option, checked when the record is made
    (``PlanError`` names a bad one). Each option in full: ``docs/planner.md``.

    >>> fast = PlanOptions(dtype="bf16", input_format="auto")
    >>> dataclasses.replace(fast, guard=False).dtype, fast.guard
    ('bf16', True)
    """

    #: plan and run under autocast (``"bf16"``, ``"fp16"``, a ``torch.dtype``); ``None``/fp32: as is
    dtype: str | torch.dtype | None = None
    #: the format inputs arrive in (``None``: as the example is), or ``"auto"``: the plan
    #: chooses it (``plan.input_format``)
    input_format: str | Format | None = None
    #: ``"keep"`` (as the original returns them), a format, or ``None`` (as they come)
    output_format: str | Format | None = Request.KEEP.value
    #: ``False``: an analytical cost model instead of timing
    measure: bool = True
    #: (with ``measure``) time only the layout nodes whose costs could change the plan; the
    #: others are predicted from the analytical model fitted to this machine's cached timings
    #: (``plan.prediction``; ``memlayout.plan.solve.refine``)
    predict: bool = False
    #: timing rounds per op
    rounds: int = 5
    #: the cost cache: ``True`` (the user's), ``False`` (none) or a database path
    cache: bool | str | Path = True
    #: measure every cost and whole-model decision again, overwriting the cached ones
    refresh: bool = False
    #: (with ``measure``) a plan stored in the cost cache for this very model (its code,
    #: modules, parameters' shapes and formats, inputs' signature, options) is rebuilt and
    #: verified again, nothing captured or measured (``memlayout.plan.reuse``); ``False``: plan
    #: it again from the cached costs
    reuse: bool = True
    #: ``progress(done, total, what)``, called while measuring
    progress: Progress | None = field(default=None, compare=False, repr=False)
    #: the name the plan gives the model (``None``: its class name)
    name: str | None = None
    #: (with ``measure``) the plan timed as a whole model against the model run all NCHW and
    #: all NHWC for ``guard_rounds`` interleaved rounds, kept unless one is faster by more
    #: than ``guard_margin`` (``plan.guard``)
    guard: bool = True
    guard_rounds: int = 5
    guard_margin: float = KEEP_MARGIN
    #: plan a training step: costs forward + backward, verification through one step's
    #: outputs, gradients and running statistics; gradients come back in their parameters'
    #: strides
    train: bool = False
    #: nodes owning rank-4/5 parameters run in the parameters' formats
    keep_weight_formats: bool = False
    #: ``"converted"`` (once, to their node's format) or ``"contiguous"``: every parameter
    #: stays contiguous (FSDP's ``fully_shard``)
    weights: str = CONVERTED
    #: a call with another input shape signature is planned on first sight and cached, at
    #: most this many plans held (``optimized.memlayout.plans``)
    max_plans: int = 8
    #: ``plan.memory`` reports peak activation memory
    memory: bool = True
    #: bytes, or a string with a unit (``"300MB"``): the fastest plan whose peak fits
    memory_budget: int | str | None = None
    #: channel counts padded to the vector width where that measures faster
    padding: bool = True
    #: mkldnn blocked chains timed and reported, never applied
    blocked: bool = False
    #: a plan that fails verification gives way to the model run in one format (the faster
    #: first), verified the same way, with a warning and a note; ``False`` raises
    fallback: bool = True
    #: random masks drawn as the original draws them under the same seed: each element-wise
    #: dropout whose activation the plan lays out otherwise runs on a copy in the original's
    #: format (``memlayout.plan.steer.draws``); ``False``: drawn in the plan's layout (other,
    #: equally random elements), with a warning naming those dropouts
    same_draws: bool = False

    def __post_init__(self) -> None:
        _autocast_dtype(self.dtype)
        _input_label(self.input_format)
        _output_label(self.output_format)
        if not isinstance(self.max_plans, int) or self.max_plans < 1:
            raise PlanError(f"max_plans must be an int >= 1 (the example's plan is always held), "
                            f"got {self.max_plans!r}; 1 plans every other shape at each call")
        if self.weights not in WEIGHTS:
            raise PlanError(f"weights must be one of {', '.join(map(repr, WEIGHTS))}, got "
                            f"{self.weights!r}; 'contiguous' keeps every parameter contiguous "
                            "(FSDP)")
        budget_bytes(self.memory_budget)

    @classmethod
    def of(cls, options: PlanOptions | None, overrides: Mapping[str, Any], *,
           caller: str = "optimize", also: tuple[str, ...] = ()) -> PlanOptions:
        """``options`` (default: the defaults) with ``overrides`` (option names) replaced; a
        ``TypeError`` for a name that is no option, as for any bad keyword (``also``: the
        caller's other keywords, named in that message)."""
        if options is not None and not isinstance(options, cls):
            raise PlanError(f"options must be a memlayout PlanOptions, got "
                            f"{type(options).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in overrides if k not in names]
        if unknown:
            raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}; "
                            f"it takes {', '.join((*also, 'options', *names))}")
        base = options if options is not None else cls()
        return dataclasses.replace(base, **overrides) if overrides else base


@dataclass(frozen=True)
class RunOptions:
    """What every step of one planning run needs to know: :class:`PlanOptions` resolved once
    (:func:`run_options`) against the model and its example: device, autocast dtype, train or
    inference, planned ranks, input and output labels."""

    name: str
    device: torch.device
    dtype: torch.dtype | None  # the autocast dtype; ``None``: run as is (fp32)
    train: bool
    ranks: tuple[int, ...]  # the layout ranks planned (3 only for a model with 1-d convolutions)
    input_label: Label | None  # the format inputs arrive in; ``None``: as the example is
    auto_input: bool  # input_format="auto": the plan chooses the inputs' format
    output_label: Label | Request | None  # ``Request.KEEP``, a label, or ``None`` (free)
    measure: bool = True
    predict: bool = False  # time only what could change the plan, predict the rest
    rounds: int = 5
    cache: bool | str | Path = True
    refresh: bool = False
    reuse: bool = True
    guard: bool = True
    guard_rounds: int = 5
    guard_margin: float = KEEP_MARGIN
    keep_weight_formats: bool = False
    contiguous_weights: bool = False  # every parameter stays contiguous (FSDP's fully_shard)
    max_plans: int = 8
    memory: bool = True
    memory_budget: int | None = None
    padding: bool = True
    blocked: bool = False
    fallback: bool = True  # a plan that fails verification gives way to a verified eager one
    same_draws: bool = False  # dropout masks drawn in the original's format (steer.draws)
    keywords: bool = False  # the model takes keyword inputs: the steps call its KeywordCall
    progress: Progress | None = field(default=None, compare=False, repr=False)

    @property
    def root_input_label(self) -> Label | Request | None:
        """What the top-level graph's inputs are formulated with: ``Request.AUTO``, a label,
        or ``None`` (as captured)."""
        return Request.AUTO if self.auto_input else self.input_label

    @property
    def signature_extra(self) -> list[Any]:
        """The options a cached whole-model measurement depends on."""
        return [self.root_input_label, self.output_label, *(["train"] if self.train else []),
                *([f"weights={self.weights}"] if self.contiguous_weights else [])]

    @property
    def weights(self) -> str:
        """How weights are stored: ``"converted"`` (once, to their node's format) or
        ``"contiguous"`` (``memlayout.plan.weights``)."""
        return "contiguous" if self.contiguous_weights else "converted"


def run_options(options: PlanOptions, model: nn.Module, inputs: tuple[Any, ...], *,
                keywords: bool = False) -> RunOptions:
    """``options`` resolved against ``model`` and its example ``inputs``: the device read from
    the example, the layout ranks from the model, names parsed into dtypes and labels
    (``keywords``: the model is called through its ``KeywordCall``)."""
    auto_input = _auto(options.input_format)
    return RunOptions(
        name=options.name or type(model).__name__, device=device_of(inputs, model),
        dtype=_autocast_dtype(options.dtype), train=options.train, ranks=planned_ranks(model),
        input_label=_input_label(options.input_format), auto_input=auto_input,
        output_label=_output_label(options.output_format), measure=options.measure,
        predict=options.predict,
        rounds=options.rounds, cache=options.cache, refresh=options.refresh,
        reuse=options.reuse,
        guard=options.guard, guard_rounds=options.guard_rounds,
        guard_margin=options.guard_margin, keep_weight_formats=options.keep_weight_formats,
        contiguous_weights=options.weights == CONTIGUOUS, max_plans=options.max_plans,
        memory=options.memory, memory_budget=budget_bytes(options.memory_budget),
        padding=options.padding, blocked=options.blocked, fallback=options.fallback,
        same_draws=options.same_draws, keywords=keywords, progress=options.progress)


def budget_bytes(budget: int | float | str | None) -> int | None:
    """A budget in bytes from an int or a string with a unit (``"300MB"``, ``"1.5GiB"``).

    >>> budget_bytes("1.5KiB"), budget_bytes(2_000), budget_bytes(None)
    (1536, 2000, None)
    """
    if budget is None:
        return None
    if isinstance(budget, (int, float)) and not isinstance(budget, bool) and budget > 0:
        return int(budget)
    if isinstance(budget, str):
        text = budget.strip().replace(" ", "")
        units = {"gib": 2**30, "mib": 2**20, "kib": 2**10, "gb": 10**9, "mb": 10**6,
                 "kb": 10**3, "b": 1, "": 1}
        for unit in sorted(units, key=len, reverse=True):
            if text.lower().endswith(unit):
                number = text[: len(text) - len(unit)] if unit else text
                try:
                    value = float(number)
                except ValueError:
                    break
                if value > 0:
                    return int(value * units[unit])
                break
    raise PlanError(f"memory_budget {budget!r} is not a positive number of bytes; give an int "
                    "or a string such as '300MB' or '1.5GiB'")


def _autocast_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    try:
        return dtypes.parse_dtype(dtype)
    except DtypeError as exc:
        raise PlanError(f"optimize: {exc}") from None


def _auto(input_format: str | Format | None) -> bool:
    return isinstance(input_format, str) and input_format.strip().lower() == Request.AUTO


def _input_label(input_format: str | Format | None) -> Label | None:
    return None if _auto(input_format) else format_label(input_format, "input_format")


def _output_label(output_format: str | Format | None) -> Label | Request | None:
    if output_format == Request.KEEP:
        return Request.KEEP
    return format_label(output_format, "output_format")


__all__ = ["PlanOptions", "Progress", "RunOptions", "budget_bytes",
           "run_options"]
