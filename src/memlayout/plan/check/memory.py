"""Memory (L2 plan): peak activation memory of a forward pass, and plans within a budget.

Layout plans allocate: a conversion is a copy of a tensor, a padded convolution reads and writes
wider tensors, and both live alongside the tensors they came from. ``peak_memory`` runs a model
once (no grad, under autocast for a dtype) and reports the largest number of bytes held by
tensors created during that forward, above what was held before it:

- CUDA: the caching allocator's own statistics (``torch.cuda.max_memory_allocated`` minus the
  bytes allocated before the call), so kernels' workspaces count too.
- elsewhere (CPU): a tensor-lifetime count. A thin ``TorchDispatchMode`` sees every aten call;
  an output whose storage is not one of the call's inputs' is a new allocation (its storage's
  ``nbytes`` become live); a finalizer on the storage returns them when it dies. Aliases (views,
  in-place results) add nothing. Buffers a kernel allocates and frees inside itself (oneDNN
  scratch) are not tensors and are not counted: the figure is the activations' footprint.

A chain of convolutions ``x -> a -> b`` under ``nn.Sequential`` peaks at ``|a| + |b|`` (the
input existed before; ``a`` dies once ``b`` exists):

>>> from torch import nn
>>> net = nn.Sequential(nn.Conv2d(3, 8, 1), nn.Conv2d(8, 4, 1)).eval()
>>> peak_memory(net, (torch.randn(1, 3, 4, 4),)).peak_bytes == (8 + 4) * 16 * 4
True

``within_budget`` picks, among candidate plans ordered by predicted time, the first whose
measured peak fits a budget; ``PlanError`` says the smallest peak found when none does.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from memlayout.devices import seam
from memlayout.dispatch import ObservingMode
from memlayout.dtypes import autocast
from memlayout.errors import PlanError
from memlayout.plan.check.guard import signature as graph_signature
from memlayout.plan.costs.table import measured_on
from memlayout.plan.graph import Label
from memlayout.plan.report.records import UNPADDED, MemoryCandidate, MemoryReport, PadChoice
from memlayout.plan.solve.mincut import Problem, Tensor, objective, solve_min_cut
from memlayout.plan.solve.regions import Solution
from memlayout.plan.steer.build import Build
from memlayout.tensors import clone_inputs, device_of

CUDA_ALLOCATOR = "cuda_allocator"
TENSOR_LIFETIME = "tensor_lifetime"


@dataclass(frozen=True)
class MemoryPeak:
    """Bytes held by tensors made during one forward: at the peak, and still held at its end
    (the outputs); how they were counted (``CUDA_ALLOCATOR`` or ``TENSOR_LIFETIME``)."""

    peak_bytes: int
    end_bytes: int
    method: str


class _LiveBytes(ObservingMode):
    """Counts bytes of storages allocated by aten calls while they are alive."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: set[int] = set()

    def observe(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        inputs = {id(s) for s in map(_storage, _tensors((args, kwargs))) if s is not None}
        for t in _tensors(out):
            s = _storage(t)
            if s is None:  # an opaque tensor (mkldnn): no storage; the tensor owns its bytes
                self._track(t, t.numel() * t.element_size())
            elif id(s) not in inputs and id(s) not in self._tracked:
                self._track(s, s.nbytes())

    def _track(self, owner: Any, nbytes: int) -> None:
        if nbytes <= 0:
            return
        key = id(owner)
        self._tracked.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(owner, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.live -= nbytes


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _storage(t: torch.Tensor) -> Any:
    if t.layout != torch.strided:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def peak_memory(module: nn.Module | Callable[..., Any], inputs: tuple[Any, ...], *,
                dtype: torch.dtype | None = None, device: torch.device | None = None) -> MemoryPeak:
    """Peak activation bytes of one ``module(*inputs)`` (no grad, autocast for ``dtype``, on
    ``device``: default the inputs')."""
    if device is None:
        device = device_of(inputs, module) if isinstance(module, nn.Module) else device_of(inputs)
    args = clone_inputs(inputs)
    outs: list[Any] = []

    def call() -> None:
        with torch.no_grad(), autocast(device, dtype):
            outs.append(module(*args))

    allocator = seam(device).peak_memory(call)
    if allocator is not None:  # the device's caching allocator counted it
        outs.clear()
        return MemoryPeak(allocator.peak, allocator.end, CUDA_ALLOCATOR)
    counter = _LiveBytes()
    with torch.no_grad(), autocast(device, dtype), counter:
        out = module(*args)
    end = counter.live
    del out
    return MemoryPeak(counter.peak, end, TENSOR_LIFETIME)




def parameter_bytes(module: nn.Module) -> int:
    """Bytes of distinct parameters and buffers (padded weights are larger)."""
    seen: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        s = _storage(t)
        if s is None:
            seen[id(t)] = t.numel() * t.element_size()
        else:
            seen[s.data_ptr() or id(s)] = s.nbytes()
    return sum(seen.values())


@dataclass
class Candidate:
    """A plan to consider under a memory budget: a name, its predicted seconds, and a function
    that builds it (returns whatever the caller's ``measure`` takes)."""

    name: str
    predicted: float
    build: Callable[[], Any]


def within_budget(candidates: Sequence[Candidate], budget: int,
                  measure: Callable[[Any], MemoryPeak]) -> tuple[Candidate, Any, dict[str, Any]]:
    """The fastest candidate (lowest ``predicted``; ties in the given order) whose peak fits
    ``budget``: returns it, its build, and the record of every candidate measured. Candidates
    are built and measured fastest first, stopping at the first that fits.

    >>> fake = {"fast": 300, "lean": 100, "mid": 200}
    >>> cs = [Candidate(n, p, lambda n=n: n) for n, p in [("fast", 1.0), ("lean", 3.0), ("mid", 2.0)]]
    >>> best, built, record = within_budget(cs, 250, lambda m: MemoryPeak(fake[m], 0, "test"))
    >>> best.name, sorted(record)
    ('mid', ['fast', 'mid'])
    """
    order = sorted(range(len(candidates)), key=lambda i: (candidates[i].predicted, i))
    record: dict[str, Any] = {}
    for i in order:
        c = candidates[i]
        built = c.build()
        peak = measure(built)
        record[c.name] = {"peak": peak.peak_bytes, "predicted": c.predicted}
        if peak.peak_bytes <= budget:
            return c, built, record
    smallest = min(record.items(), key=lambda kv: kv[1]["peak"])
    tried = ", ".join(f"{n} {r['peak'] / 1e6:.2f} MB" for n, r in record.items())
    raise PlanError(
        f"memory_budget={budget} bytes ({budget / 1e6:.2f} MB): no plan fits; the smallest peak "
        f"found is {smallest[1]['peak']} bytes ({smallest[0]}); tried {tried}. Raise the budget "
        f"to at least {smallest[1]['peak']} or plan a smaller batch"
    )


# ---------------------------------------------------------------- the planner's memory step

#: conversion bytes are weighted by these multiples of the model's mean conversion cost per
#: byte to find plans with fewer (or smaller) conversions: a Lagrangian sweep over memory
PENALTIES = (1.0, 4.0, 16.0, 256.0)


def plan_signature(graphs: list[tuple[str, Any, Mapping[str, Label]]], extra: Any) -> str:
    """A hash of the solved regions (``(path, graph, labels)``: shapes, strides, labels) and
    ``extra``: the key under which this plan's padding, mkldnn and memory records are cached."""
    return graph_signature(graphs, extra)


def _valid_peaks(record: Any) -> bool:
    """A cached pair of peaks as ``memory_step`` writes them (a cache read is checked)."""
    size = len(dataclasses.fields(MemoryPeak))
    return isinstance(record, dict) and all(
        isinstance(record.get(k), list) and len(record[k]) == size for k in ("original", "planned"))


def memory_step(work: nn.Module, inputs: tuple[Any, ...], dtype: torch.dtype | None,
                built: Build, *, solution: Solution, kept: str, predicted: dict[str, float],
                budget: int | None, padding: Sequence[PadChoice],
                build: Callable[[Solution], Build],
                build_uniform: Callable[[Label], Build], device: torch.device,
                cache: Any = None, signature: str | None = None) -> tuple[Build, MemoryReport]:
    """Measure the peak of the original (``work``) and of the plan ``built``; with a
    ``budget`` the plan is over, consider other plans (the min-cut plan unpadded, plans that
    weigh conversion bytes more, all-NCHW, all-NHWC), fastest predicted first, and return the
    first that fits (``PlanError`` when none does). Returns the build kept and the plan's
    ``memory`` record. With a ``cache`` and the plan's ``signature`` the two peaks are
    cached (they follow from the graph, shapes and plan), so a second plan runs no forward."""
    padded = [p.module for p in padding if p.chosen != UNPADDED]
    key = None
    if cache is not None and signature is not None:
        key = json.dumps(["memory", measured_on(device), torch.__version__,
                          str(dtype), signature, [(p.module, p.chosen) for p in padding]])
    peaks = cache.get(key, _valid_peaks) if key is not None else None
    if peaks is not None:
        original = MemoryPeak(*peaks["original"])
        planned = MemoryPeak(*peaks["planned"])
    else:
        original = peak_memory(work, inputs, dtype=dtype, device=device)
        planned = peak_memory(built.module, inputs, dtype=dtype, device=device)
        if key is not None:
            cache.put(key, {"original": list(original.__dict__.values()),
                            "planned": list(planned.__dict__.values())},
                      is_noisy=False)  # byte counts, not timings: no load can stretch them
    record = MemoryReport(
        method=planned.method, original=original.peak_bytes, planned=planned.peak_bytes,
        original_end=original.end_bytes, planned_end=planned.end_bytes,
        parameters_original=parameter_bytes(work), parameters_planned=parameter_bytes(built.module),
        budget=budget, chosen=kept + (" (padded)" if padded else ""))
    if budget is None or planned.peak_bytes <= budget:
        return built, record
    saved = sum(p.saved for p in padding if p.chosen != UNPADDED)
    first = record.chosen
    measured = {first: MemoryCandidate(planned.peak_bytes, predicted.get(kept, 0.0) - saved)}
    candidates: list[Candidate] = []
    if kept != "planned" or padded:
        candidates.append(Candidate("planned", predicted["planned"], lambda: build(solution)))
    for label, name in ((Label.CONTIGUOUS, "all_contiguous"),
                        (Label.CHANNELS_LAST, "all_channels_last")):
        if name != kept or padded:
            candidates.append(Candidate(name, predicted[name],
                                        functools.partial(build_uniform, label)))
    seen = [tuple(sorted(s.labels.items())) for s in solution.regions]
    for penalty in PENALTIES:
        relabelled = dataclasses.replace(solution, regions=tuple(
            dataclasses.replace(s, labels=_labels_weighing_bytes(s.form, s.table, penalty))
            for s in solution.regions))
        labels = [tuple(sorted(s.labels.items())) for s in relabelled.regions]
        if labels == seen:
            continue
        seen = labels
        cost = sum(_seconds(s.form, s.labels) for s in relabelled.regions)
        candidates.append(Candidate(f"fewer_conversion_bytes_x{penalty:g}", cost,
                                    functools.partial(build, relabelled)))
    candidates.sort(key=lambda c: c.predicted)
    try:
        best, chosen, tried = within_budget(
            candidates, budget, lambda b: peak_memory(b.module, inputs, dtype=dtype,
                                                     device=device))
    except PlanError as exc:
        raise PlanError(f"{exc} (the fastest plan, {first}, peaks at "
                        f"{planned.peak_bytes} bytes)") from None
    measured.update((name, MemoryCandidate(r["peak"], r["predicted"])) for name, r in tried.items())
    return chosen, dataclasses.replace(
        record, candidates=measured, chosen=best.name, planned=tried[best.name]["peak"],
        parameters_planned=parameter_bytes(chosen.module), padding_dropped=bool(padded))


def _seconds(form: Any, labels: Mapping[str, int]) -> float:
    return objective(Problem(form.seconds.unary, form.seconds.tensors), labels) or 0.0


def _labels_weighing_bytes(form: Any, table: Any, penalty: float) -> dict[str, Label]:
    """The min-cut labels when every conversion also costs ``penalty`` times the region's
    mean conversion seconds per byte, per byte it copies."""
    values = form.tensor_values  # the value each tensor term converts
    tensors = form.integer.tensors
    assert len(values) == len(tensors)
    nbytes = [table.conversions[v].nbytes for v in values]
    per_byte = sum(t.cost_to_0 + t.cost_to_1 for t in tensors) / max(2 * sum(nbytes), 1)
    weight = max(per_byte, 1e-9) * penalty
    heavier = tuple(Tensor(t.producer, t.consumers, t.cost_to_1 + round(weight * b),
                           t.cost_to_0 + round(weight * b)) for t, b in zip(tensors, nbytes, strict=True))
    scale = max(1, -(-sum(t.cost_to_0 + t.cost_to_1 for t in heavier) // 10**8))
    if scale > 1:  # keep the sum within scipy's int32 max-flow
        heavier = tuple(Tensor(t.producer, t.consumers, t.cost_to_1 // scale, t.cost_to_0 // scale)
                        for t in heavier)
    unary = {k: (a // scale, b // scale) for k, (a, b) in form.integer.unary.items()}
    problem = Problem(unary, heavier, form.integer.pins, form.integer.ties)
    try:
        labels = solve_min_cut(problem).labels
    except ValueError:
        labels = solve_min_cut(Problem(unary, heavier, form.integer.pins)).labels
    return {name: Label(label) for name, label in labels.items()}


@dataclass(frozen=True)
class MemoryDecision:
    """The build the memory step kept and its record (``Plan.memory``; ``None``: not run)."""

    build: Build
    record: MemoryReport | None
