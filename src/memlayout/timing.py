"""One way to time things (L1): warm-up, interleaved rounds, medians, per-round ratios.

Every command that times anything goes through :func:`interleaved`. On a shared, noisy machine
(30 % spread between identical runs seen here) sequential timing of A then B measures the
machine's mood as much as A vs B; interleaving A B C, B C A, ... in one process and taking the
median of per-round ratios cancels most of the drift.

A fake clock can be injected, so tests know exactly what goes in and what must come out:

>>> ticks = iter([0.0, 1.0, 1.0, 3.0, 3.0, 5.0, 5.0, 6.0])  # a: 1s, b: 2s; then b: 2s, a: 1s
>>> c = interleaved({"a": lambda: None, "b": lambda: None}, rounds=2, warmup=0,
...                 clock=lambda: next(ticks))
>>> c["a"].median, c["b"].median, c.speedup("b")
(1.0, 2.0, 0.5)
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from memlayout.machine import Conditions

#: the one margin of every race that keeps a candidate: another replaces the default one (the
#: plan in ``optimize``'s guard and in the backend, Inductor's own layouts in
#: ``memlayout.compile``, the original model in a multi-rank training check) only when faster
#: by more than this in the median of per-round ratios: noise and near ties keep the default
KEEP_MARGIN = 0.02
#: a best median ratio this near the threshold ``1 + margin`` is not yet separated from it
#: (``separated``), and a single round this near it is a close call (``Race.is_close``)
CLOSE = 0.03

@dataclass(frozen=True)
class ModeTiming:
    """Per-call seconds of one mode, one value per round (in round order)."""

    name: str
    times: tuple[float, ...]
    error: str | None = None
    #: the type of the exception behind ``error``, so callers can react to a kind of failure
    #: (out of memory: retry smaller) without matching message strings
    error_type: type[BaseException] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def max(self) -> float:
        return max(self.times)

    @property
    def iqr(self) -> tuple[float, float]:
        """(25th, 75th) percentile; both equal the single value when there is one round."""
        if len(self.times) < 2:
            return (self.times[0], self.times[0])
        q = statistics.quantiles(self.times, n=4, method="inclusive")
        return (q[0], q[2])

    @property
    def spread(self) -> float:
        """(max - min) / median: the relative spread of the rounds."""
        return (self.max - self.min) / self.median if self.median > 0 else 0.0


@dataclass(frozen=True)
class Comparison:
    """Timings of several modes measured round by round in one process."""

    modes: dict[str, ModeTiming]
    baseline: str
    rounds: int
    repeat: int
    warmup: int
    order: tuple[tuple[str, ...], ...] = field(default_factory=tuple)

    def __getitem__(self, name: str) -> ModeTiming:
        return self.modes[name]

    def ratios(self, name: str) -> tuple[float, ...]:
        """Per-round speedups of ``name`` over the baseline: baseline time / mode time.

        Only rounds in which both ran count (a mode that failed mid-run stops contributing).
        """
        return self.per_round(self.baseline, name)

    def per_round(self, numerator: str, denominator: str) -> tuple[float, ...]:
        """Per-round time ratios ``numerator / denominator``, over the rounds both ran."""
        return round_ratios(self.modes[numerator].times, self.modes[denominator].times)

    def ratio(self, numerator: str, denominator: str) -> Ratio | None:
        """``numerator``'s time over ``denominator``'s (> 1: ``denominator`` is faster), as
        the ratio of the medians and per round; ``None`` when either has no round.

        >>> ticks = iter([0.0, 1.0, 1.0, 3.0, 3.0, 5.0, 5.0, 6.0])
        >>> c = interleaved({"a": lambda: None, "b": lambda: None}, rounds=2, warmup=0,
        ...                 clock=lambda: next(ticks))
        >>> r = c.ratio("b", "a")
        >>> r.of_medians, r.per_round, r.median
        (2.0, (2.0, 2.0), 2.0)
        """
        return Ratio.of_times(numerator, denominator, self.modes[numerator].times,
                              self.modes[denominator].times)

    def speedup(self, name: str) -> float | None:
        """Median of the per-round speedups (> 1: faster than the baseline); ``None`` if the
        mode or the baseline produced no rounds."""
        if not (self.modes[self.baseline].ok and self.modes[name].times):
            return None
        r = self.ratios(name)
        return statistics.median(r) if r else None

    def speedup_range(self, name: str) -> tuple[float, float] | None:
        """(min, max) of the per-round speedups."""
        r = self.ratios(name) if self.modes[self.baseline].ok else ()
        return (min(r), max(r)) if r else None


@dataclass(frozen=True)
class Ratio:
    """``numerator``'s time over ``denominator``'s: the ratio of the two medians (what agrees
    with the medians shown beside it) and the per-round ratios with their median and range."""

    numerator: str
    denominator: str
    of_medians: float
    per_round: tuple[float, ...]

    @classmethod
    def of_times(cls, numerator: str, denominator: str, top: Sequence[float],
                 bottom: Sequence[float]) -> Ratio | None:
        """The ratio of ``numerator``'s per-round times ``top`` over ``denominator``'s
        ``bottom`` (rounds paired in order); ``None`` when either has no round.

        >>> r = Ratio.of_times("b", "a", [2.0, 4.0, 2.2], [1.0, 1.0, 1.1])
        >>> r.of_medians, r.per_round, r.median, r.max
        (2.2, (2.0, 4.0, 2.0), 2.0, 4.0)
        """
        rounds = round_ratios(top, bottom)
        if not (top and bottom and rounds) or statistics.median(bottom) <= 0:
            return None
        return cls(numerator, denominator, statistics.median(top) / statistics.median(bottom),
                   rounds)

    @property
    def median(self) -> float:
        """The median of the per-round ratios (drift between rounds cancels in it)."""
        return statistics.median(self.per_round)

    @property
    def min(self) -> float:
        return min(self.per_round)

    @property
    def max(self) -> float:
        return max(self.per_round)

@dataclass(frozen=True)
class Race:
    """What an interleaved race of candidates against a ``reference`` measured: per candidate,
    the :class:`Ratio` of the reference's time over its own (> 1: the candidate is faster),
    the rounds and calls per sample (``repeat``), the candidates that failed (``errors``),
    whether a close call was timed for more rounds (``extended``), the machine's conditions
    (the busier of before and after), the reference's median seconds per call with the
    relative spread of its rounds, and the candidates whose close call counts on either side
    of the threshold (``protect``, :meth:`is_close`; ``None``: every one). It is stored as
    JSON: ``dataclasses.asdict`` out, ``memlayout.plan.report.records.decode`` back.

    >>> r = Race("planned", {"nhwc": Ratio("planned", "nhwc", 1.2, (1.1, 1.3, 1.2))}, rounds=3)
    >>> r.median("nhwc"), r.median("planned"), r.kept("planned", 0.02), r.kept("planned", 0.25)
    (1.2, 1.0, 'nhwc', 'planned')
    """

    reference: str
    ratios: dict[str, Ratio]  # numerator: the reference, denominator: the candidate
    rounds: int
    repeat: int = 1
    errors: dict[str, str] = field(default_factory=dict)
    extended: bool = False
    conditions: Conditions | None = None
    reference_seconds: float | None = None
    spread: float | None = None
    protect: tuple[str, ...] | None = None

    def median(self, name: str) -> float:
        """``name``'s median per-round ratio (the reference counts 1.0)."""
        return 1.0 if name == self.reference else self.ratios[name].median

    def min(self, name: str) -> float:
        return 1.0 if name == self.reference else self.ratios[name].min

    def max(self, name: str) -> float:
        return 1.0 if name == self.reference else self.ratios[name].max

    @property
    def speeds(self) -> dict[str, float]:
        """Every candidate that ran with its median ratio, the reference first (1.0)."""
        return {self.reference: 1.0, **{n: r.median for n, r in self.ratios.items()}}

    def beats(self, name: str, default: str, margin: float) -> bool:
        """``name`` is faster than ``default`` by more than ``margin`` (relative) in the
        median; a ``default`` that did not run counts as the reference."""
        speeds = self.speeds
        return speeds[name] > speeds.get(default, 1.0) * (1.0 + margin)

    def kept(self, default: str | None = None, margin: float = KEEP_MARGIN) -> str:
        """The candidate to keep: ``default`` (the reference when ``None`` or when it did
        not run) unless the fastest by median ratio beats it by more than ``margin``; ties go
        to the first listed, the reference first.

        >>> r = Race("planned", {"inductor": Ratio("planned", "inductor", 1.0, (0.99, 1.0, 0.985)),
        ...                      "openvino": Ratio("planned", "openvino", 0.5, (0.5, 0.5, 0.5))},
        ...          rounds=3)
        >>> r.kept("inductor", 0.02), r.kept(None, 0.02), r.kept("mkldnn", 0.02)
        ('inductor', 'planned', 'planned')
        """
        speeds = self.speeds
        default = default if default in speeds else self.reference
        best = max(speeds, key=speeds.__getitem__)
        return best if self.beats(best, default, margin) else default

    def is_close(self, margin: float) -> bool:
        """Too near to decide on this many rounds: the decision the rounds of the best
        candidate (the one :meth:`kept` weighs against the reference) would take could still
        cost more than ``margin`` accepts. Keeping the candidate (its median beyond the
        threshold ``1 + margin``) could, while its lower quartile is below 1 (it may be the
        slower); keeping the reference could, while the upper quartile is beyond the threshold
        (the candidate may be faster by more than the margin). Rounds that agree on a
        candidate a few per cent faster keep it, however near the threshold their median:

        >>> def race(protect=None, **rounds):
        ...     return Race("planned", {n: Ratio("planned", n, 1.0, r) for n, r in rounds.items()},
        ...                 rounds=len(next(iter(rounds.values()))), protect=protect)
        >>> race(nhwc=(1.01, 0.99, 1.02)).is_close(0.0), race(nhwc=(1.2, 1.1, 1.3)).is_close(0.0)
        (True, False)
        >>> race(nchw=(1.054, 1.282, 0.876, 0.931, 0.89)).is_close(0.0)
        True
        >>> race(nhwc=(1.03, 1.05, 1.04)).is_close(0.02), race(nhwc=(1.05, 0.98, 1.04)).is_close(0.02)
        (False, True)

        A tie is not a close call: when every round of the best candidate (at least
        ``SEQUENTIAL_ROUNDS``) lies within ``margin`` of the reference, either choice costs
        less than the margin accepts, and more rounds would not change that (:func:`tied`):

        >>> race(nhwc=(1.01, 0.99, 1.015)).is_close(0.02), race(nhwc=(1.01, 0.99, 1.015)).is_close(0.0)
        (False, True)

        With ``protect``, a close call counts where the reference could lose by it: the best
        candidate's when the rounds so far would keep it (its median beyond the threshold),
        and a close call of any candidate in ``protect`` (the one a decision must never be
        slower than) on either side. One the reference wins against another candidate keeps
        the reference, whose standing against ``protect`` is settled on its own; it costs at
        most the chance that the other is a few per cent faster:

        >>> below, above = (1.0, 1.03, 0.98), (1.05, 0.98, 1.04)
        >>> race(("own",), eager=below).is_close(0.02), race(("own",), eager=above).is_close(0.02)
        (False, True)
        >>> race(("own",), eager=below, own=(0.99, 1.03, 0.97)).is_close(0.02)
        True
        """
        if not self.ratios:
            return False
        name, best = max(self.ratios.items(), key=lambda item: item[1].median)
        if self.protect is None or best.median > 1.0 + margin or name in self.protect:
            return _close(best.per_round, margin)
        return any(_close(r.per_round, margin) for n, r in self.ratios.items()
                   if n in self.protect)

    def contested(self, margin: float) -> tuple[str, ...]:
        """The candidates whose own rounds are a close call that counts (as in
        :meth:`is_close`: with ``protect``, one in ``protect`` or one the rounds so far would
        keep over the reference): what the rounds of a close call are for, with the
        reference. A candidate whose rounds are not a close call lies clearly below the
        threshold while the best is close (its median is no higher), so more rounds of it
        cannot make it the one kept.

        >>> r = Race("planned", {"own": Ratio("planned", "own", 1.0, (0.99, 1.03, 0.97)),
        ...                      "eager": Ratio("planned", "eager", 1.0, (0.9, 1.01, 0.95))},
        ...          rounds=3, protect=("own",))
        >>> r.is_close(0.02), r.contested(0.02)
        (True, ('own',))
        """
        return tuple(n for n, r in self.ratios.items() if _close(r.per_round, margin)
                     and (self.protect is None or n in self.protect
                          or r.median > 1.0 + margin))

    def settled(self, margin: float) -> bool:
        """A (stored) race whose decision stands: not a close call, or one timed longer."""
        return self.extended or not self.is_close(margin)

    @property
    def busy(self) -> bool:
        """Measured while the machine was busy: not to be reused."""
        return self.conditions is not None and self.conditions.busy


def interleaved(
    fns: Mapping[str, Callable[[], object]],
    *,
    rounds: int = 7,
    warmup: int = 1,
    repeat: int = 1,
    baseline: str | None = None,
    sync: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    on_step: Callable[[int, str], None] | None = None,
    rotate: bool = True,
    stop: Callable[[Mapping[str, Sequence[float]]], bool] | None = None,
    retire: Callable[[Mapping[str, Sequence[float]]], Iterable[str]] | None = None,
) -> Comparison:
    """Time every callable in ``fns`` once per round, in turn, for ``rounds`` rounds.

    - ``warmup`` untimed calls of each mode first (allocator, caches, lazy init, compile).
    - each timed sample is ``repeat`` calls; the recorded value is seconds per call.
    - ``sync`` (e.g. ``torch.cuda.synchronize``) runs before each clock read.
    - ``rotate``: the order changes each round so that no mode always runs first, or always
      right after the same neighbour (cache and allocator state left by the previous mode
      can bias a sample, and a fixed neighbour turns that into a steady bias). Rotation
      alone keeps neighbours (A B C, B C A, C A B: A always follows C), so every other cycle
      of rotations runs reversed: A B C, B C A, C A B, C B A, A C B, B A C, ...
    - a mode that raises is recorded with its error and dropped from later rounds; the others
      go on. ``on_step(round, name)`` is called before each timed sample (progress bars).
    - ``stop(times)``, asked after each round with every mode's seconds so far, ends the run
      early when it answers ``True`` (:func:`separated`); ``retire(times)`` names modes that
      leave the later rounds, their rounds kept, never the baseline (:func:`behind`).
    """
    if not fns:
        raise ValueError("interleaved() needs at least one callable")
    if rounds < 1 or repeat < 1 or warmup < 0:
        raise ValueError(f"rounds >= 1, repeat >= 1, warmup >= 0 needed; got {rounds}, {repeat}, {warmup}")
    names = list(fns)
    baseline = baseline or names[0]
    if baseline not in fns:
        raise ValueError(f"baseline {baseline!r} is not one of {names}")
    sync = sync or (lambda: None)
    times: dict[str, list[float]] = {n: [] for n in names}
    errors: dict[str, str] = {}
    error_types: dict[str, type[BaseException]] = {}
    retired: set[str] = set()

    def run(name: str, calls: int) -> float | None:
        try:
            sync()
            start = clock()
            for _ in range(calls):
                fns[name]()
            sync()
            return (clock() - start) / calls
        except Exception as exc:  # a failing mode is a result, not a crash of the run
            errors[name] = f"{type(exc).__name__}: {exc}"
            error_types[name] = type(exc)
            return None

    for name in names:
        for _ in range(warmup):
            if name in errors or run(name, 1) is None:
                break
    order_log: list[tuple[str, ...]] = []
    for r in range(rounds):
        live = [n for n in names if n not in errors and n not in retired]
        if not live:
            break
        order = tuple(round_order(live, r) if rotate else live)
        order_log.append(order)
        for name in order:
            if on_step is not None:
                on_step(r, name)
            t = run(name, repeat)
            if t is not None:
                times[name].append(t)
        if stop is not None and r + 1 < rounds and stop(times):
            break
        if retire is not None:
            retired.update(n for n in retire(times) if n != baseline)
    modes = {n: ModeTiming(n, tuple(times[n]), errors.get(n), error_types.get(n)) for n in names}
    return Comparison(modes, baseline, rounds, repeat, warmup, tuple(order_log))


#: the rounds a sequential race runs at least before it may stop early
SEQUENTIAL_ROUNDS = 3
#: rounds of one mode this close together (relative to their median) estimate its time as
#: well as more of them would (:func:`steady`)
STEADY = 0.1


def separated(reference: str, margin: float, rounds: int = 2 * SEQUENTIAL_ROUNDS - 1, *,
              tie: float | None = None) -> Callable[[Mapping[str, Sequence[float]]], bool]:
    """A ``stop`` for :func:`interleaved` of ``rounds`` rounds: the race is decided once more
    than half its rounds (and ``SEQUENTIAL_ROUNDS`` at least) have run and every candidate's
    per-round ratios against ``reference`` lie on one side of the threshold ``1 + margin``,
    their median beyond it by more than ``CLOSE``, and the two fastest candidates beyond it
    are as clearly apart from each other: the rounds left cannot move any of those medians
    across, so :meth:`Race.kept` keeps what the full race would. A candidate whose every round
    lies within ``margin`` of the reference (:func:`tied`) is decided too: whichever is kept,
    the difference no longer matters; ``tie`` sets that margin apart from the threshold's (a
    comparison of two ways with no keep margin, such as an op's two formats, still ends in a
    tie). A candidate that stopped running (it raised) is left out; with none left running,
    the race goes on.

    >>> stop = separated("a", 0.02)
    >>> stop({"a": [1.0, 1.0, 1.0], "b": [0.5, 0.52, 0.49]})  # b twice as fast every round
    True
    >>> stop({"a": [1.0, 1.0, 1.0], "b": [0.98, 1.01, 0.97]})  # a close call: time on
    False
    >>> stop({"a": [1.0, 1.0, 1.0], "b": [0.5, 0.9, 0.49]})  # one slow round, still faster
    True
    >>> stop({"a": [1.0, 1.0, 1.0], "b": [0.5, 1.2, 0.49]})  # slower in one: not separated
    False
    >>> stop({"a": [1.0, 1.0], "b": [0.5, 0.5]})  # too few rounds
    False
    >>> stop({"a": [1.0, 1.0, 1.0], "b": [0.99, 1.005, 1.01]})  # a tie within the margin
    True
    >>> either = separated("a", 0.0, 5, tie=0.02)  # no side favoured, ties within 2 %
    >>> either({"a": [1.0] * 3, "b": [1.1, 1.08, 1.2]}), either({"a": [1.0] * 3, "b": [1.0] * 3})
    (True, True)
    >>> either({"a": [1.0] * 3, "b": [1.01, 1.05, 0.97]})  # neither apart nor tied: time on
    False
    """
    threshold = 1.0 + margin
    tie = margin if tie is None else tie
    least = _least(rounds)

    def apart(ratios: Sequence[float], line: float) -> bool:
        return _apart(ratios, line, least)

    def stop(times: Mapping[str, Sequence[float]]) -> bool:
        own = times.get(reference, ())
        running = {n: t for n, t in times.items() if n != reference and len(t) == len(own)}
        if not running or not all(apart(round_ratios(own, t), threshold)
                                  or (len(t) >= least and tied(round_ratios(own, t), tie))
                                  for t in running.values()):
            return False
        faster = sorted((t for t in running.values()
                         if statistics.median(round_ratios(own, t)) > threshold),
                        key=lambda t: statistics.median(t))
        return len(faster) < 2 or apart(round_ratios(faster[1], faster[0]), 1.0)

    return stop


def _close(ratios: Sequence[float], margin: float) -> bool:
    """Per-round ratios whose decision could still cost more than ``margin`` accepts, and
    not a tie (``Race.is_close`` says when); a single round is one when its ratio is within
    ``CLOSE`` of the threshold ``1 + margin``."""
    threshold = 1.0 + margin
    if tied(ratios, margin):  # every round within the margin: the choice no longer matters
        return False
    median = statistics.median(ratios)
    if len(ratios) < 2:
        return abs(median - threshold) < CLOSE
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return q1 < 1.0 if median > threshold else q3 > threshold


def tied(ratios: Sequence[float], margin: float) -> bool:
    """Every one of at least ``SEQUENTIAL_ROUNDS`` per-round ratios lies within ``margin`` of 1
    (between ``1 / (1 + margin)`` and ``1 + margin``): the two candidates are equal within what
    a race's margin accepts. Were either truly faster beyond it, each round would fall outside
    with a probability of a half or more, so all of them inside is the less likely the more
    rounds there are (an eighth for three).

    >>> tied([0.99, 1.01, 1.015], 0.02), tied([0.99, 1.01, 1.03], 0.02), tied([1.0, 1.0], 0.02)
    (True, False, False)
    """
    return (margin > 0 and len(ratios) >= SEQUENTIAL_ROUNDS
            and all(1 / (1 + margin) <= r <= 1 + margin for r in ratios))


def behind(reference: str, margin: float, rounds: int = 2 * SEQUENTIAL_ROUNDS - 1
           ) -> Callable[[Mapping[str, Sequence[float]]], list[str]]:
    """A ``retire`` for :func:`interleaved` of ``rounds`` rounds: the candidates already out of
    the running, once as many rounds as :func:`separated` asks for have run: slower than
    ``reference`` in every round, their median ratio below the threshold ``1 + margin`` by
    more than ``CLOSE``. The rounds left could not make one the fastest beyond the threshold,
    so :meth:`Race.kept` cannot keep it; timing it further only costs time.

    >>> retire = behind("a", 0.02)
    >>> retire({"a": [1.0, 1.0, 1.0], "slow": [2.0, 1.9, 2.1], "fast": [0.5, 0.5, 0.5]})
    ['slow']
    >>> retire({"a": [1.0, 1.0, 1.0], "near": [1.01, 1.02, 0.99]}), retire({"a": [1.0], "slow": [2.0]})
    ([], [])
    """
    threshold = 1.0 + margin
    least = _least(rounds)

    def retire(times: Mapping[str, Sequence[float]]) -> list[str]:
        own = times.get(reference, ())
        return [name for name, t in times.items()
                if name != reference and len(t) == len(own)
                and _apart(ratios := round_ratios(own, t), threshold, least)
                and max(ratios) < threshold]

    return retire


def steady(rounds: int, limit: float = STEADY
           ) -> Callable[[Mapping[str, Sequence[float]]], bool]:
    """A ``stop`` for :func:`interleaved` of ``rounds`` rounds that estimate each mode's own
    time (its fastest round), not a choice between them: stop once as many rounds as
    :func:`separated` asks for have run and every mode's rounds lie within ``limit`` of each
    other, relative to their median (the rounds left could lower a fastest round by less).

    >>> stop = steady(5)
    >>> stop({"a": [1.0, 1.02, 1.01], "b": [2.0, 2.1, 2.05]}), stop({"a": [1.0, 1.0]})
    (True, False)
    >>> stop({"a": [1.0, 1.02, 1.01], "b": [2.0, 2.9, 2.05]})  # one round 40 % slower
    False
    """
    least = _least(rounds)

    def stop(times: Mapping[str, Sequence[float]]) -> bool:
        return all(len(t) >= least and ModeTiming(name, tuple(t)).spread <= limit
                   for name, t in times.items())

    return stop


def _least(rounds: int) -> int:
    """The rounds a sequential race of ``rounds`` runs before it decides anything: more than
    half of them, and ``SEQUENTIAL_ROUNDS`` at least."""
    return max(SEQUENTIAL_ROUNDS, rounds // 2 + 1)


def _apart(ratios: Sequence[float], line: float, least: int) -> bool:
    """At least ``least`` per-round ratios, all on one side of ``line``, their median beyond
    it by ``CLOSE`` or more: the rounds left of the race cannot move the median across."""
    return (len(ratios) >= least and abs(statistics.median(ratios) - line) >= CLOSE
            and (min(ratios) > line or max(ratios) < line))


def round_ratios(top: Sequence[float], bottom: Sequence[float]) -> tuple[float, ...]:
    """Per-round ratios ``top / bottom`` of two modes' times, rounds paired in order, over the
    rounds both ran."""
    return tuple(t / b for t, b in zip(top, bottom, strict=False) if b > 0)


def round_order(names: Sequence[str], r: int) -> list[str]:
    """The order of round ``r``: rotated by ``r``, reversed in every other cycle of rotations.

    >>> [" ".join(round_order("abc", r)) for r in range(6)]
    ['a b c', 'b c a', 'c a b', 'c b a', 'a c b', 'b a c']
    """
    n = len(names)
    shift = r % n
    order = list(names[shift:]) + list(names[:shift])
    return order[::-1] if (r // n) % 2 else order


def geomean(values: Sequence[float]) -> float:
    """Geometric mean of positive values (the mean to use for speedup ratios)."""
    if not values:
        raise ValueError("geomean of no values")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def centre_and_spread(values: Sequence[float]) -> tuple[float, float]:
    """The median of ``values`` and their robust standard deviation (1.4826 times the median
    absolute deviation: a normal sample's standard deviation), what an outlier round or a
    cost measured under load moves least.

    >>> centre_and_spread([1.0, 2.0, 3.0, 100.0])
    (2.5, 1.4826)
    """
    if not values:
        raise ValueError("centre of no values")
    centre = statistics.median(values)
    return centre, 1.4826 * statistics.median(abs(x - centre) for x in values)


#: a timed sample lasts about this long: enough calls of a short op that the clock's and the
#: device synchronize's own cost is small beside them
SAMPLE_SECONDS = 0.004


def repeats_for(per_call: float) -> int:
    """Calls per timed sample for a call of ``per_call`` seconds (once warm): about
    ``SAMPLE_SECONDS`` of them, 1 to 50.

    >>> repeats_for(0.1), repeats_for(0.0004), repeats_for(0.0)
    (1, 10, 50)
    """
    return max(1, min(50, int(SAMPLE_SECONDS / max(per_call, 1e-6))))
