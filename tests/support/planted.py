"""A planner bug on purpose: the planned steering (never the eager one-format models it is
checked against) with a boundary that changes values, which verification must catch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def corrupt_the_plan_at(monkeypatch: Any, path: str, change: Callable[[Any], Any]) -> None:
    """Every plan made from now on steers the module at ``path`` so that its result is
    ``change(result)``; the plan is never taken for an eager model (``is_uniform`` says no)."""
    from memlayout.plan.steer.boundary import Boundary

    class Corrupting(Boundary):
        def exit(self, output: Any) -> Any:
            return change(super().exit(output))

    add_to_the_plan(monkeypatch, path, Corrupting())


def add_to_the_plan(monkeypatch: Any, path: str, boundary: Any) -> None:
    """Every plan made from now on also steers the module at ``path`` with ``boundary``."""
    from memlayout.plan.steer import build
    from memlayout.plan.steer.steering import Steering

    real = build.steering_of

    def planted(solution: Any, options: Any, storage: Any = None) -> Steering:
        s = real(solution, options, storage)
        return Steering(s.parameters, (*s.boundaries, (path, boundary)))

    replace_steering(monkeypatch, planted)


def replace_steering(monkeypatch: Any, steering_of: Callable[..., Any]) -> None:
    """Every plan made from now on is steered by ``steering_of(solution, options, storage)``
    (where the guard builds its candidates and where the memory step rebuilds one), and is
    never taken for an eager one-format model."""
    from memlayout.plan import pipeline
    from memlayout.plan.check import guard

    monkeypatch.setattr(pipeline, "steering_of", steering_of)
    monkeypatch.setattr(guard, "steering_of", steering_of)
    monkeypatch.setattr(guard, "is_uniform", lambda solution, label, root="": False)
