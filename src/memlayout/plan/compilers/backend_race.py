"""The guard's race run on a graph's own calls (the ``torch.compile`` backend, ``backend.py``).

Timed before the backend returns, the guard's race runs each way to run a graph (the plan
compiled, the plan run eagerly, Inductor's own layouts) for rounds of steps that compute
nothing the user keeps: on a CPU, a second or more per training step and way, 5 to 40 s of a
first call. :class:`CallRace` times the same rounds on the calls Dynamo makes instead: each
call runs one way, in the guard's interleaved order (``memlayout.timing.round_order``), and is
timed as it runs; in training its backward too, from the first gradient that reaches one of
its outputs to the last that leaves through its inputs (``register_multi_grad_hook``). The
rounds stop as the guard's do (``separated``, ``behind``, a close call timed longer), then
the way kept (``Race.kept``) runs every later call. Every way raced is verified before its
first call (or is Inductor's own, what ``torch.compile`` runs), so every call computes what
the graph computes, within the dtype's tolerance.

A call whose backward is not seen before the next call (two forwards before a backward,
outputs no loss reaches) is timed again; a race that loses ``ABANDON_AFTER`` calls so keeps
its reference, undecided (``Race`` ``None``). A way that raises leaves the race, and the
call runs the reference.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import register_multi_grad_hook

from memlayout.devices import seam
from memlayout.machine import Conditions
from memlayout.plan.check import guard
from memlayout.plan.compilers.backend_report import RECORDS, BackendWarning
from memlayout.plan.runners import Runner
from memlayout.tensors import iter_tensors
from memlayout.timing import (
    Race,
    behind,
    round_order,
    separated,
)

log = logging.getLogger("memlayout.backend")

#: the race's clock (seconds)
clock = time.perf_counter

if TYPE_CHECKING:
    from memlayout.plan.compilers.backend import Backend

#: calls whose timing is lost (no backward seen) a race takes before it gives up
ABANDON_AFTER = 8

#: what a race reports when it ends: the race (``None``: given up), the way kept, the calls
Decided = Callable[[Race | None, str, int], None]


@dataclass
class _Call:
    """One timed call: its way, its forward's seconds and, in training, when its backward
    began and ended (``perf_counter``), with the hooks that see them."""

    way: str
    forward: float
    backward: bool
    began: float | None = None
    ended: float | None = None
    hooks: list[Any] = field(default_factory=list)

    @property
    def seconds(self) -> float | None:
        """The call's seconds, forward and backward (``None``: its backward not seen yet)."""
        if not self.backward:
            return self.forward
        if self.began is None or self.ended is None:
            return None
        return self.forward + self.ended - self.began

    def unhook(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()


class CallRace:
    """Dynamo's function for one graph while its ways race (``fns``: way -> function, each
    verified; ``reference``: the way kept unless another is faster by more than ``margin``).
    ``rounds`` interleaved rounds follow one untimed call of each way; they stop early, retire
    a way out of the running and extend a close call as ``memlayout.plan.check.guard``'s
    ``time_steps`` does, ``protect`` as there. ``decided`` hears the outcome once. ``warm``:
    ways already run on these inputs (verified, or kept from an earlier race): their
    untimed call is left out."""

    def __init__(self, fns: Mapping[str, Callable[..., Any]], *, reference: str, margin: float,
                 rounds: int, protect: tuple[str, ...], train: bool, device: torch.device,
                 decided: Decided, warm: tuple[str, ...] = ()) -> None:
        self._fns = dict(fns)
        self._reference, self._margin, self._rounds = reference, margin, rounds
        self._protect, self._train, self._decided = protect, train, decided
        self._sync = seam(device).synchronize
        self._since: tuple[float, float] | None = None  # (wall, CPU) when the rounds began
        self._live = list(fns)
        self._queue = [w for w in fns if w not in warm]  # the warm-up: each way once, untimed
        self._runs: list[dict[str, list[float]]] = []
        self._round = -1
        self._extended = False
        self._errors: dict[str, str] = {}
        self._pending: _Call | None = None
        self._lost = 0
        self.calls = 0
        self.ways = tuple(fns)
        self.kept: str | None = None
        self._stop = separated(reference, margin, rounds)
        self._retire = behind(reference, margin, rounds)
        if not self._queue:
            self._next_round()

    def __call__(self, *args: Any) -> Any:
        if self.kept is not None:
            return self._fns[self.kept](*args)
        self._close_call()
        if self.kept is not None:
            return self._fns[self.kept](*args)
        self.calls += 1
        return self._timed(self._queue[0], args)

    def way(self, name: str) -> Callable[..., Any]:
        """The function of way ``name`` (once the race ended, only the way kept's)."""
        return self._fns[name]

    def _timed(self, way: str, args: tuple[Any, ...]) -> Any:
        self._sync()
        start = clock()
        try:
            out = self._fns[way](*args)
        except Exception as exc:  # a way that fails leaves the race; the reference runs
            if way == self._reference:
                raise
            self._errors[way] = f"{type(exc).__name__}: {exc}"
            self._live.remove(way)
            self._queue = [w for w in self._queue if w != way] or [self._reference]
            return self._fns[self._reference](*args)
        self._sync()
        forward = clock() - start
        outs = [t for t in iter_tensors(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        ins = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        call = _Call(way, forward, backward=self._train and bool(outs and ins))
        if call.backward:
            def began(_grad: Any) -> None:
                if call.began is None:
                    self._sync()
                    call.began = clock()

            def ended(_grads: Any) -> None:
                if call.began is not None and call.ended is None:
                    self._sync()
                    call.ended = clock()

            call.hooks = [register_multi_grad_hook(outs, began, mode="any"),
                          register_multi_grad_hook(ins, ended, mode="all")]
        self._pending = call
        return out

    def _close_call(self) -> None:
        """Count the last call's time (its backward has run by the next call), and move on."""
        call, self._pending = self._pending, None
        if call is None:
            return
        call.unhook()
        seconds = call.seconds
        if seconds is None:  # its backward not seen: that way is called again
            self._lost += 1
            log.debug("a call of %s not timed (its backward %s): %d of %d lost", call.way,
                      "not begun" if call.began is None else "not ended", self._lost,
                      ABANDON_AFTER)
            if self._lost >= ABANDON_AFTER:
                self._end(None)
            return
        if self._round >= 0:
            self._runs[-1].setdefault(call.way, []).append(seconds)
        if self._queue and self._queue[0] == call.way:
            self._queue.pop(0)
        if not self._queue:
            self._next_round()

    def _next_round(self) -> None:
        """The rounds' bookkeeping, as ``time_steps``: stop once decided, retire a way out of
        the running, time a close call for ``rounds`` more rounds of the ways it is between."""
        if self._round < 0:
            self._runs.append({})
        else:
            times = self._runs[-1]
            done = self._round + 1 >= self._rounds
            if not self._extended:
                for way in self._retire(times):
                    self._live.remove(way)
                if len(self._live) < 2:  # every other way failed or is out of the running
                    return self._end(self._race())
                if not done and not self._stop(times):
                    return self._start_round()
                race = self._race()
                if not race.is_close(self._margin):
                    return self._end(race)
                contested = race.contested(self._margin)
                self._live = [w for w in self._live if w == self._reference or w in contested]
                self._extended, self._round = True, -1
                self._runs.append({})
            elif done:
                return self._end(self._race())
        self._start_round()

    def _start_round(self) -> None:
        self._round += 1
        self._queue = round_order(self._live, self._round)
        if self._since is None:  # the timed rounds begin
            self._since = (time.perf_counter(), time.process_time())

    def _race(self) -> Race:
        """The race the rounds so far measured, as ``time_steps`` builds it; the machine's
        conditions read now, less this process's own use of the CPU since the timed rounds
        began (the calls raced, and the compile before them still in the 1-minute load
        average, are this process's, not other jobs' load)."""
        wall, cpu = self._since or (time.perf_counter(), time.process_time())
        own = (time.process_time() - cpu) / max(time.perf_counter() - wall, 1e-9)
        now = Conditions.now().less_own(own)
        return guard.race_of(self._runs, self._reference, self._fns, errors=self._errors,
                             extended=self._extended, before=now, now=now,
                             protect=self._protect)

    def _end(self, race: Race | None) -> None:
        self.kept = race.kept(self._reference, self._margin) if race else self._reference
        self._fns = {self.kept: self._fns[self.kept]}  # the others' memory goes
        self._decided(race, self.kept, self.calls)


def chained(*steps: Decided) -> Decided:
    """One race's ``decided`` that hears its outcome in each of ``steps``, in order."""
    def decided(race: Race | None, kept: str, calls: int) -> None:
        for step in steps:
            step(race, kept, calls)
    return decided


def guard_ratios(race: Race | None) -> tuple[tuple[str, float], ...]:
    """Each other way's median ratio in the guard's race (its reference's time over its)."""
    return () if race is None else tuple((name, r.median) for name, r in race.ratios.items())


def races_on_calls(options: Backend) -> bool:
    """Whether the guard races on a graph's calls as ``options`` compile it: with the race
    asked for (``race_on_calls``), a guard that times (``guard``, ``measure``) compiled ways
    (Inductor), and not under CUDA graphs, whose first calls record and replay a graph per
    way."""
    inductor = dict(options.inductor)
    return (options.race_on_calls and options.guard and options.measure
            and options.inner != "eager" and options.mode != "reduce-overhead"
            and not inductor.get("triton.cudagraphs", False))


def decided_here(graph: str, key: str | None, opened: Callable[[], Any],
                 checks: Mapping[str, Any]) -> Decided:
    """What the end of graph ``graph``'s race does: store the race under ``key`` in the cost
    cache ``opened()`` opens (a later compile then builds only the way kept; ``None``: a way
    left out, nothing stored), and put the outcome in the graph's record of
    ``memlayout.backend_report()``: the way kept, each way's ratio, the calls it took and
    how the way kept was verified (``checks``: way -> ``GraphCheck``)."""
    def decided(race: Race | None, kept: str, calls: int) -> None:
        if race is not None and key is not None and not race.errors:
            store = opened()
            try:  # a cache that cannot take it never stops the user's call
                if store is not None:
                    guard.save(store, key, race)
            except Exception as exc:
                warnings.warn(f"memlayout backend: graph {graph}'s race not cached "
                              f"({type(exc).__name__}: {exc})", BackendWarning, stacklevel=2)
            finally:
                if store is not None:
                    store.close()
        check = checks[kept]
        RECORDS.update(graph, lambda record: dataclasses.replace(
            record, ran=Runner(kept), timed=guard_ratios(race), racing=(),
            race_calls=record.race_calls + calls,
            timed_against=race.reference if race else record.timed_against,
            verification=check.how, max_error=check.error))
    return decided


__all__ = ["ABANDON_AFTER", "CallRace", "Decided", "chained", "decided_here", "guard_ratios",
           "races_on_calls"]
