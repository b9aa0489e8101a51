"""One plan per job (L2 plan, compilers): under an initialized ``torch.distributed`` process
group, the ``memlayout`` backend decides each graph once per device kind, and every rank of
that kind compiles the same plan (``memlayout.plan.compilers.backend``).

Ranks that plan on their own measure at the same time, on cores, caches and memory they
share, and can choose different layouts for the same graph: they would run different
programs, and each would pay for the measurement. So the lowest rank of each device kind
(``measured_on``: the CPU's model, instruction set and threads, or the GPU's kind and the
settings that pick its kernels; rank 0 where every rank runs on one kind) measures, solves,
verifies and guards the graph, and its :class:`Decision` (the costs it solved, the labels,
what ran and the verification's verdict, the rewritten graph's signature) goes to every rank
over the default group. The other ranks rebuild the plan from it without measuring, and
check that what they built is what the deciding rank built. Dynamo compiles a model's
graphs in the same order on every rank, so each graph is one exchange: two collectives, the
device kinds (small strings), then the decisions (``all_gather_object``: a deciding rank
gives its decision, every other rank nothing).

Every rank must compile the same graphs with the same backend options: a model compiled on
some ranks only leaves the others' collectives unanswered (``Backend(shared_plan=False)``:
each rank plans alone).

>>> job = Job(rank=1, decider=0)
>>> job.decides
False
>>> len(plan_digest("graph", {"conv": 1}, "inductor", "planned"))
12
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from memlayout.errors import MemlayoutError, first_line
from memlayout.plan.compilers.backend_report import GraphRecord
from memlayout.plan.costs.table import CostTable, measured_on
from memlayout.plan.graph import Label


class ExchangeFailed(MemlayoutError):
    """A collective of the exchange failed, or the deciding rank sent nothing; ``rank``:
    this process's."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass(frozen=True)
class Job:
    """This process in the job: its rank, and the rank that decides for its device kind."""

    rank: int
    decider: int

    @property
    def decides(self) -> bool:
        return self.rank == self.decider


@dataclass(frozen=True)
class Decision:
    """What the deciding rank made of one graph.

    ``signature``: the graph's there (``graph_signature``: its code, its inputs' shapes,
    strides and dtypes); ``record``: what it decided and ran (``None``: its compile raised,
    ``signal`` names a Dynamo control-flow exception, which every rank raises in step);
    ``compiled_as``: how its graphs are compiled (``Backend.compiled_as``); ``table``,
    ``labels``: the costs the plan was solved from and the solved labels, for a plan that
    runs (``None``: no plan runs, Inductor's own layouts or the graph as given);
    ``planned_signature``: the rewritten graph's, which every rank's rebuild must match."""

    signature: str
    record: GraphRecord | None
    compiled_as: str = ""
    table: CostTable | None = None
    labels: tuple[tuple[str, Label], ...] = ()
    planned_signature: str = ""
    signal: str = ""


def job_of(device: torch.device) -> Job | None:
    """This process's :class:`Job` for a graph on ``device`` (a collective on the default
    group); ``None`` without an initialized process group. ``ExchangeFailed`` when the
    collective fails."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    rank = dist.get_rank()
    try:
        kinds: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(kinds, measured_on(device))
    except Exception as exc:  # a rank gone, a timeout: no shared plan
        raise ExchangeFailed(f"the ranks' device kinds could not be gathered "
                             f"({type(exc).__name__}: {first_line(exc)})", rank) from exc
    return Job(rank, kinds.index(kinds[rank]))


def exchange(job: Job, decision: Decision | None) -> Decision:
    """The decision of ``job``'s deciding rank, every rank calling at once (a deciding rank
    gives its ``decision``, another ``None``). ``ExchangeFailed`` when the collective fails
    or the deciding rank gave nothing."""
    try:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, decision if job.decides else None)
    except Exception as exc:  # a rank gone, a timeout, a decision that does not unpickle
        raise ExchangeFailed(f"the exchange of decisions failed ({type(exc).__name__}: "
                             f"{first_line(exc)})", job.rank) from exc
    got = gathered[job.decider]
    if not isinstance(got, Decision):
        raise ExchangeFailed(f"rank {job.decider} sent no decision", job.rank)
    return got


def plan_digest(signature: str, labels: Mapping[str, Label], ran: str,
                planned_signature: str = "") -> str:
    """A short hash of what runs for a graph: the graph and its inputs (``signature``), the
    plan's labels, how it runs and the rewritten graph (``planned_signature``). Ranks whose
    digests agree run the same program for that graph."""
    text = json.dumps([signature, sorted((k, int(v)) for k, v in labels.items()), ran,
                       planned_signature])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def untakeable(decision: Decision, signature: str, *, compiled_as: str, train: bool,
               dtype: str) -> str | None:
    """Why a rank whose graph has ``signature``, compiled as ``compiled_as``, run for
    training or not (``train``) in ``dtype`` cannot take ``decision`` (its graph, or how it
    runs, differs), else ``None``."""
    record = decision.record
    assert record is not None
    if decision.signature != signature:
        return "the graph differs (its code, or its inputs' shapes, strides or dtypes)"
    if decision.compiled_as != compiled_as:
        return (f"the backend's options differ (compiled as {decision.compiled_as!r} there, "
                f"{compiled_as!r} here)")
    if (record.train, record.dtype) != (train, dtype):
        return (f"the graph runs otherwise ({'train' if record.train else 'infer'}, "
                f"{record.dtype} there; {'train' if train else 'infer'}, {dtype} here)")
    return None


__all__ = ["Decision", "ExchangeFailed", "Job", "exchange", "job_of", "plan_digest",
           "untakeable"]
