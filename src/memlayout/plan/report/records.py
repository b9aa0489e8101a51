"""The records a plan is made of (L2 plan, report): what each node runs in, what is converted,
and the records of the checks around it (verification, guard, memory, padding, mkldnn,
compile). Every record is a frozen dataclass that ``decode`` reads back from its JSON.

>>> v = Verification(True, DTYPE_TOLERANCE, 0.0, 1e-3, 1)
>>> decode(Verification, dataclasses.asdict(v)) == v
True
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from memlayout.errors import PlanError
from memlayout.machine import Conditions
from memlayout.plan.runners import Runner
from memlayout.timing import Ratio

SCHEMA = 1  # the version of the plan's JSON
AUTOCAST_DTYPES = ("float16", "bfloat16", "float32", "float64")  # Plan.dtype names
UNPADDED = "unpadded"  # a padding candidate's variant name when left as is

#: how a verification passed: every value within the dtype's tolerance, or (a training step)
#: beyond it only by rounding, which the same two models run in float64 agree on
DTYPE_TOLERANCE = "dtype tolerance"
FLOAT64_RECHECK = "float64 re-check"


class Record:
    """A plan record: a frozen dataclass that JSON stores as its ``dataclasses.asdict`` form."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        """The record from its ``dataclasses.asdict`` form (as JSON stores it)."""
        return decode(cls, data)


def decode(tp: Any, value: Any, where: str = "") -> Any:
    """``value`` (parsed JSON) as the type ``tp`` says: dataclasses, named tuples, enums
    (by value), tuples, dicts and lists rebuilt field by field; unknown keys ignored (a field
    appended later with a default loads from a plan written without it). A value that does
    not fit raises ``PlanError`` naming the field (``where``), what it expected and what it
    got; an absent record (``None`` at the top) is ``None``.

    >>> decode(tuple[int, ...], [1, 2]), decode(dict[str, Conditions], {})
    ((1, 2), {})
    >>> decode(list[int], [1, "2"], "plan.sizes")
    Traceback (most recent call last):
    ...
    memlayout.errors.PlanError: plan.sizes[1]: expected int, got '2' (str)
    """
    if value is None and not where:
        return None
    return _decode(tp, value, where or type_name(tp))


def _decode(tp: Any, value: Any, where: str) -> Any:
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            if len(args) < len(typing.get_args(tp)):
                return None
            raise _mismatch(where, tp, value)
        errors = []
        for a in args:
            try:
                return _decode(a, value, where)
            except PlanError as exc:
                errors.append(exc)
        raise errors[0] if len(args) == 1 else _mismatch(where, tp, value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            if isinstance(value, bool):
                raise ValueError(value)
            return tp(value)
        except ValueError:
            raise _mismatch(where, tp, value) from None
    if isinstance(tp, type) and issubclass(tp, tuple) and hasattr(tp, "_fields"):  # NamedTuple
        names = tp._fields
        if not isinstance(value, list) or len(value) != len(names):
            raise _mismatch(where, tp, value)
        hints = _hints(tp)
        return tp(*(_decode(hints[n], x, f"{where}.{n}")
                    for n, x in zip(names, value, strict=True)))
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, dict):
            raise _mismatch(where, tp, value)
        hints = _hints(tp)
        missing = [f.name for f in dataclasses.fields(tp) if f.name not in value and f.init
                   and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            name = missing[0]
            raise PlanError(f"{where}: missing field {name!r} ({type_name(hints[name])}) of "
                            f"{tp.__name__}; the plan is truncated or not a memlayout plan")
        return tp(**{f.name: _decode(hints[f.name], value[f.name], f"{where}.{f.name}")
                     for f in dataclasses.fields(tp) if f.name in value and f.init})
    if origin is dict:
        if not isinstance(value, dict):
            raise _mismatch(where, tp, value)
        _, v = typing.get_args(tp)
        return {k: _decode(v, x, f"{where}[{k!r}]") for k, x in value.items()}
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise _mismatch(where, tp, value)
        args = typing.get_args(tp)
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            items = [_decode(args[0], x, f"{where}[{i}]") for i, x in enumerate(value)]
            return items if origin is list else tuple(items)
        if len(args) != len(value):
            raise _mismatch(where, tp, value)
        return tuple(_decode(a, x, f"{where}[{i}]")
                     for i, (a, x) in enumerate(zip(args, value, strict=True)))
    if tp is float:  # JSON writes 1.0 as 1.0, but a hand-edited plan may say 1
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _mismatch(where, tp, value)
    if tp in (int, str, bool):
        if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
            return value
        raise _mismatch(where, tp, value)
    return value


@functools.cache
def _hints(tp: type) -> dict[str, Any]:
    """A record type's field types, resolved once (a stored plan holds thousands of records)."""
    return typing.get_type_hints(tp)


def type_name(tp: Any) -> str:
    """How a field's type reads in an error: ``int``, ``list[NodeChoice]``, ``str | None``."""
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "").replace("memlayout.plan.report.records.", "").replace(
        "memlayout.machine.", "").replace("NoneType", "None")


def _mismatch(where: str, tp: Any, value: Any) -> PlanError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return PlanError(f"{where}: expected {type_name(tp)}, got {shown} ({type(value).__name__})")


@dataclass(frozen=True)
class Verification(Record):
    """How the planned model was checked against the original: which check passed
    (``DTYPE_TOLERANCE`` or, beyond it, ``FLOAT64_RECHECK``), the worst relative
    error in the run dtype against the tolerance, how many tensors were compared."""

    ok: bool
    check: str
    max_error: float  # worst error relative to the reference's scale, in the run's dtype
    tolerance: float  # the dtype's relative tolerance
    tensors: int
    train: bool = False  # one training step (outputs, gradients, buffers), else one forward
    float64_error: float | None = None  # the float64 re-check's worst error, when it ran
    seconds: float = 0.0
    #: tensors and parameters of the semantic checks: two calls from the caller's state
    #: (second output, inputs and buffers after), parameter names, ties, requires_grad
    semantics: int = 0
    #: the modules whose dropout masks the planned model draws in another memory order than
    #: the original (``"path (Class)"``): compared with masks drawn in logical order, they
    #: drop other (equally random) elements at run time under the same seed
    redrawn: list[str] = field(default_factory=list)
    #: with ``same_draws``, where the plan redraws: the format the original draws each
    #: element-wise mask in (call order), which the planned model then draws in too
    draws: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line: what was compared and which check passed, with its figures."""
        what = ("over one training step on the example input: outputs, gradients, buffers "
                f"({self.tensors} tensors" if self.train else
                f"on the example input ({self.tensors} output tensors")
        also = ("; and over two calls from the caller's state: second output, inputs and "
                "buffers after them, parameters (names, ties, requires_grad)"
                if self.semantics else "")
        if self.check == FLOAT64_RECHECK:
            return (f"verification: equal to the original {what}) by the float64 re-check: in "
                    f"float64 the two models differ by {self.float64_error:.2g}; in the run "
                    f"dtype the worst relative error is {self.max_error:.2g}, above the "
                    f"tolerance {self.tolerance:g} (rounding: channels-last kernels accumulate "
                    f"in another order){also}")
        return (f"verification: equal to the original {what}) within the dtype tolerance: "
                f"worst relative error {self.max_error:.2g}, tolerance {self.tolerance:g}{also}")


@dataclass(frozen=True)
class Price(Record):
    """What making the plan cost: wall seconds (``time.perf_counter``) per planning step and
    in all (``total``, from the call to the plan), and how many costs (layout nodes and
    conversions) were timed or read from the cost cache. A step run twice (costs the guard
    found suspect, measured again) counts both runs; ``None``: the step did not run.

    >>> p = Price(total=3.0, capture=0.5, costs=2.0, measured=10, cached=4, solve=0.1,
    ...           guard=0.2, verify=0.1)
    >>> p.steps
    {'capture': 0.5, 'costs': 2.0, 'solve': 0.1, 'guard': 0.2, 'verify': 0.1}
    >>> round(p.other, 3)  # between the steps: copies, building the plan's record
    0.1
    """

    total: float
    capture: float  # tracing the model, one real run recording every value's strides
    costs: float  # timing layout nodes and conversions, or reading them from the cache
    measured: int  # costs timed here (identical ops timed once)
    cached: int  # costs read from the cache
    solve: float  # the min cut
    guard: float  # steering a copy and, with the guard, timing it against one-format models
    verify: float  # the planned model against the original (a fallback's too)
    padding: float | None = None  # padded channels timed (measuring, inference)
    memory: float | None = None  # peak activation memory (and a budget's candidates)
    blocked: float | None = None  # the mkldnn report (``blocked=True``)
    #: layout nodes whose costs were predicted, not timed (``predict``; ``Plan.prediction``)
    predicted: int = 0

    @property
    def steps(self) -> dict[str, float]:
        """The seconds of each step that ran, in the order they run."""
        order = ("capture", "costs", "solve", "guard", "padding", "memory", "blocked", "verify")
        return {name: getattr(self, name) for name in order if getattr(self, name) is not None}

    @property
    def other(self) -> float:
        """Seconds of ``total`` spent outside the steps."""
        return max(0.0, self.total - sum(self.steps.values()))


@dataclass(frozen=True)
class CostPrediction(Record):
    """Where a plan's node costs came from when only what could change the cut was measured
    (``predict``; ``memlayout.plan.solve.refine``): ``measured`` layout nodes timed (now or
    from the cache), ``predicted`` ones from the analytical model fitted to this machine's
    cached timings (``memlayout.plan.costs.predict``), in at most ``passes`` rounds of
    solving and measuring per region.

    Two bounds, in seconds of the cost table's objective, of what predicting can lose against
    the plan of the measured costs, when each true cost lies in its prediction's interval:
    ``regret``, the exact worst case (one minimum cut whose adversary moves every predicted
    ``c1 - c0`` to the end of its interval that hurts the plan; refinement stops only where it
    is zero, up to rounding), and ``widths``, the sum of the predicted nodes' widths of
    ``c1 - c0`` (what the loss could be were every predicted node free to flip: a looser bound
    that ignores the cut).

    >>> CostPrediction(measured=20, predicted=12, regret=0.0, widths=1.5e-4, passes=2).predicted
    12
    """

    measured: int
    predicted: int
    regret: float
    widths: float
    passes: int


@dataclass(frozen=True)
class RatioRange(Record):
    """A :class:`memlayout.timing.Ratio` as a plan shows and stores it: the median of its
    per-round ratios (reference / candidate time in a whole-model comparison) and their range.

    >>> RatioRange.of(Ratio("planned", "all_contiguous", 1.1, (1.2, 0.9, 1.0)))
    RatioRange(median=1.0, min=0.9, max=1.2)
    """

    median: float
    min: float
    max: float

    @classmethod
    def of(cls, ratio: Ratio) -> RatioRange:
        return cls(ratio.median, ratio.min, ratio.max)


@dataclass(frozen=True)
class GuardRecord(Record):
    """The whole-model check of the plan (``memlayout.plan.check.guard``): the candidate kept, the
    per-round ratios against each candidate, and the conditions they were measured under."""

    kept: str
    margin: float
    source: str  # "measured", "cache" or "none" (the plan is the only candidate)
    rounds: int
    candidates: dict[str, RatioRange] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()  # eager formats the plan already is end to end
    errors: dict[str, str] = field(default_factory=dict)
    extended: bool = False  # a close call, timed for twice the rounds
    repeat: int = 1
    seconds: float | None = None  # measuring took (``None``: read from the cache)
    #: the machine while the ratios were measured (the busier of before and after); a cached
    #: decision measured on a busy machine is measured again, not reused
    conditions: Conditions | None = None
    planned_seconds: float | None = None  # the plan's median time per call, whole model
    spread: float | None = None  # (max - min) / median of the plan's rounds


@dataclass(frozen=True)
class MemoryCandidate(Record):
    peak: int  # bytes
    predicted: float  # seconds


@dataclass(frozen=True)
class MemoryReport(Record):
    """Peak activation memory of the planned model against the original's
    (``memlayout.plan.check.memory``), weights, and the choice under a budget."""

    method: str  # "tensor_lifetime" or "cuda_allocator"
    original: int  # peak bytes
    planned: int
    original_end: int  # bytes still held at the end (the outputs)
    planned_end: int
    parameters_original: int  # bytes of parameters and buffers
    parameters_planned: int
    budget: int | None
    chosen: str
    candidates: dict[str, MemoryCandidate] = field(default_factory=dict)
    padding_dropped: bool = False


@dataclass(frozen=True)
class PadChoice(Record):
    """One candidate convolution for padded channels: its module path, true channels,
    measured seconds per variant (``unpadded`` and each padded one; ``None`` where it failed),
    and the variant chosen."""

    module: str
    in_channels: int
    out_channels: int
    input_shape: list[int]
    input_format: str
    seconds: dict[str, float | None]
    chosen: str
    source: str  # "measured", "cache" or "forced"
    ratios: dict[str, float] | None = None  # median per-round unpadded / variant time
    #: the whole model with every chosen padding vs without: median per-round unpadded /
    #: padded time (``None``: not checked); ``reverted``: the variant chosen alone, dropped
    #: because the padded model was not faster as a whole
    whole_model: float | None = None
    reverted: str | None = None

    @property
    def saved(self) -> float:
        """Seconds per call the chosen variant saves (0 when unpadded)."""
        base = self.seconds.get(UNPADDED)
        got = self.seconds.get(self.chosen)
        return 0.0 if base is None or got is None else base - got


@dataclass(frozen=True)
class BlockedChain(Record):
    """One chain of mkldnn-capable ops timed as planned and in mkldnn tensors."""

    module: str
    children: list[str]
    input_shape: list[int]
    ops: list[str]
    source: str  # "measured" or "cache"
    seconds: dict[str, float] | None = None  # planned, mkldnn
    ratio: float | None = None  # median per-round planned / mkldnn time (> 1: mkldnn faster)
    max_error: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class BlockedReport(Record):
    """The mkldnn (blocked format) report: measured only, never applied."""

    available: bool
    note: str
    chains: tuple[BlockedChain, ...] = ()
    applied: bool = False


@dataclass(frozen=True)
class CompiledRecord(Record):
    """What ``memlayout.compile`` kept (``memlayout.plan.compilers.compiled``): the plan compiled with
    Inductor's layout optimization off, the original compiled with Inductor's own layout, or
    a peer runtime's model. ``candidates``: per-round ``baseline / candidate`` time ratios;
    ``compile_seconds``: each candidate's build (conversion, compile, first call)."""

    backend: str
    kept: str
    source: str  # "measured", "cache" or "none"
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    inductor_layout_opt: bool | None = None
    candidates: dict[str, RatioRange] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    compile_seconds: dict[str, float] = field(default_factory=dict)
    margin: float = 0.0
    rounds: int = 0
    repeat: int = 1
    reason: str = ""
    seconds: float = 0.0
    baseline: str = Runner.PLAN_COMPILED  # the candidate the ratios are taken against
    precision: dict[str, str] = field(default_factory=dict)  # what each candidate computes in
    unavailable: dict[str, str] = field(default_factory=dict)  # candidates not built, and why
    input_format: str | None = None  # the format ``prepare_inputs`` gives (None: as given)


@dataclass(frozen=True)
class NodeChoice:
    """One layout node: its region, name, op, chosen format and the cost of each format
    (seconds; ``None`` where the op fails in that format). ``timed``: measured here (or read
    from the cache), not agnostic or analytical."""

    region: str
    name: str
    op: str
    format: str
    seconds: dict[str, float | None]
    timed: bool
    #: why it returns another format when fed channels-last (``memlayout.plan.costs.drops``)
    drops: list[str] = field(default_factory=list)
    #: with contiguous weights, how it reads them channels-last (``as_is`` / ``per_call``)
    weights: str | None = None


@dataclass(frozen=True)
class Conversion:
    """One conversion of the planned model: the value converted, to which format, shapes,
    bytes, cost, and the nodes (or ``output``) it serves; where it happens: the module whose
    call converts it (``module``, ``""`` the model's own call), on the way in or out
    (``side``), at which leaves of the call's arguments or results (``leaves``: position and
    rank)."""

    region: str
    value: str
    to: str
    shapes: list[list[int]]
    nbytes: int
    seconds: float
    consumers: list[str]
    module: str = ""
    side: str = "in"
    leaves: list[list[int]] = field(default_factory=list)


CONV1D_OPS = ("Conv1d", "ConvTranspose1d")


def conv1d_notes(nodes: list[NodeChoice]) -> list[str]:
    """What the plan did with rank 3 (1-d convolutions, NCL vs NLC = channels_last_1d), from
    the measured costs: planned where NLC won, else why not (slower, or no kernel).

    >>> n = NodeChoice("", "c", "Conv1d", "contiguous", {"contiguous": 1.0, "channels_last": 1.5}, True)
    >>> conv1d_notes([n])
    ['rank 3: channels-last-1d (NLC) not beneficial here: measured slower for every 1-d convolution (NLC / NCL time 1.50-1.50); all run NCL']
    """
    convs = [n for n in nodes if n.op in CONV1D_OPS]
    if not convs:
        return []
    nlc = sum(n.format == "channels_last" for n in convs)
    timed = [n for n in convs if n.timed]
    if not timed:
        return [f"rank 3: {nlc} of {len(convs)} 1-d convolutions run NLC (channels_last_1d), "
                "by the analytical cost model (not measured)"]
    ratios = [n.seconds["channels_last"] / n.seconds["contiguous"] for n in timed
              if n.seconds.get("channels_last") and n.seconds.get("contiguous")]
    if not ratios:
        return ["rank 3: no channels-last-1d (NLC) kernel for the 1-d convolutions here "
                "(they fail or return NCL when fed NLC); all run NCL"]
    span = f"NLC / NCL time {min(ratios):.2f}-{max(ratios):.2f}"
    if min(ratios) >= 1.0 and nlc == 0:
        return ["rank 3: channels-last-1d (NLC) not beneficial here: measured slower for every "
                f"1-d convolution ({span}); all run NCL"]
    return [f"rank 3 planned: {nlc} of {len(convs)} 1-d convolutions run NLC (channels_last_1d), "
            f"measured per convolution ({span}; < 1: NLC faster)"]


@dataclass(frozen=True)
class Coverage(Record):
    """How much of the model a plan reaches: ``planned`` of the ``total`` convolution calls
    one eager forward makes (counted at dispatch) are in captured graphs; ``methods``: how
    the graphs were captured (``torch.fx``, ``torch.export``); ``eager``: (module path,
    reason) of each part left to run eagerly, unplanned."""

    planned: int
    total: int
    methods: tuple[str, ...] = ()
    eager: tuple[tuple[str, str], ...] = ()

    @property
    def fraction(self) -> float:
        return self.planned / self.total if self.total else 1.0

    def text(self, *, reasons: bool = True) -> str:
        """``planned 33 of 35 convolution calls (94 %); left eager: down.1 (reason)``: each
        reason's first line (its short form); ``reasons=False``: the paths alone."""
        head = (f"planned {self.planned} of {self.total} convolution calls "
                f"({100 * self.fraction:.0f} %)" if self.total else "no convolution calls")
        via = f" via {' + '.join(self.methods)}" if self.methods else ""
        parts = [p or "(whole model)" for p, _ in self.eager]
        if reasons:
            parts = [f"{part} ({r.splitlines()[0] if r else r})"
                     for part, (_, r) in zip(parts, self.eager, strict=True)]
        eager = ("; left eager: " + ("; " if reasons else ", ").join(parts)) if parts else ""
        return head + via + eager


