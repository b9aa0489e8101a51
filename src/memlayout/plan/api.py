"""The planner's public names where ``memlayout.train`` imports them (``memlayout.plan.api``);
the planner itself lives in ``pipeline`` (``optimize``), ``module`` (``OptimizedModule``) and
``compare`` (``compare_with_eager``)."""

from memlayout.plan.compare import compare_with_eager
from memlayout.plan.module import OptimizedModule, shape_signature
from memlayout.plan.pipeline import optimize
from memlayout.plan.result import Plan

__all__ = ["OptimizedModule", "Plan", "compare_with_eager", "optimize", "shape_signature"]
