"""Wall seconds per planning step, gathered into the plan's :class:`Price` (L2 plan,
report)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from memlayout.plan.report.records import Price


class StepClock:
    """Wall seconds per planning step (``time.perf_counter``), a step run twice counting
    both runs; ``price`` makes them the plan's :class:`Price`.

    >>> clock = StepClock()
    >>> for step in ("capture", "costs", "solve", "guard", "verify", "costs"):
    ...     with clock(step):
    ...         pass
    >>> sorted(clock.seconds), all(s >= 0 for s in clock.seconds.values())
    (['capture', 'costs', 'guard', 'solve', 'verify'], True)
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, step: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[step] = self.seconds.get(step, 0.0) + time.perf_counter() - start

    def price(self, total: float, *, measured: int, cached: int, ran: set[str],
              predicted: int = 0) -> Price:
        """The plan's price: ``total`` seconds, the steps timed (of the optional ones, those
        that ``ran``), and how many costs were timed (``measured``), read from the cache, or
        predicted instead of timed (``predicted`` layout nodes)."""
        s = self.seconds

        def optional(step: str) -> float | None:
            return s[step] if step in ran else None

        return Price(total=total, capture=s["capture"], costs=s["costs"],
                     measured=measured, cached=cached, solve=s["solve"],
                     guard=s["guard"], verify=s["verify"], padding=optional("padding"),
                     memory=optional("memory"), blocked=optional("blocked"),
                     predicted=predicted)
