"""The typed records the planner's steps hand each other (L2 plan).

``memlayout.optimize`` derives one :class:`PlanOptions` from its keywords and passes it down;
each step returns one frozen record: the costs of every captured region (:class:`Costs`), the
min-cut labels per region (:class:`RegionSolution`, gathered in :class:`Solution`), the
rewritten model (:class:`Build`), the guard's choice (:class:`GuardDecision`) and the memory
step's (:class:`MemoryDecision`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from memlayout.plan.graph import Label, Request

#: ``progress(done, total, what)``, called while measuring
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class PlanOptions:
    """What every step of one planning run needs to know, derived once from ``optimize``'s
    keywords and the example: device, autocast dtype, train or inference, planned ranks."""

    name: str
    device: torch.device
    dtype: torch.dtype | None  # the autocast dtype; ``None``: run as is (fp32)
    train: bool
    ranks: tuple[int, ...]  # the layout ranks planned (3 only for a model with 1-d convolutions)
    input_label: Label | None  # the format inputs arrive in; ``None``: as the example is
    auto_input: bool  # input_format="auto": the plan chooses the inputs' format
    output_label: Label | Request | None  # ``Request.KEEP``, a label, or ``None`` (free)
    measure: bool = True
    rounds: int = 5
    cache: bool | str | Path = True
    refresh: bool = False
    guard: bool = True
    guard_rounds: int = 5
    guard_margin: float = 0.0
    keep_weight_formats: bool = False
    contiguous_weights: bool = False  # every parameter stays contiguous (FSDP's fully_shard)
    max_plans: int = 8
    memory: bool = True
    memory_budget: int | None = None
    padding: bool = True
    blocked: bool = False
    fallback: bool = True  # a plan that fails verification gives way to a verified eager one
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
