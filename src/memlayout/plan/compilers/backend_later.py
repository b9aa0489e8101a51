"""The compiled plan built on a later call, where it can still win (the ``torch.compile``
backend, ``backend.py``).

A graph whose plan differs from Inductor's rule has two compiled ways: the plan compiled,
and Inductor's own layouts (what ``torch.compile`` alone runs, the way a plan must never be
slower than). Built and verified before the first call returns, the two cost that call a
second compile of the graph and a verification of each. Racing on the graph's calls, the
backend builds neither up front: Inductor's own, compiled as ``torch.compile`` compiles it,
races the plan run eagerly (verified) on the first calls
(``backend_inner.own_against_eager``). When that race ends, its times and the plan's costs
say whether the compiled plan can still win: at best it takes Inductor's own time less what
its convolutions save in the plan's formats (``backend_plan.convolution_gain``; the
conversions it adds only cost). Only where that beats the way kept by more than the margin
is it compiled and verified, on the next call, and raced against the way kept on the calls
after (``CallRace``). Otherwise nothing more is compiled, and the graph's record says what
it could at best have saved: the bound on what leaving it unbuilt can cost.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from memlayout.plan.compilers.backend_check import GraphCheck, guard_key
from memlayout.plan.compilers.backend_graphs import copy_graph
from memlayout.plan.compilers.backend_inner import (
    WAYS,
    alongside,
    built_and_checked,
    known_decision,
    overlaps,
    own_against_eager,
    unplanned,
)
from memlayout.plan.compilers.backend_plan import Planned, inductor_runs_a_fault
from memlayout.plan.compilers.backend_race import CallRace, decided_here
from memlayout.plan.compilers.backend_report import RECORDS, BackendWarning, GraphRecord
from memlayout.plan.runners import Runner
from memlayout.timing import KEEP_MARGIN, Race

if TYPE_CHECKING:
    from memlayout.plan.compilers.backend import Backend
    from memlayout.plan.costs.cache import CostCache


def best_case(race: Race | None, kept: str, gain: float | None) -> tuple[float, float] | None:
    """From a race of Inductor's own (its reference) against the plan run eagerly, and the
    seconds the plan's convolutions save (``gain``): the compiled plan's seconds per call at
    best, and the way ``kept``'s (``None``: no race times or no gain to go by).

    >>> from memlayout.timing import Ratio
    >>> race = Race("inductor", {"planned": Ratio("inductor", "planned", 2.0, (2.0,))}, rounds=1,
    ...             reference_seconds=1.0)
    >>> best_case(race, "planned", 0.25), best_case(race, "inductor", None)
    ((0.75, 0.5), None)
    """
    if race is None or gain is None or not race.reference_seconds:
        return None
    own = race.reference_seconds
    return own - gain, own / race.median(kept)


def could_win(best: tuple[float, float] | None, margin: float = KEEP_MARGIN) -> bool:
    """Whether a way that takes ``best[0]`` seconds at best would be kept over one taking
    ``best[1]`` (faster by more than ``margin``, as ``Race.kept`` keeps a candidate).

    >>> could_win((0.75, 1.0)), could_win((0.75, 0.5)), could_win(None)
    (True, False, False)
    """
    return best is not None and best[0] * (1.0 + margin) < best[1]


def later_note(best: tuple[float, float] | None, kept: str) -> str:
    """What the record says of a compiled plan left unbuilt after the race kept ``kept``.

    >>> later_note((0.75, 0.5), "planned")
    'the compiled plan not built: by its costs, at best 0.75 s a call, against 0.5 s for planned (it could not be faster)'
    >>> later_note((0.5, 0.505), "inductor")[-37:]
    '(at most 0.005 s a call lost by that)'
    """
    if best is None:
        return ("the compiled plan not built: the race on the calls gave no times to weigh "
                "its costs against")
    lost = ("it could not be faster" if best[0] >= best[1] else
            f"at most {best[1] - best[0]:.3g} s a call lost by that")
    return (f"the compiled plan not built: by its costs, at best {best[0]:.3g} s a call, "
            f"against {best[1]:.3g} s for {kept} ({lost})")


@dataclass
class LaterPlan:
    """What building and racing the compiled plan on a later call takes: the graph as
    Dynamo gave it (``gm``), the plan's graph for Inductor and its eager copy (the key of
    what it caches), the inputs, the options, the cost cache's opener (each use opens and
    closes it), how each first way was verified (``checks``), the graph's compile id and the
    seconds its convolutions save (``gain``)."""

    gm: fx.GraphModule
    graph: fx.GraphModule
    eager_graph: fx.GraphModule
    example_inputs: list[Any]
    inputs: list[Any]
    options: Backend
    opened: Callable[[], Any]
    checks: Mapping[str, GraphCheck]
    name: str
    gain: float | None
    train: bool
    dtype: torch.dtype | None
    device: torch.device

    def key(self, kept: str) -> str:
        """The cost cache's key of the race of the compiled plan against ``kept``."""
        return guard_key([kept, Runner.PLAN_COMPILED.value], self.eager_graph, self.inputs,
                         train=self.train, dtype=self.dtype, device=self.device,
                         compiled_as=self.options.compiled_as)

    def build(self, kept: str, kept_fn: Callable[..., Any]) -> Callable[..., Any] | None:
        """The compiled plan built and verified now, racing ``kept`` on the calls from the
        next (``None``: it failed to compile or its check, warned of; ``kept`` runs on)."""
        start = time.perf_counter()
        store = self.opened()
        try:
            fn, check, verifying = built_and_checked(
                self.gm, self.graph, self.eager_graph, self.example_inputs, self.inputs,
                self.options, store, train=self.train, dtype=self.dtype, device=self.device,
                compiled=True)
        finally:
            if store is not None:
                store.close()
        seconds = time.perf_counter() - start
        if fn is None or not check.ok:
            warnings.warn(f"memlayout backend: the compiled plan of graph {self.name} was "
                          f"dropped ({check.how}); {kept} runs on. Please report this with "
                          "the model", BackendWarning, stacklevel=3)
            self._note(f"the compiled plan dropped ({check.how}): {kept} runs on", seconds,
                       verifying, racing=())
            return None
        self._note(f"the compiled plan built on a later call ({seconds:.1f} s, verifying "
                   f"{verifying:.1f} s) and raced against {kept}", seconds, verifying,
                   racing=(kept, Runner.PLAN_COMPILED.value))
        checks = {kept: self.checks[kept], Runner.PLAN_COMPILED.value: check}
        return CallRace({kept: kept_fn, Runner.PLAN_COMPILED.value: fn}, reference=kept,
                        margin=KEEP_MARGIN, rounds=self.options.rounds, protect=(),
                        train=self.train, device=self.device,
                        decided=decided_here(self.name, self.key(kept), self.opened, checks),
                        warm=(kept, Runner.PLAN_COMPILED.value))

    def _note(self, text: str, seconds: float, verifying: float, *,
              racing: tuple[str, ...]) -> None:
        def change(record: GraphRecord) -> GraphRecord:
            return dataclasses.replace(record, plan_later=text, racing=racing,
                                       later_seconds=record.later_seconds + seconds,
                                       verify_seconds=record.verify_seconds + verifying)
        RECORDS.update(self.name, change)


def decided_before(first: Race, kept: str, later: LaterPlan,
                   look_up: Callable[..., Race | None]) -> tuple[str, str | None, Race, str]:
    """A cached first race (of Inductor's own against the plan run eagerly) that kept
    ``kept``, and what follows from it: the way that runs, the way the compiled plan is yet
    to race on the calls (``None``: none), the race that decided what runs, and what the
    record says of the compiled plan. ``look_up(ways=...)``: the cached race of ``ways``."""
    best = best_case(first, kept, later.gain)
    if not could_win(best):
        return kept, None, first, later_note(best, kept)
    second = look_up(ways=[kept, Runner.PLAN_COMPILED.value])
    if second is None:
        return kept, kept, first, ("the compiled plan to be built on the first call and "
                                   f"raced against {kept}")
    return (second.kept(kept, KEEP_MARGIN), None, second,
            f"the compiled plan raced against {kept} before")


def ways_of(planned: Planned, agrees: bool, later: LaterPlan, record: dict[str, Any],
            store: CostCache | None, *, on_calls: bool
            ) -> tuple[bool, list[Runner], Race | None, str | None, str | None]:
    """The ways a planned graph races, and what races the cost cache holds decided: whether
    Inductor's own races the eager plan first, on the calls (a plan that agrees with its rule
    by its costs has no other compiled way; one that differs waits: ``backend_later``),
    unless it runs a known fault channels-last (``memlayout.plan.costs.faults``); the ways;
    the cached race that decides what runs, the way it kept (``None``: race) and the way
    the compiled plan is yet to race on the calls (``None``: none)."""
    fault = inductor_runs_a_fault(planned)
    own_first = on_calls and not fault and (later.train or not agrees)
    ways = ([Runner.INDUCTOR_OWN, Runner.PLAN_EAGER] if own_first else
            [w for w in WAYS if not ((agrees or fault) and w == Runner.INDUCTOR_OWN)])
    look_up = functools.partial(known_decision, later.eager_graph, later.inputs, later.options,
                                store, train=later.train, dtype=later.dtype, device=later.device)
    known = look_up(ways=ways)
    record["timed_against"] = ways[0] if known is None else known.reference
    if known is None:
        return own_first, ways, None, None, None
    kept, pending = known.kept(Runner.PLAN_COMPILED, KEEP_MARGIN), None
    if own_first and not agrees:
        kept, pending, known, record["plan_later"] = decided_before(known, kept, later, look_up)
        record["timed_against"] = known.reference
    return own_first, ways, known, kept, pending


def first_race(later: LaterPlan, given: fx.GraphModule,
               verify: Callable[[CostCache | None], tuple[Callable[..., Any] | None,
                                                          GraphCheck, float]],
               store: CostCache | None, spent: dict[str, float], *, agrees: bool
               ) -> tuple[Callable[..., Any] | None, GraphCheck, float, float]:
    """The race on the calls of Inductor's own (``given`` compiled as ``torch.compile``
    compiles it) against the plan run eagerly, built and verified by ``verify`` (of the eager
    plan, ``backend_inner.built_and_checked``) alongside that compile where it may be
    (``backend_inner.overlaps``; on a thread of its own, with the cost cache opened for it);
    where the plan differs from Inductor's rule (not ``agrees``), the compiled plan waits for
    the race's end (:class:`PlanLater`). Returns the function (where the eager plan fails its
    check: Inductor's own alone), the eager plan's check, the seconds verifying took and
    those of them alongside the compile; ``spent[Runner.INDUCTOR_OWN]``: the compile's."""
    options, device = later.options, later.device
    together = overlaps(options, device)

    def checked() -> tuple[Callable[..., Any] | None, GraphCheck, float]:
        mine = later.opened() if together else store
        try:
            return verify(mine)
        finally:
            if together and mine is not None:
                mine.close()
    wait = alongside(checked, overlap=together)
    start = time.perf_counter()
    # a copy where the graph is the one the verification runs as its reference: Inductor
    # may change the graph it compiles
    own = unplanned(copy_graph(given) if together and given is later.gm else given,
                    later.example_inputs, options, later.dtype, device)[0]
    compiled = time.perf_counter()
    spent[Runner.INDUCTOR_OWN] = compiled - start
    eager, check, seconds = wait()
    beside = max(0.0, seconds - (time.perf_counter() - compiled)) if together else 0.0
    if eager is None or not check.ok:
        return own, check, seconds, beside
    staged = None if agrees else PlanLater(later)
    race = own_against_eager(own, eager, later.eager_graph, later.inputs, options, check,
                             later.opened, graph=later.name, train=later.train,
                             dtype=later.dtype, device=device,
                             then=staged.first_ended if staged else None)
    return (race if staged is None else staged.running(race)), check, seconds, beside


class PlanLater:
    """Dynamo's function for a graph whose compiled plan waits (the module's account):
    ``first`` runs the calls, the race of Inductor's own against the plan run eagerly
    (``CallRace``: its ``decided`` is :meth:`first_ended`), or the way a cached race kept
    (``pending``: the compiled plan, which could win, built at the first call)."""

    def __init__(self, later: LaterPlan, *, pending: str | None = None) -> None:
        self._later: LaterPlan | None = later  # let go once the compiled plan is decided
        self._pending = pending
        self._first: Callable[..., Any] | None = None
        self._fn: Callable[..., Any] | None = None
        self.ways: tuple[str, ...] = ()

    def running(self, first: Callable[..., Any]) -> PlanLater:
        """This, with ``first`` running the calls until the compiled plan is built."""
        self._first, self.ways = first, getattr(first, "ways", ())
        return self

    def first_ended(self, race: Race | None, kept: str, _calls: int) -> None:
        """The first race ended: build the compiled plan at the next call where, by its
        costs, it could beat the way kept; else say what leaving it costs at most, and run
        the way kept from the next call."""
        later = self._later
        assert later is not None, "a first race ends once"
        best = best_case(race, kept, later.gain)
        if best is not None and could_win(best):
            self._pending = kept
            text = (f"the compiled plan to be built on the next call: by its costs, at best "
                    f"{best[0]:.3g} s a call, against {best[1]:.3g} s for {kept}")
            racing: tuple[str, ...] = (kept, Runner.PLAN_COMPILED.value)
        else:
            text, racing = later_note(best, kept), ()
            self._fn, self._later = self._kept(kept), None
        RECORDS.update(later.name, lambda record: dataclasses.replace(
            record, plan_later=text, racing=racing))

    def _kept_or_race(self) -> Callable[..., Any]:
        """What runs the calls until the compiled plan is decided."""
        assert self._first is not None, "PlanLater called before it runs anything"
        return self._first

    def _kept(self, kept: str) -> Callable[..., Any]:
        """The way kept itself, not through the race that kept it."""
        first = self._kept_or_race()
        return first.way(kept) if isinstance(first, CallRace) else first

    def __call__(self, *args: Any) -> Any:
        if self._fn is not None:
            return self._fn(*args)
        if self._pending is None or self._later is None:
            return self._kept_or_race()(*args)
        kept, first = self._pending, self._kept(self._pending)
        self._fn = self._later.build(kept, first) or first
        self._later = None
        return self._fn(*args)


__all__ = ["LaterPlan", "PlanLater", "best_case", "could_win", "decided_before", "first_race",
           "later_note", "ways_of"]
