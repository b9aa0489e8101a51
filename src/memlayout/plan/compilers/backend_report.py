"""What the ``memlayout`` Dynamo backend decided, graph by graph, as plain data.

Every graph the backend compiles adds one :class:`GraphRecord` to the process's report
(``memlayout.backend_report()``), and logs one line to the ``memlayout.backend`` logger (INFO;
each convolution whose format differs from Inductor's rule at DEBUG). A record names each
convolution with its module path, the format the plan gave it, the format Inductor's own rule
(``GraphLowering.decide_layout_opt``) would have given it and the measured seconds of both:
the convolutions where the two differ. Where the guard timed Inductor's own layouts slower
than the plan with no convolution differing, the record says so: the difference then lies in
the layouts between convolutions (a concatenation's buffer, a pool's), which Inductor chooses
as it lowers the graph, not by its rule.

>>> conv = ConvolutionChoice("layer1.0.conv1", "conv2d", (8, 64, 56, 56), "contiguous",
...                          "channels_last", (1.0e-3, 2.5e-3), True)
>>> conv.differs, conv.describe()
(True, 'layer1.0.conv1 conv2d (8, 64, 56, 56): contiguous (Inductor: channels_last); measured 1 ms contiguous, 2.5 ms channels_last')
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import fx

from memlayout.plan.compilers.backend_graphs import CONVOLUTIONS, module_path, op_name
from memlayout.plan.costs.cache import CostCache
from memlayout.plan.costs.table import CostTable
from memlayout.plan.graph import LABELS, META_KEY, Label
from memlayout.plan.runners import Runner
from memlayout.timing import KEEP_MARGIN

log = logging.getLogger("memlayout.backend")


class BackendWarning(RuntimeWarning):
    """A graph the backend could not plan, or whose plan it dropped (it computed other
    values); the graph still compiles, with Inductor's own layouts."""


def open_cache(cache: bool | str | Path) -> CostCache | None:
    """The backend's cost cache (``True``: the user's, a path, ``False``: none); an unusable
    one is none, with a warning: measuring without it never stops a compile."""
    if cache is False:
        return None
    try:
        return CostCache(None if cache is True else Path(cache))
    except Exception as exc:
        warnings.warn(f"memlayout backend: cost cache unavailable ({exc}); measuring without it",
                      BackendWarning, stacklevel=3)
        return None


#: the formats a convolution's ``seconds`` are given in, in order (its labels' names)
FORMATS = (Label.CONTIGUOUS.text, Label.CHANNELS_LAST.text)


@dataclass(frozen=True)
class ConvolutionChoice:
    """One convolution of a graph: where it is (the module path, else the graph node), its
    op and input shape, the format it runs in under the plan and under Inductor's rule
    (``None``: no definite format, or no answer from this torch), its measured seconds in
    (contiguous, channels-last) (``None``: not measured, or fails in that format) and whether
    they were timed (``False``: the analytical model, ``measure=False``); ``fault``: why it
    never runs channels-last (``memlayout.plan.costs.faults``)."""

    where: str
    op: str
    shape: tuple[int, ...]
    planned: str | None
    inductor: str | None
    seconds: tuple[float | None, float | None] | None
    timed: bool
    fault: str = ""

    @property
    def differs(self) -> bool:
        """The plan and Inductor's rule put this convolution in different formats. An input
        in both (``either``: one pixel, as a squeeze-and-excitation block's, or one channel)
        differs from neither: no copy is ever made of it.

        >>> def conv(planned, inductor):
        ...     return ConvolutionChoice("c", "conv2d", (8, 32, 1, 1), planned, inductor, None, True)
        >>> [conv(p, "channels_last").differs for p in ("contiguous", "either", "channels_last")]
        [True, False, False]
        """
        return (None not in (self.planned, self.inductor) and self.planned != self.inductor
                and Label.EITHER.text not in (self.planned, self.inductor))

    def seconds_in(self, fmt: str | None) -> float | None:
        """The measured seconds in format ``fmt`` (a name of ``FORMATS``; ``None`` where not
        measured, the format fails, or ``fmt`` is none of them)."""
        if self.seconds is None or fmt not in FORMATS:
            return None
        return self.seconds[FORMATS.index(fmt)]

    def describe(self) -> str:
        rule = f" (Inductor: {self.inductor})" if self.differs else ""
        text = f"{self.where} {self.op} {self.shape}: {self.planned or 'as given'}{rule}"
        if self.seconds is not None:
            kind = "measured" if self.timed else "estimated"
            parts = [f"{_ms(self.seconds_in(fmt))} {fmt}" for fmt in FORMATS]
            text += f"; {kind} " + ", ".join(parts)
        return text + (f"; never channels-last: {self.fault}" if self.fault else "")


def convolution_nodes(gm: fx.GraphModule, table: CostTable, labels: Mapping[str, Label],
                      rule: bool | None) -> list[tuple[str, ConvolutionChoice]]:
    """Each convolution's node name and choice: planned label, Inductor's (channels-last for a
    2-d one when its rule is on, else the strides as traced) and measured seconds."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or op_name(n) not in CONVOLUTIONS or not n.args:
            continue
        source = n.args[0]
        meta = source.meta.get(META_KEY) if isinstance(source, fx.Node) else None
        if meta is None or not meta.tensors:
            continue
        shape = meta.tensors[0].shape
        traced = meta.label if meta.label in LABELS else None
        planned = labels.get(n.name, traced)
        inductor = (None if rule is None
                    else Label.CHANNELS_LAST if rule and len(shape) == 4 else traced)
        cost = table.nodes.get(n.name)
        out.append((n.name, ConvolutionChoice(
            module_path(n), op_name(n), tuple(shape), label_text(planned, meta.label), label_text(inductor),
            cost.seconds if cost is not None else None, bool(cost and cost.timed),
            table.faults.get(n.name, ""))))
    return out


def label_text(label: Label | None, traced: Any = None) -> str | None:
    """A label's format name (``None``: no definite format; ``either`` where the traced
    value is ambiguous)."""
    if label is None:
        return Label.EITHER.text if traced is Label.EITHER else None
    return Label(label).text


@dataclass(frozen=True)
class GraphRecord:
    """One graph Dynamo handed to the backend and what became of it.

    ``graph``: Dynamo's compile id (``frame/recompile``); ``planned``: whether a plan was made
    (``reason`` says why not); ``ran``: what runs it, a ``Runner``: ``"planned+inductor"``
    (the plan compiled, Inductor's layout optimization off), ``"planned"`` (the plan run eagerly:
    ``inner="eager"``, or it measured faster), ``"inductor"`` (Inductor's own layouts: not
    planned, a plan dropped, or they measured faster), ``"eager (as given)"`` (the graph as
    given run eagerly: ``inner="eager"``, not planned); ``inductor_rule``: Inductor's
    whole-graph decision (``True``: channels-last for every 2-d convolution; ``None``: this
    torch cannot say); ``verification``: how the graph was checked and the worst relative
    error; ``fallback``: why the plan was dropped (a mismatch), else ``""``;
    ``converted_weights``: ``(name, bytes)`` of each parameter the plan converts on every call
    (stored in another format than it runs in; in training its gradient is converted back
    too); ``timed``: for each other way the guard timed (the plan run eagerly, Inductor's own
    layouts), the median per-round ratio of the race's reference's time (``timed_against``:
    the compiled plan, Inductor's own where the compiled plan was not built up front, or the
    way a first race kept where a later one raced the compiled plan against it) to that
    way's (above 1: that way was faster); ``racing``: the ways the guard races on the graph's
    own calls while it still does (``ran`` then names the race's reference, the way kept
    unless another is faster), ``race_calls``: the calls those races took, once they ended
    (``backend_race.CallRace``); ``plan_later``: where the compiled plan waited for the first
    race (``backend_later``), what became of it, and ``later_seconds``: what building and
    verifying it took on a later call.

    Under ``torch.distributed`` (one plan per job, ``memlayout.plan.compilers.backend_shared``):
    ``rank``: this process's rank (``None``: no process group); ``decided_by``: the rank that
    measured and decided the graph (this one, or its device kind's deciding rank, whose
    costs, verdict and guard timings the record then shows; ``None``: this rank compiled the
    graph without a shared plan, ``reason`` says why); ``measured`` and ``cached`` count this
    process's own measurements. ``digest``: a short hash of what runs (the graph, the plan's
    labels, how it runs; ``backend_shared.plan_digest``): ranks whose digests agree run the
    same program for the graph."""

    graph: str
    train: bool
    dtype: str
    dynamic: bool
    planned: bool
    ran: Runner
    reason: str = ""
    inductor_rule: bool | None = None
    convolutions: tuple[ConvolutionChoice, ...] = ()
    conversions: int = 0
    converted_weights: tuple[tuple[str, int], ...] = ()
    measured: int = 0
    cached: int = 0
    verification: str = ""
    max_error: float | None = None
    fallback: str = ""
    timed: tuple[tuple[str, float], ...] = ()
    plan_seconds: float = 0.0
    compile_seconds: float = 0.0  # everything after planning: compiling, verifying, guarding
    verify_seconds: float = 0.0  # of compile_seconds: the verification
    verify_alongside: float = 0.0  # of verify_seconds: alongside Inductor's compile
    guard_seconds: float = 0.0  # of compile_seconds: the guard (its compiles and timing)
    own_compile_seconds: float | None = None  # Inductor's own layouts compiled for the guard
    racing: tuple[str, ...] = ()
    race_calls: int = 0
    plan_later: str = ""
    later_seconds: float = 0.0  # on a later call: the compiled plan built and verified
    timed_against: str = Runner.PLAN_COMPILED.value
    rank: int | None = None
    decided_by: int | None = None
    digest: str = ""

    @property
    def differing(self) -> tuple[ConvolutionChoice, ...]:
        """The convolutions whose planned format differs from Inductor's rule."""
        return tuple(c for c in self.convolutions if c.differs)

    @property
    def own_layouts_slower(self) -> float | None:
        """How many times the compiled plan's time Inductor's own layouts took in the guard's
        timing, where they were slower by more than ``KEEP_MARGIN`` (``None``: not timed,
        or not that much slower)."""
        ratio = (dict(self.timed).get(Runner.INDUCTOR_OWN)
                 if self.timed_against == Runner.PLAN_COMPILED else None)
        slower = 1 / ratio if ratio else None
        return slower if slower is not None and slower > 1 + KEEP_MARGIN else None

    def own_layouts_line(self) -> str | None:
        """What the guard's timing of Inductor's own layouts says, where they were slower."""
        slower = self.own_layouts_slower
        if slower is None:
            return None
        where = ("the convolutions above differ from its rule; layouts between convolutions "
                 "may differ too" if self.differing else
                 "every convolution runs in the format its rule gives, so the difference lies "
                 "in the layouts between convolutions (a concatenation's buffer, a pool's, an "
                 "elementwise op's)")
        return (f"Inductor's own layouts took {slower:.3g}x the compiled plan's time: {where}; "
                "a per-kernel profile of both names the kernel "
                "(torch._inductor.config.cpp.enable_kernel_profile on the CPU)")

    def job_line(self) -> str | None:
        """Which rank measured and decided the graph, and the plan's digest (``None``: no
        process group)."""
        if self.rank is None:
            return None
        if self.decided_by is None:
            return (f"rank {self.rank}: plan {self.digest}, compiled without a shared plan, "
                    f"ran by {self.ran}")
        if self.decided_by == self.rank:
            return (f"rank {self.rank}: plan {self.digest}, decided here ({self.measured} "
                    f"costs timed, {self.cached} from the cache), shared with the ranks of its "
                    "device kind")
        return (f"rank {self.rank}: plan {self.digest}, decided by rank {self.decided_by} "
                "(its costs, verdict and timings; nothing measured here)")

    def headline(self) -> str:
        task = "train" if self.train else "infer"
        shapes = ", dynamic shapes (planned at the example's sizes)" if self.dynamic else ""
        head = f"graph {self.graph} ({task}, {self.dtype}{shapes}): "
        if not self.planned:
            return head + f"not planned ({self.reason}); ran by {self.ran}"
        cl = sum(c.planned == "channels_last" for c in self.convolutions)
        rule = {True: "channels_last for every 2-d convolution", False: "strides as traced",
                None: "unknown"}[self.inductor_rule]
        weights = ""
        if self.converted_weights:
            megabytes = sum(size for _, size in self.converted_weights) / 1e6
            weights = (f" ({len(self.converted_weights)} of them weights, {megabytes:.3g} MB, "
                       f"converted on every call{' and back' if self.train else ''})")
        text = (f"{head}{cl} of {len(self.convolutions)} convolutions channels_last, "
                f"{self.conversions} conversions{weights}, {len(self.differing)} differ from "
                f"Inductor's rule ({rule}); ran by {self.ran}")
        if self.fallback:
            text += f"; plan dropped: {self.fallback}"
        elif self.max_error is not None:
            text += f"; verified ({self.verification}, worst relative error {self.max_error:.2g})"
        elif self.verification:
            text += f"; {self.verification}"
        if self.racing:
            text += (f"; racing {', '.join(self.racing)} on its calls ({self.ran} kept "
                     "unless another is faster)")
        if self.timed:
            whose = _WHOSE.get(self.timed_against, f"{self.timed_against}'s")
            text += f"; {whose} time over " + ", ".join(
                f"{how}'s {ratio:.3g}" for how, ratio in self.timed)
        if self.race_calls:
            text += f" (raced on its first {self.race_calls} calls)"
        if self.plan_later:
            text += f"; {self.plan_later}"
        return text


@dataclass(frozen=True)
class BackendReport:
    """Every graph the backend compiled in this process (or since the last ``clear``)."""

    graphs: tuple[GraphRecord, ...]

    @property
    def differing(self) -> tuple[tuple[str, ConvolutionChoice], ...]:
        """``(graph, convolution)`` for every convolution whose format differs from Inductor's
        rule."""
        return tuple((g.graph, c) for g in self.graphs for c in g.differing)

    def price(self) -> str:
        """What the backend spent on these graphs, step by step (planning: capture and costs;
        compiling; verifying, part of it on a thread of its own while Inductor compiled;
        guarding: its compiles and timing), and, for the graphs whose
        guard compiled Inductor's own layouts too, what that compile alone took: what
        ``torch.compile`` spends on them.

        >>> r = GraphRecord("0/0", False, "fp32", False, True, Runner.PLAN_COMPILED,
        ...                 plan_seconds=2.0, compile_seconds=9.0, verify_seconds=1.0,
        ...                 guard_seconds=5.0, own_compile_seconds=3.0, measured=4)
        >>> BackendReport((r,)).price()
        'price: 11.0 s: planning 2.0 s (4 costs timed, 0 cached), compiling 3.0 s, verifying 1.0 s, guarding 5.0 s; torch.compile alone: 3.0 s for 1 of 1 graphs (the backend: 11.0 s for them)'
        >>> beside = GraphRecord("0/0", False, "fp32", False, True, Runner.PLAN_COMPILED,
        ...                      plan_seconds=2.0, compile_seconds=9.0, verify_seconds=1.0,
        ...                      verify_alongside=1.0, guard_seconds=5.0, measured=4)
        >>> BackendReport((beside,)).price()
        "price: 11.0 s: planning 2.0 s (4 costs timed, 0 cached), compiling 4.0 s, verifying 1.0 s (1.0 s of it alongside Inductor's compile), guarding 5.0 s"
        """
        g = self.graphs
        plan = sum(r.plan_seconds for r in g)
        verify, guard = sum(r.verify_seconds for r in g), sum(r.guard_seconds for r in g)
        beside = sum(r.verify_alongside for r in g)
        compile_seconds = sum(r.compile_seconds for r in g)
        compiling = compile_seconds - (verify - beside) - guard
        text = (f"price: {plan + compile_seconds:.1f} s: planning {plan:.1f} s "
                f"({sum(r.measured for r in g)} costs timed, {sum(r.cached for r in g)} cached), "
                f"compiling {compiling:.1f} s, verifying {verify:.1f} s"
                + (f" ({beside:.1f} s of it alongside Inductor's compile)" if beside >= 0.05
                   else "")
                + f", guarding {guard:.1f} s")
        known = [r for r in g if r.own_compile_seconds is not None]
        if known:
            own = sum(r.own_compile_seconds or 0.0 for r in known)
            ours = sum(r.plan_seconds + r.compile_seconds for r in known)
            text += (f"; torch.compile alone: {own:.1f} s for {len(known)} of {len(g)} graphs "
                     f"(the backend: {ours:.1f} s for them)")
        if later := [r for r in g if r.later_seconds]:
            text += (f"; on later calls, the compiled plan built and verified for {len(later)} "
                     f"graphs: {sum(r.later_seconds for r in later):.1f} s")
        return text

    def render(self) -> str:
        """The report as text: the price, a headline per graph, then each differing
        convolution."""
        if not self.graphs:
            return "memlayout backend: no graph compiled yet"
        lines = [f"memlayout backend: {len(self.graphs)} graphs", self.price()]
        for g in self.graphs:
            lines.append(g.headline())
            if (job := g.job_line()) is not None:
                lines.append("  " + job)
            lines.extend("  " + c.describe() for c in g.differing)
            if (own := g.own_layouts_line()) is not None:
                lines.append("  " + own)
            if g.converted_weights:
                lines.append("  weights stored in another format than the plan runs them in, "
                             "converted on every call (a model stored channels-last before "
                             "torch.compile, model.to(memory_format=torch.channels_last), hands "
                             "over channels-last weights, and is planned with them): "
                             + ", ".join(name for name, _ in g.converted_weights))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


def guard_seconds(record: dict[str, Any], spent: Mapping[str, float], seconds: float, *,
                  own_first: bool) -> None:
    """The guard's part of ``seconds`` (the time since the guard began) put in ``record``
    (a ``GraphRecord``'s fields), with what ``spent`` says its steps took: the verification
    (``spent["verify"]``: the eager plan's, inside the guard) and, where Inductor's own is
    the race's reference (``own_first``: its verification, less what ran alongside its
    compile, came after the guard began), Inductor's own compile
    (``spent[Runner.INDUCTOR_OWN]``), are the graph's, not the guard's.

    >>> record = {"verify_seconds": 3.0, "verify_alongside": 2.0}
    >>> guard_seconds(record, {Runner.INDUCTOR_OWN: 5.0}, 9.0, own_first=True)
    >>> record["guard_seconds"], record["own_compile_seconds"], record["verify_seconds"]
    (3.0, 5.0, 3.0)
    """
    verified = (record["verify_seconds"] - record.get("verify_alongside", 0.0) if own_first
                else spent.get("verify", 0.0))
    record["verify_seconds"] += spent.get("verify", 0.0)
    record["guard_seconds"] = (seconds - verified
                               - (spent[Runner.INDUCTOR_OWN] if own_first else 0.0))
    record["own_compile_seconds"] = spent.get(Runner.INDUCTOR_OWN)


class _Records:
    """The process's report: appended by every backend call, read by ``backend_report``.
    It records only; nothing reads it to decide anything."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._graphs: list[GraphRecord] = []

    def add(self, record: GraphRecord) -> None:
        with self._lock:
            self._graphs.append(record)
        log.info("%s", record.headline())
        if (job := record.job_line()) is not None:
            log.info("  %s", job)
        for c in record.differing:
            log.debug("  %s", c.describe())

    def update(self, graph: str, change: Callable[[GraphRecord], GraphRecord]) -> None:
        """Replace the last record of ``graph`` by ``change`` of it (a race on its calls
        ended); nothing where none is left (the report was cleared)."""
        with self._lock:
            for i in reversed(range(len(self._graphs))):
                if self._graphs[i].graph == graph:
                    self._graphs[i] = record = change(self._graphs[i])
                    break
            else:
                return
        log.info("%s", record.headline())

    def report(self, *, clear: bool = False) -> BackendReport:
        with self._lock:
            out = BackendReport(tuple(self._graphs))
            if clear:
                self._graphs.clear()
        return out


RECORDS = _Records()


def backend_report(*, clear: bool = False) -> BackendReport:
    """What the ``memlayout`` backend decided for every graph it compiled in this process;
    ``clear``: start a new report after this one.

    >>> backend_report().graphs is not None
    True
    """
    return RECORDS.report(clear=clear)


#: how a headline names the race's reference, whose time the ratios divide
_WHOSE = {Runner.PLAN_COMPILED.value: "compiled plan's",
          Runner.INDUCTOR_OWN.value: "Inductor's own layouts'"}


def _ms(seconds: float | None) -> str:
    return "fails" if seconds is None else f"{seconds * 1e3:.3g} ms"


__all__ = ["BackendReport", "BackendWarning", "ConvolutionChoice", "GraphRecord",
           "backend_report", "guard_seconds", "open_cache"]
