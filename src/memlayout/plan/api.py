"""``optimize`` where ``memlayout.train`` imports it (``memlayout.plan.api.optimize``); the
planner lives in ``pipeline`` (``optimize``), ``module`` (``OptimizedModule``) and ``compare``
(``compare_with_eager``)."""

from memlayout.plan.pipeline import optimize

__all__ = ["optimize"]
